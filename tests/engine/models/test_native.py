"""The native step (pagegate.engine.models.native) against the torch forward, its oracle: token for token
where the arithmetic is the same (float32 weights; blocks in exact mode), on every block type the loader keeps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagegate import LLM, SamplingParams
from pagegate.engine import runners
from pagegate.engine.models.native import NativeDecoder
from pagegate.kernels import cpu_decode, quant

from ..conftest import SavedModel, hf, save_hf_model
from ..loading.gguf_files import write_gguf

# decode steps of several sequences at once, prompts of one token to past the Mistral fixture's window
PROMPTS = [[5, 17, 99, 3], [200, 1, 45, 45, 45, 80, 7, 9, 11, 13, 15], [12], list(range(30, 60))]
PAGES = 16  # of 16 tokens: the tiny models' 256 positions
WIDE = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)  # K-quants need rows of 256


@pytest.fixture(autouse=True)
def torch_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch runner for GGUF files too: these are the tests of its native decoder, built from the torch model
    (the native core, which serves GGUF files without torch, is tests/engine/test_native_runner.py's)."""
    monkeypatch.setattr(runners, "runs_native", lambda config, elastic=False: False)


def greedy(model: str | Path, native: str, monkeypatch: pytest.MonkeyPatch, max_tokens: int = 12,
           prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """Greedy tokens with decode steps on `native`: "q8" (the server's choice), "exact", or "torch"; float32 pages
    by name (the paths, not the page formats, are compared here)."""
    with monkeypatch.context() as patch:
        if native == "torch":
            patch.setenv("PAGEGATE_KERNEL_BACKEND", "reference")
        llm = LLM(str(model), device="cpu", num_kv_blocks=64, enable_prefix_caching=False, kv_cache_dtype="float32")
    runner = llm.engine.runner
    assert (runner.native is None) == (native == "torch")
    if native == "exact":
        runner.native = NativeDecoder(runner.model, runner.kv_cache, exact=True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("fixture", ["llama_model", "head_dim_model", "mistral_model", "qwen2_model"])
def test_float32_models_decode_token_for_token(fixture: str, request: pytest.FixtureRequest,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Biases, a head size that is not hidden / heads, a sliding window, tied embeddings."""
    path = request.getfixturevalue(fixture).path
    assert greedy(path, "q8", monkeypatch, 20) == greedy(path, "torch", monkeypatch, 20)


def test_float32_matrices_are_read_in_panels_in_place_of_their_weights(qwen2_model: SavedModel,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The native decoder puts each float32 matrix in panels (cpu_panels.h: the same floats, permuted, in place of
    the torch weight), a bias kept and a tied head sharing its embedding's panels."""
    native = LLM(str(qwen2_model.path), device="cpu", num_kv_blocks=PAGES).engine.runner.model
    with monkeypatch.context() as patch:
        patch.setenv("PAGEGATE_KERNEL_BACKEND", "reference")
        plain = LLM(str(qwen2_model.path), device="cpu", num_kv_blocks=PAGES).engine.runner.model
    pairs = [(native.model.embed_tokens, plain.model.embed_tokens)]
    for layer, plain_layer in zip(native.model.layers, plain.model.layers, strict=True):
        pairs += [(layer.get_submodule(path), plain_layer.get_submodule(path))
                  for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    for module, weights in pairs:
        assert module.qtype == quant.F32_PANELS
        assert torch.equal(quant.dequantize_rows(module.blocks, quant.F32_PANELS, weights.weight.shape[1],
                                                 torch.arange(weights.weight.shape[0])), weights.weight)
        if getattr(weights, "bias", None) is not None:
            assert torch.equal(module.bias, weights.bias)
    assert native.lm_head.blocks is native.model.embed_tokens.blocks


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_hf_model(tmp_path_factory.mktemp("wide"), hf().LlamaConfig(**WIDE), seed=21)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_block_types_decode_token_for_token_in_exact_mode(qtype: Q, wide_model: SavedModel, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_gguf(tmp_path / "model.gguf", wide_model.hf_model, quant=lambda name, values: qtype)
    assert greedy(path, "exact", monkeypatch) == greedy(path, "torch", monkeypatch)


@pytest.mark.parametrize("qtype, dtype", [(Q.F16, torch.float16), (Q.BF16, torch.bfloat16)], ids=["F16", "BF16"])
def test_half_matrices_of_a_gguf_file_are_read_in_panels(qtype: Q, dtype: torch.dtype, wide_model: SavedModel,
                                                         tmp_path: Path) -> None:
    """An F16 or BF16 file's matrices stay in their halves, in panels (the same values, permuted), each read back as
    the file has it."""
    path = write_gguf(tmp_path / "model.gguf", wide_model.hf_model, quant=lambda name, values: qtype)
    model = LLM(str(path), device="cpu", num_kv_blocks=PAGES).engine.runner.model
    down = model.model.layers[0].mlp.down_proj
    assert down.qtype == model.lm_head.qtype == quant.PANELS[int(qtype)]
    expected = wide_model.hf_model.model.layers[0].mlp.down_proj.weight.detach().to(dtype).float()
    rows = torch.arange(expected.shape[0])
    assert torch.equal(quant.dequantize_rows(down.blocks, down.qtype, expected.shape[1], rows), expected)


def native_logprobs(model: str | Path, max_tokens: int, prompts: list[list[int]] = PROMPTS) -> list[list[float]]:
    """Greedy logprobs of every prompt in one batch, the native decoder taking at most `max_tokens` a call."""
    llm = LLM(str(model), device="cpu", num_kv_blocks=64, enable_prefix_caching=False)
    assert llm.engine.runner.native is not None
    llm.engine.runner.native.max_tokens = max_tokens
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    return [[lp.logprob for lp in o.outputs[0].logprobs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_step_cut_into_calls_computes_what_one_call_does(llama_model: SavedModel) -> None:
    """A prefill of every prompt at once, cut across sequences into calls of 5 tokens (each writing its K/V before
    the next attends to it), gives every logprob's bits of one call."""
    assert sum(map(len, PROMPTS)) > 5
    assert native_logprobs(llama_model.path, 5) == native_logprobs(llama_model.path, cpu_decode.MAX_TOKENS)


@pytest.fixture(scope="module")
def decoder(llama_model: SavedModel) -> NativeDecoder:
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=PAGES)
    assert llm.engine.runner.native is not None
    return llm.engine.runner.native


class TestBadSteps:
    """The C checks every index it follows: a bad step is a ValueError, not a read outside the pages."""

    @staticmethod
    def step(**changes: np.ndarray) -> list[np.ndarray]:
        arrays = dict(ids=np.array([5], np.int64), positions=np.array([0], np.int64), slots=np.array([0], np.int64),
                      tables=np.zeros((1, 4), np.int32), seq_lens=np.array([1], np.int32),
                      starts=np.array([0, 1], np.int32))
        return list({**arrays, **changes}.values())

    def test_a_good_step_runs(self, decoder: NativeDecoder) -> None:
        hidden = decoder.kernel_model.forward(*self.step())
        assert hidden.shape == (1, 64) and np.isfinite(hidden).all()
        assert decoder.compute_logits(hidden).shape == (1, 256)

    @pytest.mark.parametrize("changes, match", [
        (dict(ids=np.array([256], np.int64)), "out of range"),
        (dict(positions=np.array([10**6], np.int64)), "out of range"),
        (dict(slots=np.array([PAGES * 16], np.int64)), "out of range"),
        (dict(tables=np.full((1, 4), PAGES, np.int32)), "outside the cache"),
        (dict(seq_lens=np.array([100], np.int32)), "block table"),
        (dict(starts=np.array([0, 2], np.int32)), "tokens"),
        (dict(ids=np.zeros(0, np.int64)), "tokens"),
        (dict(positions=np.zeros(2, np.int64)), "disagree"),
    ])
    def test_a_bad_step_is_refused(self, decoder: NativeDecoder, changes: dict, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            decoder.kernel_model.forward(*self.step(**changes))
