"""Embeddings from a generative model's hidden states (--pooling last|mean) against transformers' final-norm hidden
states; embedding requests batch with generations without changing them, chunked or waiting for pages; a
recomputed (preempted) prompt pools afresh."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagegate.config import CacheConfig, EngineConfig, SchedulerConfig
from pagegate.engine.engine import Engine
from pagegate.engine.errors import InvalidParamError
from pagegate.engine.pooling import pool_rows
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sequence import Request, Sequence

from .conftest import SavedModel

PROMPT_LENGTHS = [5, 17, 1, 40, 9, 33]
SETUPS = {
    "roomy": dict(cache=CacheConfig(num_kv_blocks=64), scheduler=SchedulerConfig()),
    "chunked": dict(cache=CacheConfig(num_kv_blocks=64), scheduler=SchedulerConfig(max_num_batched_tokens=16)),
    "tight": dict(cache=CacheConfig(num_kv_blocks=16, block_size=4),
                      scheduler=SchedulerConfig(max_num_batched_tokens=8, max_model_len=64)),
}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def reference(saved: SavedModel, prompt: list[int], mode: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = saved.hf_model.model(torch.tensor([prompt])).last_hidden_state[0].float()
    return F.normalize(hidden[-1] if mode == "last" else hidden.mean(dim=0), dim=-1)


def run(engine: Engine, requests: list[Request]) -> None:
    for request in requests:
        engine.add(request)
    for _ in range(10_000):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def greedy(engine: Engine, prompt: list[int], request_id: str) -> Request:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return engine.intake.make_request(request_id, prompt, params)


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("mode", ["last", "mean"])
def test_pooled_embeddings_match_transformers_beside_generations(llama_model: SavedModel, mode: str, setup: str):
    engine = Engine(EngineConfig(model=str(llama_model.path), device="cpu", dtype="float32", pooling=mode,
                                 **SETUPS[setup]))
    try:
        alone = greedy(engine, prompts()[3], "alone")
        run(engine, [alone])
        embeds = [engine.intake.make_request(f"e{i}", p, SamplingParams(), embed=True) for i, p in enumerate(prompts())]
        beside = greedy(engine, prompts()[3], "beside")
        run(engine, [embeds[0], beside, *embeds[1:]])
        assert beside.seqs[0].output_token_ids == alone.seqs[0].output_token_ids  # the generation did not change
        for request, prompt in zip(embeds, prompts(), strict=True):
            assert request.finished and request.error is None and request.embedding is not None
            assert request.seqs[0].output_token_ids == []  # nothing was generated
            expected = reference(llama_model, prompt, mode)
            assert F.cosine_similarity(request.embedding, expected, dim=0) > 1 - 1e-5
            torch.testing.assert_close(request.embedding, expected, atol=1e-4, rtol=1e-4)
        stats = engine.stats()
        assert stats.used_blocks == 0 and stats.running == stats.waiting == 0
    finally:
        engine.close()


def test_a_server_without_pooling_refuses_embeddings(llama_model: SavedModel):
    engine = Engine(EngineConfig(model=str(llama_model.path), device="cpu", cache=CacheConfig(num_kv_blocks=16)))
    try:
        with pytest.raises(InvalidParamError, match="--pooling"):
            engine.intake.make_request("e", [5, 6, 7], SamplingParams(), embed=True)
    finally:
        engine.close()


def test_an_embedding_input_may_fill_the_context(llama_model: SavedModel):
    engine = Engine(EngineConfig(model=str(llama_model.path), device="cpu", pooling="last",
                                 cache=CacheConfig(num_kv_blocks=16), scheduler=SchedulerConfig(max_model_len=32)))
    try:
        request = engine.intake.make_request("full", list(range(3, 35)), SamplingParams(), embed=True)
        run(engine, [request])
        assert request.embedding is not None and request.embedding.shape == (64,)
        with pytest.raises(InvalidParamError, match="maximum context length"):
            engine.intake.make_request("over", list(range(3, 36)), SamplingParams(), embed=True)
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_a_recomputed_prompt_pools_afresh(mode: str):
    """Preempted by recompute, a prompt's chunks come again from position 0: the first pass must not count."""
    request = Request("r", None, [1, 2, 3, 4], SamplingParams(), embed=True)
    seq = Sequence(request, 0, [1, 2, 3, 4], 4)
    rows = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    seq.num_computed = 2
    pool_rows(seq, torch.full((2, 8), 100.0), 0, mode)  # the lost first pass
    for start in (0, 2):  # recomputed: from position 0, in two chunks
        seq.num_computed = start + 2
        pool_rows(seq, rows[start:start + 2], start, mode)
    expected = rows[-1] if mode == "last" else rows.mean(dim=0)
    torch.testing.assert_close(request.embedding, F.normalize(expected, dim=-1))


