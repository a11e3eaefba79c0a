"""auto-4 pages: int8 in the quarter of layers where int4 costs most, int4 elsewhere, through the whole engine."""

from __future__ import annotations

import math

import pytest
import torch

from pagegate import LLM
from pagegate.engine.memory import kv_calibration
from pagegate.engine.memory.kv_calibration import auto4_formats, layer_costs
from pagegate.kernels.dispatch import decode_kernel
from pagegate.kernels.kv_format import AUTO_4, FORMATS, LayerFormats

from ..conftest import TINY, hf, save_hf_model
from ..test_kv_formats import PRESSURE, assert_same_answers, run
from ..test_llm import assert_all_pages_free, make_prompts

INT8, INT4 = FORMATS["int8"], FORMATS["int4"]
MIX = LayerFormats(AUTO_4, (INT4, INT8, INT4, INT4))


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    config = hf().LlamaConfig(**{**TINY, "num_hidden_layers": 4}, bos_token_id=1, eos_token_id=2)
    return save_hf_model(tmp_path_factory.mktemp("four"), config, seed=3)


@pytest.fixture
def fixed_mix(monkeypatch):
    """auto-4 without its calibration: layer 1 in int8 (the calibration's choice is tested on its own)."""
    monkeypatch.setattr("pagegate.engine.runner.auto4_formats", lambda model, ids: MIX)


def test_the_layers_int4_costs_most_keep_int8(monkeypatch):
    costs = [0.01, 0.05, 0.02, 0.04, 0.00, 0.03, 0.01, 0.02]
    monkeypatch.setattr(kv_calibration, "layer_costs", lambda model, ids: costs)
    formats = auto4_formats(None, [1, 2, 3])  # type: ignore[arg-type]
    assert [f.name for f in formats.formats] == ["int4", "int8", "int4", "int8"] + ["int4"] * 4
    assert formats.name == AUTO_4 and formats.key == "auto-4:" + ",".join(f.name for f in formats.formats)


def test_layer_costs_measure_each_layer(four_layers):
    llm = LLM(str(four_layers.path), device="cpu", num_kv_blocks=16)
    costs = layer_costs(llm.engine.runner.model, make_prompts()[2])
    assert len(costs) == 4 and all(math.isfinite(c) and c >= -1e-6 for c in costs)
    assert max(costs) > 0  # 4 bits change a random model's distributions somewhere


def test_auto4_pages_mix_formats_and_say_so(four_layers):
    llm = LLM(str(four_layers.path), device="cpu", kv_cache_memory="1MiB", kv_cache_dtype=AUTO_4)
    runner = llm.engine.runner
    dtypes = [k.dtype for k, _ in runner.kv_cache.layers]
    assert dtypes.count(torch.int8) == 1 and dtypes.count(torch.uint8) == 3  # 4 layers: a quarter in int8
    assert runner.kv_bytes_per_token == 2 * 2 * (INT8.row_bytes(16) + 3 * INT4.row_bytes(16))
    assert runner.kv_pages.startswith("auto-4 pages (3 layers int4, 1 layer int8)")
    value = llm.engine.metrics.registry.get_sample_value(
        "pagegate:kv_cache_bytes_per_token", {"model_name": llm.engine.model_name, "kv_cache_dtype": AUTO_4})
    assert value == runner.kv_bytes_per_token


def test_uniform_formats_keep_their_tier_key():
    # a disk tier written by int8 pages before auto-4 existed is still theirs
    assert LayerFormats.uniform(INT8, 30).key == "int8" and MIX.key == "auto-4:int4,int8,int4,int4"


@pytest.mark.skipif(decode_kernel() is None, reason="the native decode step is not built")
def test_native_step_reads_each_layers_format_as_the_torch_path(four_layers, fixed_mix, monkeypatch):
    answers = []
    for backend in ("auto", "reference"):
        monkeypatch.setenv("PAGEGATE_KERNEL_BACKEND", backend)
        llm = LLM(str(four_layers.path), device="cpu", num_kv_blocks=64, kv_cache_dtype=AUTO_4,
                  enable_prefix_caching=False)
        assert (llm.engine.runner.native is not None) == (backend == "auto")
        answers.append(run(llm, make_prompts()))
    # NOTE: the same tokens; logprobs within 0.1, not float32 noise: the two paths compute k and v in another float
    # order, and a value on a rounding boundary stores another code (checked: one int8 value of layer 3's V in a
    # 40-token prefill; this random model is sharp, and such flips moved a logprob by 0.06 over these steps)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(*answers, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 0.1


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_and_prefix_hits_give_the_roomy_answer(four_layers, fixed_mix, mode):
    roomy = run(LLM(str(four_layers.path), device="cpu", num_kv_blocks=64, kv_cache_dtype=AUTO_4,
                    enable_prefix_caching=False), make_prompts())
    llm = LLM(str(four_layers.path), device="cpu", kv_cache_dtype=AUTO_4, preemption_mode=mode,
              swap_space=0.001 if mode == "swap" else 0.0, **PRESSURE)
    for _ in range(2):  # the second time through, prompts hit the prefix cache
        assert_same_answers(run(llm, make_prompts()), roomy)
    assert llm.stats().preemptions > 0 and llm.stats().prefix_cache_hits > 0
    if mode == "swap":
        assert [k.dtype for k, _ in llm.engine.runner.kv_cache.cpu_layers] == [f.dtype for f in MIX.formats]
    assert_all_pages_free(llm)

