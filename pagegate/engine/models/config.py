"""The model's shape, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagegate.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ARCHITECTURE_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding base and scaling (the `rope_scaling` / `rope_parameters` fields)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    freq_factors: tuple[float, ...] | None = None  # per-frequency divisors (a GGUF's rope_freqs tensor)


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model, the loader and the cache allocator need to know about a checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    layer_sliding_windows: tuple[int | None, ...] = ()  # per layer; empty: `sliding_window` everywhere
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str | None = None  # "float32" | "bfloat16" | "float16" as written in the config
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def sliding_window_for(self, layer: int) -> int | None:
        """The attention window of one layer (None: full causal attention)."""
        if self.layer_sliding_windows:
            return self.layer_sliding_windows[layer]
        return self.sliding_window

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a model folder."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model folder?")
        return cls.from_dict(json.loads(config_path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict; unsupported architectures and RoPE types fail here."""
        architecture = _architecture(raw)
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
        heads = raw["num_attention_heads"]
        layers = raw["num_hidden_layers"]
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope=_rope(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(raw, architecture),
            layer_sliding_windows=_qwen2_layer_windows(raw, layers) if is_qwen2 else (),
            qkv_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
            o_bias=not is_qwen2 and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(token_id_list(raw.get("eos_token_id"))),
        )


def token_id_list(value: int | list[int] | None) -> list[int]:
    """An eos_token_id field (int, list or null) as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    name = names[0] if names else _ARCHITECTURE_BY_MODEL_TYPE.get(raw.get("model_type", ""), "")
    if name not in SUPPORTED_ARCHITECTURES:
        shown = name or f"model_type {raw.get('model_type')!r}"
        raise ModelLoadError(f"architecture {shown} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return name


def _rope(raw: dict[str, Any]) -> RopeConfig:
    """Accept both the classic `rope_theta` + `rope_scaling` and the newer `rope_parameters` form."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope type {rope_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    if architecture == "LlamaForCausalLM":
        return None
    if architecture == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        return None
    return raw.get("sliding_window") or None


def _qwen2_layer_windows(raw: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Qwen2 slides only on some layers: `layer_types`, or layers from `max_window_layers` on."""
    window = _sliding_window(raw, "Qwen2ForCausalLM")
    if window is None:
        return (None,) * layers
    types = raw.get("layer_types")
    if types:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    first = raw.get("max_window_layers", 0)
    return tuple(window if i >= first else None for i in range(layers))
