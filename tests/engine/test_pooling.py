"""Embeddings from a generative model's hidden states (--pooling last|mean) against transformers' final-norm hidden
states; embedding requests batch with generations without changing them, chunked or waiting for pages; a
recomputed (preempted) prompt pools afresh."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from pagegate.config import CacheConfig, EngineConfig, SchedulerConfig
from pagegate.engine.engine import Engine
from pagegate.engine.errors import InvalidParamError
from pagegate.engine.pooling import pool_rows
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.scheduler import POOLING_SHARE, POOLING_SLICE_MIN, POOLING_SLICE_S, ScheduledBatch
from pagegate.engine.sequence import Request, Sequence

from .conftest import SavedModel

PROMPT_LENGTHS = [5, 17, 1, 40, 9, 33]
# pooled embeddings are held to transformers' float32 hidden states: float32 pages by name (CPU's default is int8)
FLOAT32 = "float32"
SETUPS = {
    "roomy": dict(cache=CacheConfig(num_kv_blocks=64, kv_cache_dtype=FLOAT32), scheduler=SchedulerConfig()),
    "chunked": dict(cache=CacheConfig(num_kv_blocks=64, kv_cache_dtype=FLOAT32),
                    scheduler=SchedulerConfig(max_num_batched_tokens=16)),
    "tight": dict(cache=CacheConfig(num_kv_blocks=16, block_size=4, kv_cache_dtype=FLOAT32),
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
            embedding = torch.from_numpy(request.embedding)
            assert F.cosine_similarity(embedding, expected, dim=0) > 1 - 1e-5
            torch.testing.assert_close(embedding, expected, atol=1e-4, rtol=1e-4)
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
    torch.testing.assert_close(torch.from_numpy(request.embedding), F.normalize(expected, dim=-1))


def test_llm_embed_answers_in_prompt_order(llama_model: SavedModel):
    from pagegate import LLM

    llm = LLM(str(llama_model.path), device="cpu", dtype="float32", num_kv_blocks=64, pooling="mean",
              kv_cache_dtype=FLOAT32)
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


def test_an_encoder_embeds_in_whole_steps(minilm_folder):
    """An engine that serves embeddings alone (--task embed) has no generation to slice them for: its sentences
    are encoded in steps of the whole token budget, as many as fit (scheduler.generates)."""
    engine = Engine(EngineConfig(model=str(minilm_folder), task="embed", device="cpu", dtype="float32",
                                 cache=CacheConfig(num_kv_blocks=256, enable_prefix_caching=False)))
    try:
        sentences = [[101, *range(1000 + i, 1000 + i + 198), 102] for i in range(8)]  # 8 x 200 tokens
        assert 8 * 200 > 4 * POOLING_SLICE_MIN and engine.scheduler.generates is False
        embeds = embed_all(engine, sentences)
        engine.step()
        assert all(request.finished and request.embedding is not None for request in embeds)
    finally:
        engine.close()


@dataclass(frozen=True)
class Step:
    pooled: int  # embedding tokens
    prompt: bool  # held a prompt token (a prefill's cost), not decodes alone
    generations: int  # sequences of generations it held


class StepClock:
    """The engine's steps under a clock of stated costs (the scheduler's `now`): DECODE_S a step, and `token_s` more
    for each embedding token it holds, so the time embeddings get is a matter of state, not of this machine's speed.
    Records what each step held."""

    DECODE_S = 0.01

    def __init__(self, engine: Engine, token_s: float) -> None:
        self.now, self.token_s = 100.0, token_s
        self.steps: list[Step] = []
        self.schedule = engine.scheduler.schedule
        engine.scheduler.schedule = self.scheduled  # type: ignore[method-assign]

    def scheduled(self, now: float | None = None) -> ScheduledBatch:
        batch = self.schedule(self.now)
        pooled = sum(n for s, n in zip(batch.seqs, batch.num_tokens, strict=True) if s.pools)
        generations = sum(1 for seq in batch.seqs if not seq.pools)
        prompt = any(s.num_computed - n < s.num_prompt_tokens for s, n in zip(batch.seqs, batch.num_tokens, strict=True))
        self.steps.append(Step(pooled, prompt, generations))
        self.now += self.cost(self.steps[-1])
        return batch

    def cost(self, step: Step) -> float:
        return self.DECODE_S + self.token_s * step.pooled


def embed_all(engine: Engine, prompts: list[list[int]]) -> list[Request]:
    requests = [engine.intake.make_request(f"e{i}", p, SamplingParams(), embed=True) for i, p in enumerate(prompts)]
    for request in requests:
        engine.add(request)
    return requests


def long_inputs(inputs: int) -> list[list[int]]:
    return [[3 + (7 * i + p) % 250 for p in range(250)] for i in range(inputs)]


def pooling_engine(saved: SavedModel) -> Engine:
    return Engine(EngineConfig(model=str(saved.path), device="cpu", dtype="float32", pooling="last",
                               cache=CacheConfig(num_kv_blocks=512, kv_cache_dtype=FLOAT32)))


@pytest.mark.parametrize("inputs", [2, 8])
def test_a_later_generation_is_not_behind_every_embedding(llama_model: SavedModel, inputs: int):
    """Issue 41 (5), issue 64 (11): embeddings run in slices, alone too, and beside generations a slice earns them
    as long again of steps without embedding work (scheduler.POOLING_SHARE). A short completion sent while a slice
    runs waits for that slice alone: its steps hold no embedding token, no prompt token after its own prefill (a
    decode step's cost, not a prefill's), and it ends in as many steps whatever the size of the embeddings; they
    then finish as they would alone."""
    engine = pooling_engine(llama_model)
    try:
        clock = StepClock(engine, token_s=0.004)  # a slice takes longer than the completion's twelve steps
        embeds = embed_all(engine, long_inputs(inputs))
        engine.step()
        assert 0 < clock.steps[0].pooled < 250 * inputs and clock.steps[0].generations == 0  # alone, a slice
        victim = greedy(engine, [5, 6, 7], "victim")
        engine.add(victim)
        done_before = [request.finished for request in embeds]  # the first slice may end an input
        while not victim.finished and len(clock.steps) < 100:
            engine.step()
        beside = clock.steps[1:]
        assert len(beside) == victim.params.max_tokens  # its prefill's step samples its first token
        assert beside == [Step(0, True, 1)] + [Step(0, False, 1)] * (len(beside) - 1)
        assert [request.finished for request in embeds] == done_before and not all(done_before)
        run(engine, [])
        for request, prompt in zip(embeds, long_inputs(inputs), strict=True):
            assert request.error is None
            torch.testing.assert_close(torch.from_numpy(request.embedding), reference(llama_model, prompt, "last"),
                                       atol=1e-4, rtol=1e-4)
    finally:
        engine.close()


def test_embeddings_keep_their_share_beside_a_long_generation(llama_model: SavedModel):
    """Beside a generation that outlasts several slices, embeddings still advance: after each slice, generation
    steps run for as long as the slice took (POOLING_SHARE, one half), then the next slice comes (with the
    generation's decode in it); no step is empty, and once the generation ends the embeddings take every step."""
    engine = pooling_engine(llama_model)
    try:
        clock = StepClock(engine, token_s=0.004)
        params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
        generation = engine.intake.make_request("long", [5, 6, 7], params)
        engine.add(generation)
        embeds = embed_all(engine, long_inputs(8))
        run(engine, [])
        assert generation.finished and all(request.embedding is not None for request in embeds)
        assert all(step.pooled or step.generations for step in clock.steps)  # none empty
        last = max(i for i, step in enumerate(clock.steps) if step.generations)
        slices = [i for i, step in enumerate(clock.steps[:last + 1]) if step.pooled]
        assert len(slices) >= 3 and slices[0] == 0  # the first beside its prefill
        share = (1 - POOLING_SHARE) / POOLING_SHARE
        for a, b in zip(slices, slices[1:], strict=False):
            assert clock.steps[a].generations == 1  # its decode rides in the slice
            assert abs((b - a - 1) - clock.cost(clock.steps[a]) * share / clock.DECODE_S) <= 1
        assert all(step.pooled and not step.generations for step in clock.steps[last + 1:])
    finally:
        engine.close()


@pytest.mark.parametrize("token_s", [1e-5, 0.001, 0.1])
def test_slices_take_about_their_time(llama_model: SavedModel, token_s: float):
    """A slice is sized from the time the last one took (POOLING_SLICE_S; halved or doubled at most a slice): where
    tokens are cheap (a GPU) it grows to the whole token budget, where they are dear it shrinks to
    POOLING_SLICE_MIN, and in between a step holding one takes about POOLING_SLICE_S."""
    engine = pooling_engine(llama_model)
    budget = engine.config.scheduler.step_tokens
    try:
        clock = StepClock(engine, token_s)
        embed_all(engine, long_inputs(16))
        run(engine, [])
        pooled = [step.pooled for step in clock.steps]
        assert all(0 < n <= budget for n in pooled)
        settled = clock.steps[3:-2]  # after a few slices, before the last input's two pieces
        if token_s == 1e-5:
            assert max(pooled) == budget
        elif token_s == 0.1:
            assert settled and {step.pooled for step in settled} == {POOLING_SLICE_MIN}
        else:
            assert settled and all(POOLING_SLICE_S / 2 <= clock.cost(step) <= 2 * POOLING_SLICE_S for step in settled)
    finally:
        engine.close()
