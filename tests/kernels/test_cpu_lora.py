"""The LoRA updates of the native CPU step (pagegate.kernels.cpu_decode.LoRATable, cpu_lora.h) against torch's
x @ A.T @ B.T: packed shards, groups of several adapters with tokens in any order, widths that are not whole
vectors, on AVX2 and on the portable C."""

import numpy as np
import pytest
import torch

from pagegate.kernels import cpu_decode

ISAS = [isa for isa in ("avx2", "portable") if cpu_decode.set_lora_isa(isa)]
SHAPES = [((40, 72), (24, 40), (40, 2 * 52), (52, 40))]  # one layer: qkv, o, gate_up, down as (in, out)
MAX_RANK = 12


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    cpu_decode.set_lora_isa(request.param)
    yield request.param
    cpu_decode.set_lora_isa(ISAS[0])


def update(gen: torch.Generator, k: int, shards: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list]:
    """A random shrink [sum of ranks, k] and its shards (first column, first rank, expand [ranks, cols]) for
    shards given as (first column, cols, rank)."""
    rank = sum(r for _, _, r in shards)
    shrink = torch.randn(rank, k, generator=gen)
    parts, first = [], 0
    for column, cols, r in shards:
        parts.append((column, first, torch.randn(r, cols, generator=gen)))
        first += r
    return shrink, parts


def reference(x: torch.Tensor, out: torch.Tensor, token_slots: list[int], updates: dict) -> torch.Tensor:
    expected = out.clone().double()
    for t, slot in enumerate(token_slots):
        if slot in updates:
            shrink, shards = updates[slot]
            shrunk = shrink.double() @ x[t].double()
            for column, first, expand in shards:
                expected[t, column:column + expand.shape[1]] += shrunk[first:first + expand.shape[0]] @ expand.double()
    return expected.float()


def groups(token_slots: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    slots = np.asarray(token_slots, dtype=np.int32)
    adapted = np.flatnonzero(slots >= 0)
    order = adapted[np.argsort(slots[adapted], kind="stable")].astype(np.int32)
    group_slots, firsts = np.unique(slots[order], return_index=True)
    return group_slots.astype(np.int32), np.append(firsts, len(order)).astype(np.int32), order


@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_grouped_updates_match_torch(isa: str, tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    table = cpu_decode.LoRATable(3, SHAPES, MAX_RANK)
    shard_plans = {0: [(0, 40, 4), (56, 16, 3)], 1: [(0, 40, 2), (40, 16, 2), (56, 16, 2)], 2: [(20, 52, 5)]}
    updates = {slot: update(gen, 40, plan) for slot, plan in shard_plans.items()}
    for slot, (shrink, shards) in updates.items():
        table.set(slot, 0, 0, shrink, shards)
    token_slots = [int(s) for s in torch.randint(-1, 3, (tokens,), generator=gen)]
    x, out = torch.randn(tokens, 40, generator=gen), torch.randn(tokens, 72, generator=gen)
    expected = reference(x, out, token_slots, updates)
    table.add(0, 0, x, out, groups(token_slots))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


def test_a_slot_without_an_update_of_a_projection_and_a_cleared_slot_leave_it_alone(isa: str) -> None:
    gen = torch.Generator().manual_seed(1)
    table = cpu_decode.LoRATable(2, SHAPES, MAX_RANK)
    shrink, shards = update(gen, 52, [(0, 40, MAX_RANK)])
    table.set(1, 0, 3, shrink, shards)
    x, out = torch.randn(4, 52, generator=gen), torch.randn(4, 40, generator=gen)
    before = out.clone()
    table.add(0, 3, x, out, groups([0, 0, -1, 0]))
    assert torch.equal(out, before)
    table.add(0, 3, x, out, groups([1, -1, 0, 1]))
    torch.testing.assert_close(out, reference(x, before, [1, -1, 0, 1], {1: (shrink, shards)}), rtol=1e-5, atol=1e-4)
    table.clear(1)
    after = out.clone()
    table.add(0, 3, x, out, groups([1, 1, 1, 1]))
    assert torch.equal(out, after)


def test_updates_and_groups_that_do_not_fit_are_refused() -> None:
    table = cpu_decode.LoRATable(2, SHAPES, MAX_RANK)
    gen = torch.Generator().manual_seed(2)
    with pytest.raises(ValueError, match="rank 1 to 12"):
        table.set(0, 0, 1, *update(gen, 24, [(0, 40, MAX_RANK + 1)]))
    with pytest.raises(ValueError, match="does not fit"):
        table.set(0, 0, 1, *update(gen, 24, [(8, 40, 2)]))
    with pytest.raises(ValueError, match="overlap"):
        table.set(0, 0, 1, *update(gen, 24, [(0, 20, 2), (16, 8, 2)]))
    with pytest.raises(ValueError, match="shape"):
        table.set(0, 0, 1, *update(gen, 25, [(0, 40, 2)]))
    with pytest.raises(IndexError):
        table.set(2, 0, 1, *update(gen, 24, [(0, 40, 2)]))
    x, out = torch.zeros(3, 24), torch.zeros(3, 40)
    for bad in [(np.array([0], np.int32), np.array([0, 2], np.int32), np.array([0, 0], np.int32)),
                (np.array([2], np.int32), np.array([0, 1], np.int32), np.array([0], np.int32)),
                (np.array([0], np.int32), np.array([0, 1], np.int32), np.array([3], np.int32)),
                (np.array([0], np.int32), np.array([1, 1], np.int32), np.array([0], np.int32))]:
        with pytest.raises(ValueError):
            table.add(0, 1, x, out, bad)
