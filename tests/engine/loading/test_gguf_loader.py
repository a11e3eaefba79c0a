"""GGUF files: config, names, Q/K layout and every supported tensor type, against transformers' own reader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from pagegate import LLM, SamplingParams
from pagegate.engine.errors import ModelLoadError
from pagegate.engine.loading.gguf_file import GGUFFile
from pagegate.engine.loading.loader import load_model, weight_bytes
from pagegate.engine.models.config import ModelConfig
from pagegate.engine.models.quantized import QuantEmbedding, QuantLinear, QuantLinearStack
from pagegate.kernels import cpu_quant, quant
from pagegate.kernels.quant import dequantize_rows
from pagegate.testing.launcher import free_port

from ..conftest import SavedModel, hf, save_hf_model
from .gguf_files import write_gguf

# k-quants need rows of 256 values: a tiny model 256 wide
WIDE = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
PROMPTS = [[5, 17, 99, 3], [200, 1, 45, 45, 45, 80, 7], [12]]


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> SavedModel:
    return save_hf_model(tmp_path_factory.mktemp("wide"), hf().LlamaConfig(**WIDE), seed=11)


def greedy(model: str | Path, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(model), device="cpu", num_kv_blocks=32, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("arch, fixture", [("llama", "llama_model"), ("qwen2", "qwen2_model"),
                                           ("llama", "head_dim_model")])
def test_float32_gguf_serves_like_the_folder(arch: str, fixture: str, request: pytest.FixtureRequest,
                                              tmp_path: Path) -> None:
    saved = request.getfixturevalue(fixture)
    path = write_gguf(tmp_path / "model.gguf", saved.hf_model, arch)
    folder_config, gguf_config = ModelConfig.from_folder(saved.path), GGUFFile(path).config
    for field in ("architecture", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "hidden_size", "intermediate_size", "vocab_size", "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "rope"):
        assert getattr(gguf_config, field) == getattr(folder_config, field), field
    assert greedy(path) == greedy(saved.path)


QUANT_TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_quantized_weights_equal_transformers_dequantized(qtype: Q, wide_model: SavedModel,
                                                          tmp_path: Path) -> None:
    """transformers dequantizes with its own torch code: agreeing with it checks types, names and Q/K order."""
    path = write_gguf(tmp_path / "model.gguf", wide_model.hf_model, quant=lambda name, values: qtype)
    ours = load_model(path, dtype="float32", quantization="none").model
    theirs = hf().AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    expected = theirs.state_dict()
    for name, param in _checkpoint_tensors(ours).items():
        torch.testing.assert_close(param, expected[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("qtype, levels", [(Q.Q5_0, 16), (Q.Q5_1, 32), (Q.Q8_0, 128)], ids=lambda q: str(q))
def test_quantized_weights_are_within_one_step_of_the_originals(qtype: Q, levels: int, wide_model: SavedModel,
                                                                 tmp_path: Path) -> None:
    """Q5_0 and Q5_1 (transformers cannot read them): each weight within a quantization step of its value."""
    path = write_gguf(tmp_path / "model.gguf", wide_model.hf_model, quant=lambda name, values: qtype)
    ours = _checkpoint_tensors(load_model(path, dtype="float32", quantization="none").model)
    for name, original in wide_model.hf_model.state_dict().items():
        if original.dim() != 2 or "rotary" in name:
            continue
        blocks = original.reshape(original.shape[0], -1, 32)
        step = blocks.abs().amax(-1, keepdim=True) * 2 / levels
        error = (ours[name].reshape(blocks.shape) - blocks).abs()
        assert (error <= step + 1e-6).all(), name


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_block_types_stay_in_blocks_and_serve_like_dequantized_weights(qtype: Q, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Q/K rows reordered, packed q/k/v and gate/up, biases and a tied embedding, all read from blocks (on the
    torch path: the native decoder's Q8 arithmetic is checked against it in tests/engine/models/test_native.py)."""
    monkeypatch.setenv("PAGEGATE_KERNEL_BACKEND", "reference")
    config = hf().Qwen2Config(**{**WIDE, "tie_word_embeddings": True})
    saved = save_hf_model(tmp_path / "qwen2", config, seed=12)
    for arch, model in (("llama", wide_model_of(tmp_path)), ("qwen2", saved.hf_model)):
        path = write_gguf(tmp_path / f"{arch}.gguf", model, arch, quant=lambda name, values: qtype)
        kept = load_model(path).model
        assert isinstance(kept.model.embed_tokens, QuantEmbedding)
        linears = [m for m in kept.modules() if isinstance(m, QuantLinear)]
        assert len(linears) == 4 * WIDE["num_hidden_layers"] + 1  # + lm_head: output.weight, or tied
        assert kept.config.tie_word_embeddings == (arch == "qwen2")
        assert weight_bytes(kept) < 0.55 * weight_bytes(load_model(path, quantization="none").model)
        assert greedy(path) == greedy(path, quantization="none")


