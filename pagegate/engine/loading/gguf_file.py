"""A GGUF file (llama.cpp's format) as pagegate reads it, without torch: the model's shape from its metadata, its
tensors by their Hugging Face names, float arrays dequantized and matrices kept in their blocks (repacked as the
kernels read them).

gguf_reader parses the file and the `gguf` package dequantizes blocks (imported by the first tensor that needs it:
the native core dequantizes only float norms and biases); this module maps llama.cpp's names and layouts onto the
Hugging Face ones the rest of pagegate knows, so nothing above the loaders (gguf_loader.py fills a torch model,
gguf_native.py the native core's) sees GGUF.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.loading.gguf_reader import GGUFContents, GGUFTensor
from pagegate.engine.loading.gguf_types import GGMLQuantizationType
from pagegate.engine.models.config import ModelConfig
from pagegate.kernels.dispatch import quant_kernel
from pagegate.kernels.huge_pages import Arena

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
TENSOR_TYPES = tuple(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"))
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_ARCH_LAYER_NAMES = {  # where llama.cpp's names mean other modules than in Llama
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    **dict.fromkeys(("gemma2", "gemma3"), {"post_attention_norm": "post_attention_layernorm",
                                           "ffn_norm": "pre_feedforward_layernorm",
                                           "post_ffw_norm": "post_feedforward_layernorm"}),
}
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # llama.cpp's default: every Nth layer attends globally
_BIG_GEMMA_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models scale attention by hidden / heads
_ROPE_FREQS = "rope_freqs.weight"  # llama3-style scaling stored as per-frequency divisors
_LONGROPE = ("rope_factors_short.weight", "rope_factors_long.weight")  # Phi-3's LongRoPE factors
NOT_WEIGHTS = (_ROPE_FREQS, *_LONGROPE)


def is_gguf(path: Path) -> bool:
    """A `.gguf` path, or any file that starts with GGUF's magic bytes."""
    if path.suffix.lower() == ".gguf":
        return True
    if not path.is_file():
        return False
    with path.open("rb") as file:
        return file.read(4) == b"GGUF"


