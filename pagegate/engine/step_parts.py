"""A step's input ids, its tokens cut into parts of at most the native decoder's call size, and its adapted rows
grouped by LoRA slot as the C takes them (numpy only: the torch runner and the native core both build steps here)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

    from pagegate.engine.sequence import Sequence as Seq

# a step's adapted rows by table slot, as cpu_decode.LoRATable takes them: (slot [G], start [G + 1], row [N]) int32
Groups = tuple[np.ndarray, np.ndarray, np.ndarray]


class StepArrays(Protocol):
    """What cutting a step reads of it (parallel.StepInputs has it, the native core's steps too)."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    block_tables: np.ndarray  # [B, W]
    seq_lens: np.ndarray  # [B]
    query_start_loc: np.ndarray  # [B + 1]
    key_ends: np.ndarray | None  # [T] or None


def step_token_ids(seqs: Sequence[Seq], counts: Sequence[int], total: int) -> np.ndarray:
    """The step's input ids [total] int64: each sequence's tokens computed this step, its known ones then the tokens
    guessed for it (speculation)."""
    return np.fromiter((t for s, n in zip(seqs, counts, strict=True)
                        for t in (*s.token_ids[s.num_computed - n + len(s.draft):s.num_computed], *s.draft)),
                       dtype=np.int64, count=total)


def sampled_rows(seqs: Sequence[Seq], starts: np.ndarray) -> list[int]:
    """The step's rows whose logits sample, in batch order: each sequence's last computed token, and the tokens
    guessed for it (speculation), where its prompt is done and it is no embedding's."""
    return [row for i, s in enumerate(seqs) if s.num_computed == len(s.token_ids) and not s.pools
            for row in range(starts[i + 1] - 1 - len(s.draft), starts[i + 1])]


def cut_step(step: StepArrays, groups: Groups | None,
             size: int) -> Iterator[tuple[tuple[tuple[np.ndarray, ...], Groups | None], int]]:
    """The step's tokens at most `size` at a time, as steps of their own (with the first token's index): a sequence
    cut across two parts is, in the first, as long as its last token there. NOTE: a token's arithmetic does not
    depend on the tokens beside it (cpu_decode.h), so the parts compute what one call would; but a token that sees
    keys past itself (key_ends: an image's) needs them written, so no cut falls inside such a run."""
    starts, lens = step.query_start_loc, step.seq_lens
    slots = _row_slots(groups, len(step.input_ids)) if groups is not None else None
    t0, total = 0, len(step.input_ids)
    while t0 < total:
        t1 = _cut_end(step, t0, size)
        first, last = np.searchsorted(starts, t0, "right") - 1, np.searchsorted(starts, t1, "left")
        begin = np.maximum(starts[first:last], t0)
        end = np.minimum(starts[first + 1:last + 1], t1)
        part_lens = (lens[first:last] - (starts[first + 1:last + 1] - end)).astype(np.int32)
        part_starts = np.concatenate(([0], np.cumsum(end - begin))).astype(np.int32)
        arrays = (step.input_ids[t0:t1], step.positions[t0:t1], step.slot_mapping[t0:t1],
                  np.ascontiguousarray(step.block_tables[first:last]), part_lens, part_starts)
        yield (arrays, None if slots is None else slot_groups(slots[t0:t1])), t0
        t0 = t1


def _cut_end(step: StepArrays, t0: int, size: int) -> int:
    """Where the part from t0 ends: `size` tokens on, or before, so that no token before the cut sees a key after it
    (a run of tokens that see past themselves ends where they all stop)."""
    t1 = min(t0 + size, len(step.input_ids))
    if step.key_ends is None or t1 == len(step.input_ids):
        return t1
    ends_here = np.flatnonzero(step.key_ends[t0:t1] <= step.positions[t0:t1])  # tokens that see no further
    if not len(ends_here):
        raise ValueError(f"a run of tokens that see each other is longer than one native call ({size} tokens)")
    return t0 + int(ends_here[-1]) + 1


def given_part(given: tuple[np.ndarray, torch.Tensor] | None, start: int,
               size: int) -> tuple[np.ndarray, torch.Tensor] | None:
    """The given input rows of tokens [start, start + size), numbered from start."""
    if given is None:
        return None
    import torch  # given rows are an image encoder's, on the torch path
    tokens, rows = given
    inside = (tokens >= start) & (tokens < start + size)
    return (tokens[inside] - start).astype(np.int32), rows[torch.from_numpy(inside)].contiguous()


def _row_slots(groups: Groups, tokens: int) -> np.ndarray:
    slot, start, token = groups
    row_slots = np.full(tokens, -1, np.int32)
    for i in range(len(slot)):
        row_slots[token[start[i]:start[i + 1]]] = slot[i]
    return row_slots


def slot_groups(row_slots: np.ndarray) -> Groups:
    """Rows with a slot (>= 0) grouped by it, each group in row order: (slot, start, row) as the kernel takes them."""
    adapted = np.flatnonzero(row_slots >= 0)
    rows = adapted[np.argsort(row_slots[adapted], kind="stable")].astype(np.int32)
    slots, firsts = np.unique(row_slots[rows], return_index=True)
    return slots.astype(np.int32), np.append(firsts, len(rows)).astype(np.int32), rows
