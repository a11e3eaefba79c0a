"""The offline API against transformers: greedy parity through the whole engine, under page pressure."""

import pytest
import torch

from pagegate import LLM, SamplingParams

from .conftest import SavedModel

PROMPT_LENGTHS = [5, 17, 16, 33, 1, 48, 9, 70]
MAX_TOKENS = 10


def make_prompts(vocab: int = 256) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(saved: SavedModel, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = saved.hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_all_pages_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["used_blocks"] == 0 and stats["running"] == stats["waiting"] == stats["swapped"] == 0
    assert stats["cpu_used_blocks"] == 0


ENGINE_SETUPS = {
    "roomy": dict(num_kv_blocks=64),
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=16),
    "recompute": dict(num_kv_blocks=12, max_num_batched_tokens=32, max_model_len=128),
    "swap": dict(num_kv_blocks=12, max_num_batched_tokens=32, max_model_len=128, swap_space=0.001),
}


@pytest.fixture(scope="module")
def references(request) -> dict:
    return {}


@pytest.mark.parametrize("arch", ["llama_model", "mistral_model", "qwen2_model"])
@pytest.mark.parametrize("setup", list(ENGINE_SETUPS))
def test_greedy_matches_transformers(arch, setup, request, references):
    saved = request.getfixturevalue(arch)
    prompts = make_prompts()
    if arch not in references:
        references[arch] = [hf_greedy(saved, p, MAX_TOKENS) for p in prompts]
    llm = LLM(str(saved.path), device="cpu", **ENGINE_SETUPS[setup])
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == references[arch]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    if setup in ("recompute", "swap"):
        assert llm.stats()["preemptions"] > 0
    if setup == "swap":
        assert llm.stats()["swap_in_blocks"] > 0
    assert_all_pages_free(llm)


def test_prompt_logits_match_transformers(llama_model):
    """Float32 logits of every prompt position within 1e-4 of transformers'."""
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64)
    engine = llm.engine
    prompt = make_prompts()[5]
    request = engine.add_request("r", prompt, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    runner = engine.runner
    seq = request.seqs[0]
    # every position samples here: ask the model for all rows directly
    block_tables, slots, positions, seq_lens, starts = runner.builder.build([seq.handle], batch.num_tokens)
    from pagegate.engine.model import AttentionMetadata
    attn = AttentionMetadata(*(torch.from_numpy(a) for a in (slots, block_tables, seq_lens, starts)))
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(prompt), torch.from_numpy(positions), engine.kv_cache.layers, attn)
        ours = engine.model.compute_logits(hidden)
        theirs = llama_model.hf_model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    engine.abort("r")
    assert_all_pages_free(llm)


def test_seeded_sampling_is_the_same_whatever_the_batch(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64)
    prompts = make_prompts()
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    alone = llm.generate([prompts[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(prompts, [other] * 3 + [seeded] + [other] * 4, use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    assert_all_pages_free(llm)


def test_stop_token_ids_end_the_output(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64)
    prompt = make_prompts()[1]
    free_run = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    stop_at = free_run.token_ids[2]
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    first = free_run.token_ids.index(stop_at)
    assert stopped.token_ids == free_run.token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    assert_all_pages_free(llm)


def test_too_long_prompt_is_rejected_with_both_numbers(llama_model):
    from pagegate.engine.params import InvalidParamError
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64, max_model_len=64)
    with pytest.raises(InvalidParamError, match="60 tokens and max_tokens is 10"):
        llm.generate([3] * 60, SamplingParams(max_tokens=10), use_tqdm=False)
    assert_all_pages_free(llm)


def test_pool_too_small_for_max_model_len_fails_at_start(llama_model):
    with pytest.raises(ValueError, match="needs 16 pages"):
        LLM(str(llama_model.path), device="cpu", num_kv_blocks=8)
