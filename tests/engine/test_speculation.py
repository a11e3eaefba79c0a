"""N-gram speculation: the index guesses what followed, and the engine's output with speculation is the output
without it, token for token: greedy and seeded sampling, batches, n > 1, grammars, stops, page pressure."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagegate.engine
from pagegate import LLM, SamplingParams
from pagegate.config import SpeculativeConfig
from pagegate.engine.speculation import NgramIndex
from tests.engine.conftest import TINY, SavedModel, hf, save_hf_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "max_batch_size": 64}


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), cut=st.integers(0, 40), k=st.integers(1, 5))
def test_the_index_guesses_what_followed_the_latest_earlier_match(tokens: list[int], cut: int, k: int) -> None:
    index = NgramIndex(2, 3)
    index.guess(tokens[:cut], k)  # indexed in two goes, as a growing sequence is
    expected: list[int] = []
    for n in (3, 2):
        if len(tokens) < n:
            continue
        ends = [end for end in range(n, len(tokens)) if tokens[end - n:end] == tokens[len(tokens) - n:]]
        if ends:
            expected = tokens[ends[-1]:ends[-1] + k]
            break
    assert index.guess(tokens, k) == expected


def test_the_config_reads_vllms_json() -> None:
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 1}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (5, 1, 1)
    for bad in ('{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"prompt_lookup_min": 3, '
                '"prompt_lookup_max": 2}', '{"draft": 1}'):
        with pytest.raises(ValueError):
            SpeculativeConfig.from_json(bad)


def prompts() -> list[list[int]]:
    """Prompts that repeat themselves (copy-heavy work), and one that does not."""
    gen = torch.Generator().manual_seed(3)
    motifs = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 9, 3, 12)]
    return [motif * (40 // len(motif)) for motif in motifs] + [torch.randint(3, 250, (30,), generator=gen).tolist()]


def generate(speculative: dict | None, params: SamplingParams | list[SamplingParams], **engine) -> tuple:
    llm = LLM(device="cpu", speculative_config=speculative, **{"num_kv_blocks": 64, "max_model_len": 256, **engine})
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    stats = llm.stats()
    assert stats.used_blocks == 0 and stats.running == stats.waiting == stats.swapped == 0
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs], stats


SETUPS = {
    "roomy": {},
    "chunked": {"max_num_batched_tokens": 24},
    "recompute": {"num_kv_blocks": 14, "max_num_batched_tokens": 48, "max_model_len": 128},
    "swap": {"num_kv_blocks": 14, "max_num_batched_tokens": 48, "max_model_len": 128, "swap_space": 0.001},
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_greedy_output_is_the_same_with_speculation(setup: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=1)
    plain, _ = generate(None, params, **SETUPS[setup])
    guessed, stats = generate(NGRAM, params, **SETUPS[setup])
    assert guessed == plain
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    assert sum(stats.spec_accepted_per_position) == stats.spec_accepted_tokens
    if setup in ("recompute", "swap"):
        assert stats.preemptions > 0


def test_seeded_sampling_draws_the_same_tokens_with_speculation() -> None:
    """Every sampling parameter applies to the model's distribution at each guessed position, and a seeded
    request's generator draws once per token whether or not its tokens were guessed."""
    params = [SamplingParams(temperature=0.7, seed=seed, max_tokens=30, ignore_eos=True, top_p=0.9, top_k=20,
                             presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1,
                             logit_bias={7: 2.0}, n=2) for seed in range(5)]
    plain, _ = generate(None, params)
    guessed, stats = generate(NGRAM, params)
    assert guessed == plain and stats.spec_accepted_tokens > 0


def test_grammars_stops_and_max_tokens_inside_a_kept_run() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": ["x", "yy"]}}},
              "required": ["a"]}
    from pagegate.engine.sampling.structured import StructuredOutputsParams

    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[100, 101, 102])]
    for param in params:
        plain, _ = generate(None, param)
        guessed, _ = generate(NGRAM, param)
        assert guessed == plain
    structured, _ = generate(NGRAM, params[0])
    for choices in structured:
        (_, text, reason), = choices
        if reason == "stop":
            assert set(json.loads(text)) == {"a"}


def test_kept_guesses_are_cached_as_the_tokens_they_are() -> None:
    """A rejected guess never reaches the prefix cache: the prompt and output again hit every full page."""
    llm = LLM(device="cpu", speculative_config=NGRAM, num_kv_blocks=64, max_model_len=256)
    prompt = prompts()[0]
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    tokens = prompt + output[0].outputs[0].token_ids
    assert llm.stats().spec_accepted_tokens > 0
    again = llm.generate([tokens], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(tokens) - 1) // 16 * 16


