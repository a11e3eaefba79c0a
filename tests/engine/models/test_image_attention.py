"""Tokens that see past themselves (key_ends: an image a model reads bidirectionally, Gemma 3) on the native step and
on the torch forward's reference attention: the same result, a run that is never cut between native calls, and
what the mask means (a token of the run sees its later tokens; a token before it does not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagegate import LLM
from pagegate.engine.forward import forward
from pagegate.engine.parallel import StepInputs
from pagegate.kernels import cpu_decode

from ..conftest import SavedModel

BLOCK = 16
NO_PAIRS = np.zeros((0, 2), dtype=np.int32)
LENGTHS = (40, 20)  # two prompts computed whole in one step
IMAGES = ((10, 30), (5, 10))  # each one's run of tokens that see each other: [start, end)


def step(ids: np.ndarray, bidirectional: bool = True) -> StepInputs:
    positions = np.concatenate([np.arange(n) for n in LENGTHS]).astype(np.int64)
    tables = np.array([[0, 1, 2], [3, 4, -1]], dtype=np.int32)
    slots = np.concatenate([tables[i][np.arange(n) // BLOCK] * BLOCK + np.arange(n) % BLOCK
                            for i, n in enumerate(LENGTHS)]).astype(np.int64)
    starts = np.array([0, LENGTHS[0], sum(LENGTHS)], dtype=np.int32)
    key_ends = positions.copy()
    for offset, (start, end) in zip(starts, IMAGES, strict=False):
        key_ends[offset + start:offset + end] = end - 1
    return StepInputs(ids, positions, slots, tables, np.array(LENGTHS, dtype=np.int32), starts, NO_PAIRS, NO_PAIRS,
                      NO_PAIRS, None, key_ends if bidirectional else None)


@pytest.fixture(scope="module", params=["llama_model", "mistral_model"])  # mistral: a 5-token sliding window
def llm(request: pytest.FixtureRequest) -> LLM:
    model: SavedModel = request.getfixturevalue(request.param)
    engine = LLM(str(model.path), device="cpu", num_kv_blocks=16, enable_prefix_caching=False,
                 kv_cache_dtype="float32")
    yield engine
    engine.shutdown()


def hidden(llm: LLM, inputs: StepInputs, native: bool, max_tokens: int | None = None) -> torch.Tensor:
    runner = llm.engine.runner
    decoder = runner.native
    assert decoder is not None
    decoder.max_tokens = max_tokens or cpu_decode.MAX_TOKENS
    return forward(runner.model, runner.kv_cache, inputs, decoder if native else None).clone()


def prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 200, sum(LENGTHS)).astype(np.int64)


def test_the_native_step_attends_as_the_reference_does(llm: LLM) -> None:
    ids = prompt(0)
    native, torch_path = hidden(llm, step(ids), native=True), hidden(llm, step(ids), native=False)
    torch.testing.assert_close(native, torch_path, rtol=1e-4, atol=1e-4)
    causal = hidden(llm, step(ids, bidirectional=False), native=True)
    first, end = IMAGES[0]
    assert not torch.allclose(native[first:end - 1], causal[first:end - 1])  # the run's tokens see further
    assert torch.equal(native[:first], causal[:first])  # (after the run, tokens read its keys: they differ too)


@pytest.mark.parametrize("native", [True, False])
def test_a_token_of_the_run_sees_the_runs_later_tokens_and_no_token_before_it_does(llm: LLM, native: bool) -> None:
    ids = prompt(1)
    changed = ids.copy()
    start, end = IMAGES[0]
    changed[end - 3] += 1  # a late token of the first prompt's run
    before, after = hidden(llm, step(ids), native), hidden(llm, step(changed), native)
    assert torch.equal(before[:start], after[:start])
    assert not torch.allclose(before[start], after[start])
    assert torch.equal(before[LENGTHS[0]:], after[LENGTHS[0]:])  # the other sequence


def test_calls_of_the_native_step_never_cut_a_run(llm: LLM) -> None:
    """Calls of 12 tokens would cut both runs: the cuts move back to where a run starts, and each token's bits are
    those of one call."""
    ids = prompt(2)
    assert torch.equal(hidden(llm, step(ids), native=True, max_tokens=24),
                       hidden(llm, step(ids), native=True, max_tokens=256))
    with pytest.raises(ValueError, match="longer than one native call"):
        hidden(llm, step(ids), native=True, max_tokens=12)

