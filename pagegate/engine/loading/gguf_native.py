"""A GGUF model as the native step reads it, built without torch: the arguments of cpu_decode.DecodeModel.

The same bytes the torch path hands the native decoder (gguf_loader.keep_blocks, then models/native.py): integer
matrices in the file's blocks repacked eight rows at a time, float32 / float16 / bfloat16 matrices in panels (a
projection of parts of several types as those parts), norms and biases as float32 arrays, and the RoPE table of
rope_table.py. So a core on it computes what the torch-built native decoder computes, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.loading.gguf_file import GGUFFile
from pagegate.engine.models.config import ModelConfig
from pagegate.engine.models.rope_table import cos_sin_table, uses_long_factors
from pagegate.kernels.dispatch import quant_kernel

F32, F16, BF16 = 0, 1, 30  # ggml's ids of float rows
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")  # the GGUF families the C decoder computes
ACTIVATIONS = ("silu", "gelu_tanh")

Linear = tuple[int, np.ndarray, np.ndarray | None]  # (type id, rows [N, row bytes], bias [N] or None)
LinearSpec = Linear | list[Linear]  # a matrix, or its parts of several types


@dataclass
class NativeModel:
    """DecodeModel's arguments but the pages and the RoPE tables (rope_tables): `layers[i]` is layer i's spec without
    its caches and page format."""

    config: ModelConfig
    dims: tuple[int, int, int, int, int, float, float]
    final_norm: np.ndarray
    embed: LinearSpec
    lm_head: LinearSpec
    layers: list[tuple[Any, ...]]
    embed_scale: float | None

    @property
    def weight_bytes(self) -> int:
        arrays = {id(a): a for a in _arrays((self.final_norm, self.embed, self.lm_head, *self.layers))}
        return sum(a.nbytes for a in arrays.values())


def load_native(gguf: GGUFFile, threads: int = 0) -> NativeModel:
    """The model of `gguf` for the native step; ModelLoadError where a tensor is missing. `threads`: the OpenMP
    threads repacking its matrices takes (0: OpenMP's default)."""
    config = gguf.config
    if config.hidden_act not in ACTIVATIONS or gguf.arch not in ARCHITECTURES:
        raise ModelLoadError(f"the native core does not compute {gguf.arch} with {config.hidden_act}")
    kernel = quant_kernel()
    assert kernel is not None, "the native core needs the built extensions"
    matrices = _Matrices(gguf, kernel, threads)
    embed = matrices.linear(["model.embed_tokens.weight"])
    lm_head = embed if config.tie_word_embeddings else matrices.linear(["lm_head.weight"])
    layers = [_layer(gguf, matrices, i) for i in range(config.num_hidden_layers)]
    gguf.blocks_written()
    return NativeModel(
        config=config,
        dims=(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
              config.intermediate_size, config.rms_norm_eps, config.attention_scale),
        final_norm=_vector(gguf, "model.norm.weight"),
        embed=embed, lm_head=lm_head,
        layers=layers,
        embed_scale=config.hidden_size**0.5 if config.is_gemma else None)


def rope_tables(config: ModelConfig, max_model_len: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The RoPE table of max_model_len positions, and the sliding layers' own (Gemma 3; else None)."""
    long = uses_long_factors(config.rope, max_model_len)

    def table(rope: Any) -> np.ndarray:
        return cos_sin_table(config.head_dim, rope, config.max_position_embeddings, long)[:max_model_len].copy()

    return table(config.rope), None if config.local_rope is None else table(config.local_rope)


def _layer(gguf: GGUFFile, matrices: _Matrices, i: int) -> tuple[Any, ...]:
    """Layer i as DecodeModel takes it, but for its caches and page format: (attn_norm, ffn_norm, qkv, o, gate_up,
    down, window, q_norm, k_norm, post_attn_norm, post_ffn_norm, local_rope, softcap)."""
    config, p = gguf.config, f"model.layers.{i}."
    fused = gguf.has(p + "self_attn.qkv_proj.weight")  # Phi-3 keeps q/k/v and gate/up fused
    qkv = ["self_attn.qkv_proj"] if fused else ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    gate_up = ["mlp.gate_up_proj"] if fused else ["mlp.gate_proj", "mlp.up_proj"]
    # Llama's two norms (before attention, before the MLP), or Gemma's four (those, and after each)
    names = (("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm")
             if config.is_gemma else ("input_layernorm", "post_attention_layernorm"))
    norms: list[np.ndarray | None] = [_vector(gguf, f"{p}{name}.weight") for name in names]
    attn_norm, ffn_norm, post_attn, post_ffn = (norms + [None, None])[:4]
    return (attn_norm, ffn_norm, matrices.linear([f"{p}{n}.weight" for n in qkv]),
            matrices.linear([p + "self_attn.o_proj.weight"]), matrices.linear([f"{p}{n}.weight" for n in gate_up]),
            matrices.linear([p + "mlp.down_proj.weight"]), config.sliding_window_for(i) or 0,
            gguf.values(p + "self_attn.q_norm.weight"), gguf.values(p + "self_attn.k_norm.weight"), post_attn,
            post_ffn, config.rope_for(i) is not config.rope, config.attn_logit_softcap)


def _vector(gguf: GGUFFile, name: str) -> np.ndarray:
    values = gguf.values(name)
    if values is None:
        raise ModelLoadError(f"{gguf.path.name} is missing tensor {name}")
    return values


class _Matrices:
    """The file's matrices as the native step reads them (models/native.py's _rows and _paneled, on arrays)."""

    def __init__(self, gguf: GGUFFile, kernel: Any, threads: int) -> None:
        self.gguf, self.kernel, self.threads = gguf, kernel, threads
        self.block_types = frozenset(kernel.BLOCK_BYTES) - {F32, *kernel.PANELS.values()}

    def linear(self, names: list[str]) -> LinearSpec:
        """The matrix of these shards (side by side) and their bias: one (type, rows, bias), or a list of them
        where the file keeps its parts in blocks of several types."""
        bias = self._bias(names)
        parts = self.gguf.matrix_parts(names, self.block_types, self.threads)
        if parts is None:  # float32 in the file (or of mixed float types): float32 rows, in panels
            shards = [self.gguf.values(name) for name in names]
            found = [shard for shard in shards if shard is not None]
            if len(found) != len(names):
                raise ModelLoadError(f"{self.gguf.path.name} is missing tensor(s) of {', '.join(names)}")
            parts = [(np.ascontiguousarray(np.concatenate(found)).view(np.uint8), F32)]
        if len(parts) == 1:
            rows, qtype = parts[0]
            if qtype in (F32, F16, BF16):
                rows, qtype = self.kernel.panels(rows, qtype, self.gguf.empty)
            return qtype, rows, bias
        ends = np.cumsum([0] + [rows.shape[0] for rows, _ in parts])
        return [(qtype, rows, None if bias is None else bias[start:end].copy())
                for (rows, qtype), start, end in zip(parts, ends[:-1], ends[1:], strict=True)]

    def _bias(self, names: list[str]) -> np.ndarray | None:
        biases = [self.gguf.values(name.removesuffix(".weight") + ".bias") for name in names]
        found = [b for b in biases if b is not None]
        if not found:
            return None
        if len(found) != len(names):
            raise ModelLoadError(f"{self.gguf.path.name} has biases for some of {', '.join(names)} only")
        return np.concatenate(found)


def _arrays(spec: tuple[Any, ...]) -> list[np.ndarray]:
    found: list[np.ndarray] = []
    for item in spec:
        if isinstance(item, np.ndarray):
            found.append(item)
        elif isinstance(item, tuple | list):
            found.extend(_arrays(tuple(item)))
    return found
