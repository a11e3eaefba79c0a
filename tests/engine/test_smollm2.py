"""A real instruct model from its GGUF file: greedy parity with transformers (the torch path), the native
decode step within a small log-probability gap of it (Q8 activations), and sensible answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagegate import LLM, SamplingParams
from pagegate.engine import runners
from pagegate.engine.loading.loader import weight_bytes
from pagegate.engine.native_runner import NativeRunner
from pagegate.kernels import dispatch

from .conftest import hf

MAX_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Les enfants jouent dans le jardin et",
    "The three primary colors are",
    "<|im_start|>user\nName a planet.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf: Path) -> LLM:
    return LLM(str(smollm2_gguf), device="cpu", max_model_len=1024, kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def smollm2_torch(smollm2_gguf: Path) -> LLM:
    """Every step on the torch forward: the exact weights in float32, as transformers computes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEGATE_KERNEL_BACKEND", "reference")
        return LLM(str(smollm2_gguf), device="cpu", max_model_len=1024, kv_cache_memory="256MiB",
                   kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_gguf: Path) -> torch.nn.Module:
    return hf().AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                     dtype=torch.float32).eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def top2_gap(model: torch.nn.Module, ids: list[int]) -> tuple[float, list[int]]:
    """transformers' gap between its two best next-token logits after `ids`, and those two tokens."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    best = logits.topk(2)
    return float(best.values[0] - best.values[1]), best.indices.tolist()


def test_greedy_matches_transformers_on_the_same_gguf(smollm2_torch: LLM, hf_smollm2: torch.nn.Module) -> None:
    """Identical tokens, or a divergence where transformers' own top two logits are a float near-tie."""
    tokenizer = smollm2_torch.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in smollm2_torch.generate(prompts, params, use_tqdm=False)]
    identical = 0
    for prompt, mine in zip(prompts, ours, strict=True):
        theirs = hf_greedy(hf_smollm2, prompt)
        if mine == theirs:
            identical += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
        gap, best = top2_gap(hf_smollm2, prompt + mine[:first])
        assert gap < 1e-3 and mine[first] in best, (tokenizer.decode(prompt), first, gap)
    assert identical >= len(PROMPTS) // 2


@pytest.mark.parametrize("isa", dispatch.integer_isas())
def test_native_decode_stays_near_the_oracles_best_token(isa: str, smollm2_llm: LLM,
                                                         hf_smollm2: torch.nn.Module) -> None:
    """Each token the native step picks is within 0.35 nats of the best one by transformers' log-probabilities
    after the same tokens, and 0.03 on average over the run; a wrong kernel lands many nats away. (llama.cpp's own worst gap on
    this file was 0.31; with prompts on Q8 activations too, as llama.cpp's, the native step's worst was 0.32.)"""
    assert smollm2_llm.engine.runner.chunk_invariant and smollm2_llm.engine.one_path  # every step native
    tokenizer = smollm2_llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2 if isa == "portable" else None]]
    params = SamplingParams(temperature=0, max_tokens=6 if isa == "portable" else MAX_TOKENS, ignore_eos=True)
    try:
        assert dispatch.set_integer_isa(isa)
        ours = [o.outputs[0].token_ids for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    finally:
        dispatch.set_integer_isa(dispatch.integer_isas()[0])
    every = []
    for prompt, mine in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            logprobs = hf_smollm2(torch.tensor([prompt + mine[:-1]])).logits[0, len(prompt) - 1:].log_softmax(-1)
        gaps = logprobs.max(-1).values - logprobs[torch.arange(len(mine)), torch.tensor(mine)]
        assert float(gaps.max()) < 0.35, (tokenizer.decode(prompt), gaps.tolist())
        every.append(gaps)
    assert float(torch.cat(every).mean()) < 0.03


def test_answers_a_factual_question(smollm2_llm: LLM) -> None:
    # most phrasings' first token is a near-tie ("The" / "Le" / "La", <0.1 nats) that Q8 activations or the page
    # format flip; this one's margin is 2.4 nats on float32 and int8 pages alike
    messages = [{"role": "user", "content": "What is the name of the capital of France?"}]
    output = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert "Paris" in output.text
    assert output.finish_reason == "stop"  # <|im_end|> is an end-of-turn token


def test_int4_pages_answer_the_factual_question(smollm2_gguf: Path) -> None:
    """Rotated 4-bit pages (the quality figures: bench/kv_quality.py) keep the answer whose margin is 2.4 nats."""
    llm = LLM(str(smollm2_gguf), device="cpu", max_model_len=256, kv_cache_memory="16MiB", kv_cache_dtype="int4")
    assert llm.engine.runner.kv_format.name == "int4" and llm.engine.runner.chunk_invariant
    messages = [{"role": "user", "content": "What is the name of the capital of France?"}]
    assert "Paris" in llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text


def test_resident_weights_stay_near_the_file_size(smollm2_llm: LLM, smollm2_gguf: Path) -> None:
    """Q4_1 layers and the Q8_0 embedding (tied output) are served from their blocks, not float32: in the native core
    (no torch) that serves the file, and in the torch runner's model."""
    runner = smollm2_llm.engine.runner
    assert isinstance(runner, NativeRunner) and runner.weights.weight_bytes <= 1.3 * smollm2_gguf.stat().st_size
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runners, "runs_native", lambda config, elastic=False: False)
        torch_runner = LLM(str(smollm2_gguf), device="cpu", max_model_len=256, kv_cache_memory="16MiB").engine.runner
    assert weight_bytes(torch_runner.model) <= 1.3 * smollm2_gguf.stat().st_size
