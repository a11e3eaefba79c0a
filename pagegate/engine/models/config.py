"""The model's shape, read from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pagegate.engine.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
_ARCHITECTURE_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
                               "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# image encoder families: SmolVLM's (SigLIP + Llama) and Gemma 3's (SigLIP + Gemma 3, images read bidirectionally)
VISION_ARCHITECTURES = {"Idefics3ForConditionalGeneration": "idefics3", "Gemma3ForConditionalGeneration": "gemma3"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


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
    short_factor: tuple[float, ...] | None = None  # longrope: divisors up to original_max_position_embeddings
    long_factor: tuple[float, ...] | None = None  # longrope: divisors beyond it
    attention_factor: float = 1.0  # longrope: cos and sin scaled by this


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
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3, Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: the head size
    attn_logit_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the logits
    local_rope: RopeConfig | None = None  # RoPE of the sliding-window layers where it differs (Gemma 3)
    vision: str | None = None  # the image encoder's family ("idefics3": SmolVLM); None: a text-only model
    image_token_id: int | None = None  # the placeholder token whose embeddings the image encoder's rows replace

    def sliding_window_for(self, layer: int) -> int | None:
        """The attention window of one layer (None: full causal attention)."""
        if self.layer_sliding_windows:
            return self.layer_sliding_windows[layer]
        return self.sliding_window

    def rope_for(self, layer: int) -> RopeConfig:
        """The rotary embedding of one layer: local_rope on sliding-window layers when it is set."""
        if self.local_rope is not None and self.sliding_window_for(layer) is not None:
            return self.local_rope
        return self.rope

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def is_gemma(self) -> bool:
        """Gemma's block: (1 + w) norms, four norms per layer, the embedding scaled by sqrt(hidden)."""
        return self.architecture in _GEMMA

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a model folder."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model folder?")
        return cls.from_dict(json.loads(config_path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict; unsupported architectures and RoPE types fail here. A vision-language model's
        config is its text model's, with its vision family and image token."""
        if (raw.get("architectures") or [None])[0] in VISION_ARCHITECTURES:
            return _vision_language(raw)
        architecture = _architecture(raw)
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(f"hidden_act {act!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_ACTIVATIONS)}")
        heads = raw["num_attention_heads"]
        layers = raw["num_hidden_layers"]
        is_qwen = architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
        is_gemma = architecture in _GEMMA
        if raw.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelLoadError("partial_rotary_factor other than 1.0 is not supported")
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
            rope=_rope(raw, "full_attention"),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", is_gemma)),
            sliding_window=_sliding_window(raw, architecture),
            layer_sliding_windows=_layer_windows(raw, architecture, layers),
            qkv_bias=architecture == "Qwen2ForCausalLM" or (not is_qwen and bool(raw.get("attention_bias", False))),
            o_bias=not is_qwen and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(token_id_list(raw.get("eos_token_id"))),
            hidden_act=SUPPORTED_ACTIVATIONS[act],
            qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if is_gemma else None,
            attn_logit_softcap=raw.get("attn_logit_softcapping") or None,
            final_logit_softcap=raw.get("final_logit_softcapping") or None,
            local_rope=_local_rope(raw) if architecture == "Gemma3ForCausalLM" else None,
        )


# transformers' Gemma3TextConfig defaults: a published Gemma 3 config.json's text_config leaves these out
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                         "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                         "rope_local_base_freq": 1e4, "max_position_embeddings": 131072, "sliding_window": 4096,
                         "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
                         "tie_word_embeddings": True}


def _vision_language(raw: dict[str, Any]) -> ModelConfig:
    text = dict(raw["text_config"])
    if text.get("model_type") == "gemma3_text":
        text = {**_GEMMA3_TEXT_DEFAULTS, **text}
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):  # the whole model's, where the text's are not
        if key in raw:
            text.setdefault(key, raw[key])
    config = ModelConfig.from_dict({**text, "architectures": [_ARCHITECTURE_BY_MODEL_TYPE.get(
        text.get("model_type", "llama"), "LlamaForCausalLM")]})
    return replace(config, vision=VISION_ARCHITECTURES[raw["architectures"][0]],
                   image_token_id=int(raw["image_token_id"] if "image_token_id" in raw else raw["image_token_index"]))


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


def _rope_params(raw: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """One layer type's RoPE fields: the newer `rope_parameters` (flat, or per layer type as Gemma 3 writes
    it) or the classic `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if layer_type in params or "full_attention" in params:
        params = dict(params.get(layer_type) or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    return params


def _rope(raw: dict[str, Any], layer_type: str) -> RopeConfig:
    params = _rope_params(raw, layer_type)
    theta = float(params["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # Phi-3's older name for longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope type {rope_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "longrope":
        return _longrope(raw, params, theta)
    return RopeConfig(
        theta=theta,
        type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def _longrope(raw: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
    """Phi-3's LongRoPE: short factors up to the original context, long ones beyond, cos/sin scaled."""
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ModelLoadError("longrope needs original_max_position_embeddings")
    factor = params.get("factor") or raw.get("max_position_embeddings", original) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(theta=theta, type="longrope", factor=float(factor), original_max_position_embeddings=original,
                      short_factor=tuple(float(f) for f in params["short_factor"]),
                      long_factor=tuple(float(f) for f in params["long_factor"]),
                      attention_factor=float(attention))


def _local_rope(raw: dict[str, Any]) -> RopeConfig:
    """Gemma 3's sliding-window layers: their own base (`rope_local_base_freq`), no scaling."""
    params = raw.get("rope_parameters") or {}
    if "sliding_attention" in params:
        return _rope(raw, "sliding_attention")
    return RopeConfig(theta=float(raw.get("rope_local_base_freq", 10000.0)))


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    if architecture == "LlamaForCausalLM":
        return None
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not raw.get("use_sliding_window", False):
        return None
    return raw.get("sliding_window") or None


def _layer_windows(raw: dict[str, Any], architecture: str, layers: int) -> tuple[int | None, ...]:
    """Per-layer windows where only some layers slide: `layer_types` when the config has them, else
    Qwen's `max_window_layers` or Gemma's pattern (Gemma 2 alternates, Gemma 3 has one global layer in six)."""
    window = _sliding_window(raw, architecture)
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", *_GEMMA):
        return ()
    if window is None:
        return (None,) * layers
    types = raw.get("layer_types")
    if types:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    if architecture in _GEMMA:
        pattern = raw.get("sliding_window_pattern") or (2 if architecture == "Gemma2ForCausalLM" else 6)
        return tuple(window if (i + 1) % pattern else None for i in range(layers))
    first = raw.get("max_window_layers", 0)
    return tuple(window if i >= first else None for i in range(layers))