def test_speculation_steps_aside_for_a_large_batch() -> None:
    _, stats = generate({**NGRAM, "max_batch_size": 2}, SamplingParams(temperature=0, max_tokens=10,
                                                                         ignore_eos=True))
    assert stats.spec_draft_tokens == 0


CHI2_DF2_P001 = 13.82  # the chi-square distribution's 0.999 quantile at 2 degrees of freedom


def top_logprobs(llm: LLM, prompt: list[int]) -> dict[int, float]:
    [first] = llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=3), use_tqdm=False)[0].outputs[0].logprobs
    return first.top


def test_a_kept_guess_is_followed_by_the_models_own_distribution() -> None:
    """Sampled with speculation over many seeds, the token after a kept guess (sampled from the guess's row of
    the verifying forward) follows the model's distribution there, computed without speculation: chi-square."""
    plain = LLM(device="cpu", num_kv_blocks=64, max_model_len=256)
    base = torch.randint(3, 250, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    t0 = max(top_logprobs(plain, base).items(), key=lambda item: item[1])[0]
    t1 = max(top_logprobs(plain, base + [t0]).items(), key=lambda item: item[1])[0]
    prompt = [t0, t1, *base]  # after a likely first token t0, the index guesses the likely t1
    assert NgramIndex(1, 3).guess(prompt + [t0], 1) == [t1]
    config = {**NGRAM, "num_speculative_tokens": 1, "prompt_lookup_min": 1, "max_batch_size": 4096,
              "max_step_tokens": 4096}
    llm = LLM(device="cpu", speculative_config=config, num_kv_blocks=1024, max_model_len=256, max_num_seqs=256,
              max_num_batched_tokens=4096)
    params = [SamplingParams(temperature=1.0, top_k=3, seed=seed, max_tokens=3, ignore_eos=True)
              for seed in range(1500)]
    outputs = [o.outputs[0].token_ids for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]
    seen = [third for first, second, third in outputs if (first, second) == (t0, t1)]
    assert llm.stats().spec_accepted_tokens >= len(seen) > 200
    weights = {token: math.exp(logprob) for token, logprob in top_logprobs(plain, prompt + [t0, t1]).items()}
    expected = {token: len(seen) * weight / sum(weights.values()) for token, weight in weights.items()}
    chi2 = sum((seen.count(token) - count) ** 2 / count for token, count in expected.items())
    assert set(seen) <= set(weights) and chi2 < CHI2_DF2_P001, (chi2, len(seen), expected)


# -- a draft model ---------------------------------------------------------------------------------------------
DEFAULT_MODEL = str(Path(pagegate.engine.__file__).parent / "default_model")


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random one-layer model of the default model's vocabulary: it guesses, mostly wrong."""
    vocab = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())["vocab_size"]
    config = hf().LlamaConfig(**{**TINY, "vocab_size": vocab, "num_hidden_layers": 1}, bos_token_id=0,
                              eos_token_id=1)
    return str(save_hf_model(tmp_path_factory.mktemp("draft"), config, seed=4).path)


def test_the_model_drafting_for_itself_is_right_nearly_always() -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, _ = generate(None, params)
    drafted, stats = generate({"model": DEFAULT_MODEL, "num_speculative_tokens": 4, "max_batch_size": 64}, params)
    assert drafted == plain
    assert stats.spec_accepted_tokens >= 0.9 * stats.spec_draft_tokens > 0


@pytest.mark.parametrize("setup", ["roomy", "recompute"])
def test_a_small_draft_keeps_greedy_and_seeded_output(small_draft: str, setup: str) -> None:
    config = {"model": small_draft, "num_speculative_tokens": 3, "max_batch_size": 64}
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True, n=2)):
        plain, _ = generate(None, params, **SETUPS[setup])
        drafted, stats = generate(config, params, **SETUPS[setup])
        assert drafted == plain and stats.spec_draft_tokens > 0


def test_a_draft_of_another_vocabulary_is_refused(llama_model: SavedModel) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(device="cpu", num_kv_blocks=64, max_model_len=256, speculative_config={"model": str(llama_model.path)})


def test_kept_tokens_carry_their_logprobs() -> None:
    def run(speculative: dict | None) -> tuple[list, object]:
        llm = LLM(device="cpu", speculative_config=speculative, num_kv_blocks=64, max_model_len=256)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
        return [o.outputs[0].logprobs for o in llm.generate(prompts(), params, use_tqdm=False)], llm.stats()

    (plain, _), (guessed, stats) = run(None), run(NGRAM)
    assert stats.spec_accepted_tokens > 0
    for a, b in zip(plain, guessed, strict=True):
        assert [p.token_id for p in a] == [p.token_id for p in b]
        assert [p.logprob for p in a] == pytest.approx([p.logprob for p in b], abs=1e-5)
        assert [sorted(p.top) for p in a] == [sorted(p.top) for p in b]
