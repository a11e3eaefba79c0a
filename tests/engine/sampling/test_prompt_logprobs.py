"""Prompt logprobs equal a transformers forward's log_softmax, however the prompt is computed: in one step, in
chunks beside other requests, after its prefix was cached, for n > 1 choices."""

from __future__ import annotations

import pytest
import torch

from pagegate import LLM, SamplingParams
from pagegate.engine.outputs import Logprob
from tests.engine.conftest import SavedModel

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(45)]
K = 3


def reference(model: SavedModel, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model.hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check(scored: list[Logprob | None] | None, expected: torch.Tensor, prompt: list[int]) -> None:
    assert scored is not None and len(scored) == len(prompt) and scored[0] is None
    for position, logprob in enumerate(scored[1:]):
        assert logprob is not None
        row, token = expected[position], prompt[position + 1]
        assert logprob.token_id == token
        assert logprob.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert logprob.rank == int((row > row[token]).sum()) + 1
        values, ids = row.topk(K)
        assert list(logprob.top) == ids.tolist()
        assert list(logprob.top.values()) == pytest.approx(values.tolist(), abs=1e-4)


def engine(model: SavedModel, **overrides: object) -> LLM:
    """float32 pages by name (CPU's default is int8): prompt logprobs are held to transformers' within 1e-4."""
    return LLM(str(model.path), device="cpu", **{"num_kv_blocks": 64, "max_model_len": 256,
                                                 "kv_cache_dtype": "float32", **overrides})


@pytest.mark.parametrize("chunk", [2048, 16, 24])
def test_prompt_logprobs_match_transformers(llama_model: SavedModel, chunk: int) -> None:
    llm = engine(llama_model, max_num_batched_tokens=chunk)
    others = [[5, 6, 7, 8] * 6, list(range(10, 40))]
    params = [SamplingParams(max_tokens=3, temperature=0)] * len(others)
    outputs = llm.generate([*others, PROMPT], [*params, SamplingParams(max_tokens=3, prompt_logprobs=K)],
                           use_tqdm=False)
    check(outputs[-1].prompt_logprobs, reference(llama_model, PROMPT), PROMPT)
    assert all(out.prompt_logprobs is None for out in outputs[:-1])


def test_a_cached_prefix_is_computed_again_to_be_scored(llama_model: SavedModel) -> None:
    llm = engine(llama_model)
    llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)  # its full pages are cached now
    again = llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    scored = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=K), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0
    check(scored.prompt_logprobs, reference(llama_model, PROMPT), PROMPT)


def test_n_choices_share_one_scored_prompt(llama_model: SavedModel) -> None:
    out = engine(llama_model).generate([PROMPT], SamplingParams(n=3, max_tokens=2, seed=1, prompt_logprobs=K),
                                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check(out.prompt_logprobs, reference(llama_model, PROMPT), PROMPT)


def test_a_one_token_prompt_has_only_the_null_entry(llama_model: SavedModel) -> None:
    out = engine(llama_model).generate([[9]], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
