"""Adapters hardened (issue 64), below the server: the engine core's loader reads on its own thread and wakes the
loop; an adapter that cannot be paged in fails its request alone; GGUF adapters with integer or non-finite values
are refused by name."""

from __future__ import annotations

import json
import select
import threading
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from pagegate import LLM, SamplingParams
from pagegate.engine.lora import LoRARequest
from pagegate.engine.lora.adapter import AdapterWeights
from pagegate.engine.lora.loader import AdapterLoader, LoadJob
from pagegate.testing.lora import lora_tensors, write_adapter

DEFAULT_MODEL = Path("pagegate/engine/default_model")
_CONFIG = json.loads((DEFAULT_MODEL / "config.json").read_text())
SHAPES = {"q_proj": (_CONFIG["hidden_size"], _CONFIG["num_attention_heads"] * _CONFIG["head_dim"])}
LAYERS = _CONFIG["num_hidden_layers"]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_the_loader_reads_on_its_own_thread_and_wakes_the_loop() -> None:
    release, threads = threading.Event(), []
    weights = AdapterWeights("a", 4, {})

    def read(name: str, path: str) -> AdapterWeights:
        threads.append(threading.current_thread())
        if not release.wait(30):
            raise TimeoutError("never released")
        if name == "bad":
            raise ValueError(f"{path} is not an adapter")
        return weights

    loader = AdapterLoader(read)
    loader.submit(LoadJob(1, "a", "/a"))
    loader.submit(LoadJob(2, "bad", "/b"))
    assert not readable(loader.wake_fd) and loader.finished() == [] and loader.pending == 2  # the caller goes on
    release.set()
    done: list = []
    for _ in range(100):
        select.select([loader.wake_fd], [], [], 1.0)
        done += loader.finished()
        if len(done) == 2:
            break
    assert [d.job.call_id for d in done] == [1, 2] and done[0].result is weights
    assert isinstance(done[1].result, ValueError) and "/b is not an adapter" in str(done[1].result)
    assert threading.main_thread() not in threads and loader.pending == 0 and not readable(loader.wake_fd)
    loader.close()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(DEFAULT_MODEL), device="cpu", dtype="float32", enable_lora=True, num_kv_blocks=64,
               max_model_len=512)


def test_an_adapter_that_cannot_be_paged_in_fails_its_request_alone(llm, tmp_path, monkeypatch) -> None:
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    lora = LoRARequest("broken", 1, str(write_adapter(tmp_path / "a", lora_tensors(SHAPES, LAYERS, 4, 1, 0.3),
                                                      config)))
    engine, store = llm.engine, llm.engine.runner.lora
    registered = store.register(lora)

    def fail(name: str) -> None:  # fault injection: a slot load that raises (a device out of memory, a bug)
        raise RuntimeError(f"cannot page {name} in")

    monkeypatch.setattr(store, "load", fail)
    broken = engine.intake.make_request("broken", [5, 17, 99, 3], GREEDY, lora=registered)
    base = engine.intake.make_request("base", [5, 17, 99, 3], GREEDY)
    engine.add(broken)
    engine.add(base)
    while engine.has_unfinished():
        engine.step()
    assert broken.error is not None and "cannot page broken in" in broken.error
    assert base.error is None and len(base.seqs[0].output_token_ids) == GREEDY.max_tokens
    assert llm.stats().used_blocks == 0 and not engine.scheduler.adapters.resident


def gguf_adapter(path: Path, values: np.ndarray, alpha: float) -> Path:
    """A llama.cpp-style GGUF LoRA on every layer's attn_q: lora_a `values` [4, in] as given, lora_b float32."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    rows = SHAPES["q_proj"][1]
    for layer in range(LAYERS):
        writer.add_tensor(f"blk.{layer}.attn_q.weight.lora_a", values)
        writer.add_tensor(f"blk.{layer}.attn_q.weight.lora_b", np.full((rows, 4), 0.01, np.float32),
                          raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_adapters_with_integer_or_non_finite_values_are_refused_by_name(llm, tmp_path) -> None:
    store, a = llm.engine.runner.lora, np.full((4, SHAPES["q_proj"][0]), 0.01, np.float32)
    assert store.read("fine", str(gguf_adapter(tmp_path / "fine.gguf", a, 8.0))).rank == 4
    cases = {"int": (a.astype(np.int32), 8.0, "has type I32"), "nan": (a, float("nan"), "lora_alpha"),
             "inf": (np.where(a > 0, np.inf, a).astype(np.float32), 8.0, "holds NaN or Inf")}
    for name, (values, alpha, says) in cases.items():
        with pytest.raises(ValueError, match=says):
            store.read(name, str(gguf_adapter(tmp_path / f"{name}.gguf", values, alpha)))