class GGUFFile:
    """An opened GGUF: its metadata as Python values, its tensors, and the ModelConfig they describe."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path} does not exist or is not a file")
        try:
            self.reader = GGUFContents(self.path)
        except Exception as error:  # struct, numpy or utf-8 decoding on a bad file
            raise ModelLoadError(f"cannot read {self.path} as GGUF (truncated or corrupt?): {error}") from error
        self.metadata: dict[str, Any] = self.reader.metadata
        self.arch = str(self.metadata.get("general.architecture"))
        if self.arch not in ARCHITECTURES:  # NOTE: first, before any tensor is looked at
            raise ModelLoadError(f"GGUF architecture {self.arch!r} is not supported; supported: "
                                 f"{', '.join(ARCHITECTURES)}")
        self.tensors: dict[str, GGUFTensor] = {tensor.name: tensor for tensor in self.reader.tensors}
        self._gguf_names = {hf_name(name, self.arch): name for name in self.tensors}
        self.kept: set[str] = set()  # tensors that stay in blocks (matrix_parts)
        self._check_tensor_types()
        self.config = self._config()

    def _check_tensor_types(self) -> None:
        for tensor in self.reader.tensors:
            if tensor.tensor_type not in TENSOR_TYPES:
                raise ModelLoadError(
                    f"tensor {tensor.name} has type {tensor.tensor_type.name}, which pagegate cannot "
                    f"dequantize; supported: {', '.join(t.name for t in TENSOR_TYPES)}")

    def _config(self) -> ModelConfig:
        arch = self.arch
        config = ModelConfig.from_dict(self._hf_config(arch))
        if _ROPE_FREQS in self.tensors:
            factors = tuple(float(f) for f in self.array(_ROPE_FREQS))
            config = replace(config, rope=replace(config.rope, freq_factors=factors))
        return config

    def _hf_config(self, arch: str) -> dict[str, Any]:
        """The metadata as the config.json dict transformers would write for the same model."""
        meta = self.metadata

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if isinstance(value, (list, np.ndarray)):  # one value per layer: no supported family has it
                raise TypeError(f"{arch}.{key} is an array, not one value")
            return value

        try:
            hidden, heads = get("embedding_length"), get("attention.head_count")
            head_dim = get("attention.key_length") or hidden // heads
            raw: dict[str, Any] = {
                "architectures": [ARCHITECTURES[arch]],
                "vocab_size": get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
                "hidden_size": hidden,
                "intermediate_size": get("feed_forward_length"),
                "num_hidden_layers": get("block_count"),
                "num_attention_heads": heads,
                "num_key_value_heads": get("attention.head_count_kv") or heads,
                "head_dim": head_dim,
                "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
                "rope_theta": get("rope.freq_base", 10000.0),
                "rope_scaling": self._rope_scaling(arch),
                "max_position_embeddings": get("context_length", 2048),
                "tie_word_embeddings": "output.weight" not in self.tensors,
                "attention_bias": "blk.0.attn_q.bias" in self.tensors or "blk.0.attn_qkv.bias" in self.tensors,
                "mlp_bias": "blk.0.ffn_up.bias" in self.tensors,
                "sliding_window": get("attention.sliding_window") or None,
                "attn_logit_softcapping": get("attn_logit_softcapping"),
                "final_logit_softcapping": get("final_logit_softcapping"),
                "torch_dtype": "bfloat16",  # accelerators only; on CPU `auto` is float32
                "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
                "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            }
        except (KeyError, TypeError) as error:
            raise ModelLoadError(f"{self.path} lacks the {arch} metadata pagegate needs: {error}") from error
        if get("rope.dimension_count", head_dim) != head_dim:
            raise ModelLoadError("partial rotary embeddings (rope.dimension_count < head size) are not supported")
        if arch in _SWA_PATTERN:
            raw.update(self._gemma_fields(arch, raw))
        return raw

    def _gemma_fields(self, arch: str, raw: dict[str, Any]) -> dict[str, Any]:
        """What llama.cpp infers for Gemma rather than stores: the layer pattern, the attention scale, the
        GeGLU activation, and Gemma 3's RoPE base on sliding-window layers."""
        pattern = self.metadata.get(f"{arch}.attention.sliding_window_pattern", _SWA_PATTERN[arch])
        layers = raw["num_hidden_layers"]
        if isinstance(pattern, (list, np.ndarray)):  # one flag per layer
            sliding = [bool(flag) for flag in pattern]
        else:
            sliding = [i % pattern < pattern - 1 for i in range(layers)]
        big = layers == _BIG_GEMMA_LAYERS[arch]
        fields: dict[str, Any] = {
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": ["sliding_attention" if flag else "full_attention" for flag in sliding],
            "query_pre_attn_scalar": raw["hidden_size"] // raw["num_attention_heads"] if big else raw["head_dim"],
            "sliding_window": raw["sliding_window"] or (4096 if arch == "gemma2" else None),
        }
        if arch == "gemma3":
            fields["rope_local_base_freq"] = self.metadata.get(f"{arch}.rope.freq_base_swa", 10000.0)
        return fields

    def _rope_scaling(self, arch: str) -> dict[str, Any] | None:
        kind = self.metadata.get(f"{arch}.rope.scaling.type", "none")
        if all(name in self.tensors for name in _LONGROPE):
            short, long = (self.array(name).tolist() for name in _LONGROPE)
            return {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                    "attention_factor": self.metadata.get(f"{arch}.rope.scaling.attn_factor"),
                    "original_max_position_embeddings":
                        self.metadata.get(f"{arch}.rope.scaling.original_context_length")}
        if kind == "none":
            return None
        return {"rope_type": kind, "factor": self.metadata.get(f"{arch}.rope.scaling.factor", 1.0),
                "original_max_position_embeddings":
                    self.metadata.get(f"{arch}.rope.scaling.original_context_length")}

    def has(self, name: str) -> bool:
        """Whether the file holds the tensor of this Hugging Face name."""
        return name in self._gguf_names

    def values(self, name: str) -> np.ndarray | None:
        """The tensor of this Hugging Face name as float32 (array()), Q and K rows in the checkpoint's order; None
        where the file has none."""
        gguf_name = self._gguf_names.get(name)
        return None if gguf_name is None else self.unpermuted(name, self.array(gguf_name))

    def matrix_parts(self, names: list[str], block_types: Collection[int],
                     threads: int = 0) -> list[tuple[np.ndarray, int]] | None:
        """The matrix of the file's tensors `names` (Hugging Face names: a fused projection's shards in order, or
        one) kept in its blocks as the kernels read them: a list of (blocks [rows, row bytes], type id), one a run
        of shards of one type, their outputs side by side; None where a tensor is missing (a tied head) or of a type
        not in `block_types`. The tensors are marked kept (and their mapping released); `threads`: the OpenMP
        threads repacking them takes (0: OpenMP's default)."""
        found = [self.tensors.get(self._gguf_names.get(name, "")) for name in names]
        tensors = [t for t in found if t is not None]
        kinds = {int(t.tensor_type) for t in tensors}
        if len(kinds) > 1 and kinds <= _WIDENS_TO_Q8_0 and Q8_0 in block_types:
            kinds = {Q8_0}  # shards of mixed types (Q4_K_M's Q5_0 q/k beside a Q8_0 v): one Q8_0 matrix
        if len(tensors) != len(names) or not kinds <= set(block_types):
            return None
        # shards of one type side by side: one matrix; of several (Q4_K_M's Q4_K q and k beside a Q6_K v): one
        # matrix a run of shards of one type, their outputs side by side
        runs = [list(run) for _, run in itertools.groupby(zip(names, tensors, strict=True),
                                                          key=lambda shard: len(kinds) > 1 and shard[1].tensor_type)]
        parts = [self._blocks(run, kinds, threads) for run in runs]
        self.kept.update(t.name for t in tensors)
        return parts

    def _blocks(self, shards: list[tuple[str, GGUFTensor]], kinds: set[int], threads: int) -> tuple[np.ndarray, int]:
        """Shards of one type as one matrix of blocks and its type id (integer types: rows eight at a time)."""
        qtype = next(iter(kinds)) if len(kinds) == 1 else int(shards[0][1].tensor_type)
        parts = [_blocks_as(tensor, qtype) for _, tensor in shards]
        # NOTE: interleaved() reads the shards' rows from the mapping itself, in their unpermuted order, so its
        # repacked bytes are the one copy made (copies concatenated and unpermuted first were a third of the bytes
        # written loading SmolLM2; torch.cat's parallel copy took ~0.5 s of it on two busy CPUs).
        ends = np.cumsum([len(part) for part in parts])
        order = np.concatenate([self.unpermuted(name, np.arange(end - len(part), end))
                                for (name, _), part, end in zip(shards, parts, ends, strict=True)])
        kernel = quant_kernel()
        assert kernel is not None, "blocks are kept only where the kernel is built (quant.block_types)"
        kept, kind = kernel.interleaved(parts, qtype, order, threads, self.empty)
        for _, tensor in shards:
            self.reader.release(tensor)
        return kept, kind

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        """A uint8 array one of the file's matrices is repacked into (blocks interleaved, float panels): in the file's
        arena, beside the others."""
        return self._arena.empty(shape)

    def blocks_written(self) -> None:
        """The file's matrices are all repacked: their pages may become huge ones (Arena.written)."""
        if "_arena" in self.__dict__:
            self._arena.written()

    @functools.cached_property
    def _arena(self) -> Arena:
        """Where the matrices kept in blocks are repacked, side by side: room for the whole file's tensors."""
        return Arena(sum(tensor.data.nbytes for tensor in self.reader.tensors), populate=True)

    def array(self, name: str) -> np.ndarray:
        """One tensor (its GGUF name) as tensor_array gives it."""
        return tensor_array(self.tensors[name])

    def unpermuted(self, name: str, values: Any) -> Any:
        """Undo llama.cpp's row order for Q and K: it interleaves each head's two rotary halves."""
        if self.config.architecture != "LlamaForCausalLM":
            return values
        if name.endswith("q_proj.weight") or name.endswith("q_proj.bias"):
            heads = self.config.num_attention_heads
        elif name.endswith("k_proj.weight") or name.endswith("k_proj.bias"):
            heads = self.config.num_key_value_heads
        else:
            return values
        rest = values.shape[1:]
        return values.reshape(heads, -1, 2, *rest).swapaxes(1, 2).reshape(values.shape)