def test_mixed_q4_0_q5_0_q8_0_shards_stay_in_blocks_as_exact_q8_0(wide_model: SavedModel, tmp_path: Path) -> None:
    """Q4_K_M puts a Q8_0 v beside Q5_0 q/k: the packed q/k/v (and gate/up) is widened to Q8_0 without loss,
    not dequantized to float32."""
    kinds = {"v_proj": Q.Q8_0, "q_proj": Q.Q5_0, "gate_proj": Q.Q4_0, "up_proj": Q.Q5_0}
    path = write_gguf(tmp_path / "mixed.gguf", wide_model.hf_model,
                      quant=lambda name, values: next((q for part, q in kinds.items() if part in name), Q.Q5_0))
    kept = load_model(path).model
    layer = kept.model.layers[0]
    for packed in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        assert isinstance(packed, QuantLinear) and packed.qtype == int(Q.Q8_0) + cpu_quant.X8  # rows eight at a time
    exact = _checkpoint_tensors(load_model(path, quantization="none").model)
    dequantized = torch.cat([exact[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(dequantize_rows(layer.self_attn.qkv_proj.blocks, layer.self_attn.qkv_proj.qtype, WIDE["hidden_size"],
                                       torch.arange(dequantized.shape[0])), dequantized)


PACKED = [[("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v")],
          [("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up")]]  # shards: (Hugging Face, llama.cpp) names


@pytest.mark.parametrize("threads", [0, 1])
def test_a_packed_matrix_is_repacked_from_its_shards_where_they_lie(wide_model: SavedModel, tmp_path: Path,
                                                                     threads: int) -> None:
    """q/k/v and gate/up repacked straight from the file's mapping, q and k rows in the checkpoint's order: the bytes
    of repacking their unpermuted rows concatenated."""
    path = write_gguf(tmp_path / "q4_1.gguf", wide_model.hf_model, quant=lambda name, values: Q.Q4_1)
    gguf = GGUFFile(path)
    for shards in PACKED:
        names = [f"model.layers.1.{name}.weight" for name, _ in shards]
        rows = [gguf.unpermuted(name, gguf.tensors[f"blk.1.{file_name}.weight"].data)
                for name, (_, file_name) in zip(names, shards, strict=True)]
        expected, kind = cpu_quant.interleaved(np.concatenate(rows), int(Q.Q4_1))
        parts = gguf.matrix_parts(names, quant.block_types(), threads)
        assert parts is not None and len(parts) == 1 and parts[0][1] == kind
        assert np.array_equal(parts[0][0], expected)


def test_shards_of_different_k_quants_stay_in_blocks_side_by_side(wide_model: SavedModel, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K_M puts a Q6_K v beside Q4_K q/k: the packed q/k/v keeps both in blocks (one matrix a type, rows eight at
    a time), no larger than the file's, and serves as the dequantized weights do, on the torch path and natively."""
    path = write_gguf(tmp_path / "mixed.gguf", wide_model.hf_model,
                      quant=lambda name, values: Q.Q6_K if "v_proj" in name or "down_proj" in name else Q.Q4_K)
    kept = load_model(path).model
    qkv = kept.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinearStack)
    assert [part.qtype for part in qkv.parts] == [int(Q.Q4_K) + cpu_quant.X8, int(Q.Q6_K) + cpu_quant.X8]
    file_bytes = sum(t.data.nbytes for t in GGUFReader(path).tensors if t.name.endswith(("attn_q.weight",
                     "attn_k.weight", "attn_v.weight")))
    assert sum(part.blocks.nbytes for layer in kept.model.layers for part in layer.self_attn.qkv_proj.parts) \
        == file_bytes
    expected = greedy(path, quantization="none")
    assert greedy(path) == expected
    monkeypatch.setenv("PAGEGATE_KERNEL_BACKEND", "reference")
    assert greedy(path) == expected


def wide_model_of(tmp_path: Path) -> torch.nn.Module:
    return save_hf_model(tmp_path / "llama", hf().LlamaConfig(**WIDE), seed=13).hf_model


def _checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face checkpoint names (packed q/k/v and gate/up split apart)."""
    from pagegate.engine.loading.loader import checkpoint_layout

    return {name: t.param[t.start:t.start + t.rows] for name, t in checkpoint_layout(model).items()}


# ---- bad files -----------------------------------------------------------------------------------------


def _unknown_architecture(path: Path, saved: SavedModel) -> Path:
    write_gguf(path, saved.hf_model)
    data = path.read_bytes().replace(b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00llama",
                                     b"general.architecture\x08\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00rwkv6")
    path.write_bytes(data)
    return path


def _truncated(path: Path, saved: SavedModel) -> Path:
    write_gguf(path, saved.hf_model)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _unsupported_type(path: Path, saved: SavedModel) -> Path:
    def iq4(name: str, values: np.ndarray) -> Q:
        return Q.IQ4_NL if name == "model.layers.1.mlp.up_proj.weight" else Q.F32

    return write_gguf(path, saved.hf_model, quant=iq4)


BAD_FILES = {
    "truncated": (_truncated, "truncated or corrupt"),
    "unknown-architecture": (_unknown_architecture, "GGUF architecture 'rwkv6' is not supported; supported: llama, qwen2"),
    "unsupported-type": (_unsupported_type, "tensor blk.1.ffn_up.weight has type IQ4_NL"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_fails_at_start_with_a_clear_error(case: str, llama_model: SavedModel, tmp_path: Path) -> None:
    make, message = BAD_FILES[case]
    path = make(tmp_path / "bad.gguf", llama_model)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GGUFFile(path)
    served = subprocess.run([sys.executable, "-m", "pagegate", "serve", str(path), "--port", str(free_port()),
                             "--grpc-port", "0"], capture_output=True, text=True, timeout=120)
    assert served.returncode == 1
    assert message in served.stderr
    assert "Traceback" not in served.stderr
