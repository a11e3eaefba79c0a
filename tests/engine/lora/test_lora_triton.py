"""LoRA through the grouped Triton kernels (lora/slots.py: what a model on CUDA runs), here in Triton's interpreter
on the CPU: greedy answers equal transformers + peft's for one mixed batch of every adapter and the base model, and
slots are reused as adapters are evicted and read again."""

from __future__ import annotations

import pytest

from pagegate import LLM
from pagegate.engine.lora.slots import AdapterSlots

from . import test_lora
from .test_lora import PROMPTS, lora_llm, tokens

adapters, references = test_lora.adapters, test_lora.references  # its fixtures, here too

pytest.importorskip("peft")


def grouped(llm: LLM) -> AdapterSlots:
    """Give the engine's adapters the slots a model on CUDA has (LoRAModel makes them when the device is CUDA)."""
    lora = llm.engine.runner.lora
    assert lora is not None and lora.slots is None  # a CPU model: the torch path unless told
    lora.slots = AdapterSlots(lora.targets, lora.config, lora.dtype, lora.device)
    return lora.slots


def test_a_mixed_batch_through_the_grouped_kernels_matches_peft(llama_model, adapters, references):
    names: list[str | None] = [None, *adapters]
    plan = [(p, names[(i + j) % len(names)]) for i, p in enumerate(PROMPTS) for j in range(len(names))]
    llm = lora_llm(llama_model.path)
    slots = grouped(llm)
    got = tokens(llm, [p for p, _ in plan], [adapters[n].request if n else None for _, n in plan])
    assert got == [references[n][PROMPTS.index(p)] for p, n in plan]
    assert sorted(slots.held) == [0, 1, 2]
    assert len(slots.shrinks) == 2 * 4  # "all" targets every adapted module of both layers


def test_slots_are_reused_as_adapters_are_evicted_and_read_again(llama_model, adapters, references):
    llm = lora_llm(llama_model.path, max_loras=2)
    slots = grouped(llm)
    for name in ("attn", "mlp", "all", "attn"):  # max_loras=2: from the third on, each evicts the least recent
        got = tokens(llm, PROMPTS[:2], [adapters[name].request, None])
        assert got == [references[name][0], references[None][1]], name
        lora = llm.engine.runner.lora
        assert slots.held[lora.table_slot[name]]() is lora.loaded[name]  # its slot holds the weights read last
    assert llm.engine.scheduler.adapters.loads == 4 and sorted(slots.held) == [0, 1]