Q8_0 = int(GGMLQuantizationType.Q8_0)
_WIDENS_TO_Q8_0 = {Q8_0, int(GGMLQuantizationType.Q4_0), int(GGMLQuantizationType.Q5_0)}


def _blocks_as(tensor: GGUFTensor, qtype: int) -> np.ndarray:
    """A tensor's blocks as bytes [rows, row bytes] of `qtype`: its own (a view of the file), or (Q4_0, Q5_0 ->
    Q8_0) widened without loss: each block keeps its float16 scale d first, and its integer steps (-16..15) fit
    int8."""
    data = tensor.data.view(np.uint8)
    if int(tensor.tensor_type) == qtype:
        return data
    assert qtype == Q8_0 and int(tensor.tensor_type) in _WIDENS_TO_Q8_0
    rows = data.shape[0]
    values = dequantized(tensor).reshape(rows, -1, 32)
    scales = data.reshape(rows, values.shape[1], -1)[:, :, :2].copy()  # every 32-block starts with its d
    d = scales.view(np.float16).astype(np.float32)
    steps = np.rint(np.divide(values, d, out=np.zeros_like(values), where=d != 0)).astype(np.int8)
    return np.concatenate([scales, steps.view(np.uint8)], axis=2).reshape(rows, -1)


def tensor_array(tensor: GGUFTensor) -> np.ndarray:
    """A tensor as float32 in PyTorch's [rows, columns] order (GGUF lists dims innermost first), a copy of its own
    (the file is mapped read-only)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return dequantized(tensor).reshape(shape).copy()


def dequantized(tensor: GGUFTensor) -> np.ndarray:
    """A tensor's values as float32, as gguf.quants.dequantize gives them (F32 and F16 without importing it)."""
    if tensor.tensor_type == GGMLQuantizationType.F32:
        return tensor.data.view(np.float32)
    if tensor.tensor_type == GGMLQuantizationType.F16:
        return tensor.data.view(np.float16).astype(np.float32)
    from gguf import GGMLQuantizationType as Kind
    from gguf.quants import dequantize

    return np.asarray(dequantize(tensor.data, Kind(tensor.tensor_type)), dtype=np.float32)


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """llama.cpp's tensor name -> the Hugging Face checkpoint name (`blk.3.attn_q.weight` -> ...)."""
    parts = gguf_name.split(".")
    layer_names = _LAYER_NAMES | _ARCH_LAYER_NAMES.get(arch, {})
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return gguf_name
