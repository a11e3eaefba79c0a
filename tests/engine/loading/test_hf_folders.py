"""Hugging Face folders as current transformers writes them, served end to end: bfloat16 / float16
checkpoints, sharded weights, a list of eos ids in generation_config.json, chat_template.jinja."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from pagegate import LLM, SamplingParams
from pagegate.kernels import reference

from ..conftest import SavedModel, hf
from ..test_llm import assert_all_pages_free, hf_greedy, make_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# Our half-precision path attends in float32, transformers' in the half dtype, so a near tie may flip:
# every token we pick must be within this of transformers' best logit (a few units in the last place
# at the tiny models' logit sizes, below 8).
NEAR_TIE = {torch.bfloat16: 0.125, torch.float16: 0.02}


def test_half_checkpoint_is_served_in_the_dtype_asked_for(half_model: SavedModel,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    dtype = half_model.hf_model.dtype
    name = str(dtype).removeprefix("torch.")
    assert json.loads((half_model.path / "config.json").read_text())["dtype"] == name
    attention_calls = []
    torch_attention = reference.paged_attention
    monkeypatch.setattr(reference, "paged_attention",
                        lambda *a, **k: attention_calls.append(1) or torch_attention(*a, **k))
    # a small pool and budget: chunked prefill, preemption and swap all run in the half dtype
    llm = LLM(str(half_model.path), device="cpu", dtype=name, num_kv_blocks=12, max_num_batched_tokens=32,
              max_model_len=128, swap_space=0.001, kv_cache_dtype=name)
    assert llm.engine.runner.model.dtype == llm.engine.runner.kv_cache.layers[0][0].dtype == dtype
    prompts = make_prompts()[:6]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert attention_calls  # the fused CPU kernel is float32-only: half caches go to the torch reference
    assert llm.stats().preemptions > 0
    exact = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.outputs[0].token_ids
        exact += ours == hf_greedy(half_model, prompt, len(ours))
        with torch.no_grad():  # transformers' logits along our tokens
            logits = half_model.hf_model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].float()
        shortfall = logits.max(-1).values - logits[torch.arange(len(ours)), ours]
        assert shortfall.max() <= NEAR_TIE[dtype], (prompt, ours)
    assert exact >= len(prompts) // 2
    assert_all_pages_free(llm)


def test_half_checkpoint_under_auto_runs_in_float32(half_model: SavedModel) -> None:
    llm = LLM(str(half_model.path), device="cpu", num_kv_blocks=64, kv_cache_dtype="float32")
    assert llm.engine.runner.model.dtype == torch.float32
    upcast = SavedModel(half_model.path, copy.deepcopy(half_model.hf_model).float())
    prompts = make_prompts()[:4]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(upcast, p, 10) for p in prompts]


def test_sharded_checkpoint_generates_like_the_unsharded_one(sharded_model: SavedModel, tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    sharded_model.hf_model.save_pretrained(whole)
    assert (whole / "model.safetensors").is_file()
    index = json.loads((sharded_model.path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    prompts = make_prompts()[:4]
    tokens = [[o.outputs[0].token_ids for o in
               LLM(str(folder), device="cpu", num_kv_blocks=64, kv_cache_dtype="float32").generate(
                   prompts, GREEDY, use_tqdm=False)]
              for folder in (sharded_model.path, whole)]
    assert tokens[0] == tokens[1] == [hf_greedy(sharded_model, p, 10) for p in prompts]


def _ends(free_runs: list[list[int]], eos: set[int]) -> list[int]:
    """Where each free run would stop with these eos ids (its length if it never meets one)."""
    return [next((i + 1 for i, t in enumerate(run) if t in eos), len(run)) for run in free_runs]


def test_generation_config_eos_list_stops_on_either(llama_model: SavedModel, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(llama_model.path, tmp_path / "model"))
    prompts = make_prompts()
    free = [o.outputs[0].token_ids for o in
            LLM(str(folder), device="cpu", num_kv_blocks=64).generate(prompts, GREEDY, use_tqdm=False)]
    config_eos = 2  # config.json's; generation_config.json's list comes on top
    candidates = sorted({t for run in free for t in run[1:4]} - {config_eos})
    a, b = next((a, b) for a in candidates for b in candidates if a != b and
                {run[end - 1] for run, end in zip(free, _ends(free, {a, b, config_eos}), strict=True)} >= {a, b})
    hf().GenerationConfig(bos_token_id=1, eos_token_id=[a, b]).save_pretrained(folder)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [a, b]
    llm = LLM(str(folder), device="cpu", num_kv_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    for run, end, output in zip(free, _ends(free, {a, b, config_eos}), outputs, strict=True):
        assert output.outputs[0].token_ids == run[:end]
        stopped = run[end - 1] in (a, b, config_eos)
        assert output.outputs[0].finish_reason == ("stop" if stopped else "length")
    assert_all_pages_free(llm)


def test_chat_template_jinja_drives_chat(chat_model: SavedModel) -> None:
    tokenizer_config = json.loads((chat_model.path / "tokenizer_config.json").read_text())
    assert (chat_model.path / "chat_template.jinja").is_file() and "chat_template" not in tokenizer_config
    llm = LLM(str(chat_model.path), device="cpu", num_kv_blocks=64)
    messages = [{"role": "user", "content": "Hello world!"}]
    [output] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    hf_tokenizer = hf().AutoTokenizer.from_pretrained(chat_model.path)
    assert output.prompt_token_ids == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                       return_dict=False)
    assert output.prompt == "<|begin|><|user|>Hello world!<|end|><|assistant|>"