def test_llm_embed_answers_in_prompt_order(llama_model: SavedModel):
    from pagegate import LLM

    llm = LLM(str(llama_model.path), device="cpu", dtype="float32", num_kv_blocks=64, pooling="mean")
    outputs = llm.embed(prompts(), use_tqdm=False)
    assert [out.prompt_token_ids for out in outputs] == prompts()
    for out, prompt in zip(outputs, prompts(), strict=True):
        expected = reference(llama_model, prompt, "mean")
        assert F.cosine_similarity(torch.tensor(out.outputs.embedding), expected, dim=0) > 1 - 1e-5
    assert llm.generate([prompts()[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_llm_embed_with_a_sentence_encoder_is_sentence_transformers(minilm_folder):
    from sentence_transformers import SentenceTransformer

    from pagegate import LLM

    texts = ["paged attention keeps the cache in blocks", "a cat sat on the mat", "日本語の文"]
    ours = LLM(str(minilm_folder), task="embed", device="cpu", dtype="float32", num_kv_blocks=64).embed(
        texts, use_tqdm=False)
    theirs = SentenceTransformer(str(minilm_folder), device="cpu").encode(texts, convert_to_tensor=True)
    for out, expected in zip(ours, theirs, strict=True):
        assert F.cosine_similarity(torch.tensor(out.outputs.embedding), expected.float(), dim=0) > 1 - 1e-5


def test_a_later_generation_is_not_behind_every_embedding(llama_model: SavedModel):
    """Issue 41 (5): embeddings take at most a share of each step beside generations (scheduler.POOLING_SHARE), so a
    short completion sent after a big embedding request is admitted at once and ends long before it; the
    embeddings still advance every step and come out as they would alone."""
    engine = Engine(EngineConfig(model=str(llama_model.path), device="cpu", dtype="float32", pooling="last",
                                 cache=CacheConfig(num_kv_blocks=64),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=16)))
    try:
        long_prompts = [list(range(3 + i, 43 + i)) for i in range(8)]  # 8 x 40 tokens: 20 steps of the budget
        embeds = [engine.intake.make_request(f"e{i}", p, SamplingParams(), embed=True)
                  for i, p in enumerate(long_prompts)]
        for request in embeds:
            engine.add(request)
        engine.step()
        victim = greedy(engine, [5, 6, 7], "victim")
        engine.add(victim)

        def pooled() -> int:
            return sum(seq.num_computed for request in embeds for seq in request.seqs)

        steps = 0
        while not victim.finished and steps < 100:
            before = pooled()
            engine.step()
            steps += 1
            assert pooled() > before  # the embeddings advance in every step
        assert steps <= 1 + victim.params.max_tokens  # its prefill, then a token a step
        assert not all(request.finished for request in embeds)  # they were still running when it ended
        run(engine, [])
        for request, prompt in zip(embeds, long_prompts, strict=True):
            assert request.error is None
            torch.testing.assert_close(request.embedding, reference(llama_model, prompt, "last"), atol=1e-4, rtol=1e-4)
    finally:
        engine.close()
