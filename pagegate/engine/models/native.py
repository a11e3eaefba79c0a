"""The native step: every step of a Llama-family model (prefill chunks, decodes, mixed and wide batches) runs as
C calls (pagegate.kernels.cpu_decode) instead of a few hundred torch ops, and so do its logits. Llama, Mistral,
Qwen2, Phi-3, Qwen3 (QK-norm) and Gemma 2 / 3 (four norms, GeGLU, scaled embedding, soft-caps, local RoPE) all run
there. The torch forward stays the oracle and the CUDA path: the "reference" kernel backend keeps every step there."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from torch import nn

from pagegate.engine.kv_cache import PagedKVCache
from pagegate.engine.models.base import CausalLM
from pagegate.engine.models.config import ModelConfig
from pagegate.engine.models.gemma import GemmaDecoderLayer
from pagegate.engine.models.layers import RMSNorm
from pagegate.engine.models.llama import DecoderLayer, DecoderModel
from pagegate.engine.models.quantized import QuantEmbedding, QuantLinear, QuantLinearStack
from pagegate.engine.parallel import StepInputs
from pagegate.engine.step_parts import cut_step, given_part
from pagegate.kernels.dispatch import decode_kernel, requested_backend
from pagegate.kernels.kv_format import format_of
from pagegate.kernels.quant import BF16, F16, F32, panels


def _rows(module: nn.Module) -> tuple[int, torch.Tensor, torch.Tensor | None] | list:
    """A linear layer or embedding as (ggml type, its weight's bytes [N, row bytes], bias); one whose rows come in
    parts of different types as a list of those, part after part."""
    bias = getattr(module, "bias", None)
    if isinstance(module, QuantLinearStack):
        ends = np.cumsum([0] + [part.out_features for part in module.parts])
        return [(part.qtype, part.blocks, None if bias is None else bias.detach()[start:end])
                for part, start, end in zip(module.parts, ends[:-1], ends[1:], strict=True)]
    if isinstance(module, QuantLinear | QuantEmbedding):
        return module.qtype, module.blocks, bias
    weight = cast(torch.Tensor, module.weight).detach()
    return F32, weight.view(torch.uint8), None if bias is None else bias.detach()


def _paneled(module: nn.Module) -> nn.Module | None:
    """A float32 nn.Linear or nn.Embedding, or an F16 or BF16 one in blocks, with its weight in panels (the same
    values, permuted, as the native step reads them); None for any other module."""
    if isinstance(module, QuantLinear | QuantEmbedding) and module.qtype in (F16, BF16):
        blocks, kind, dtype = module.blocks, module.qtype, module.dtype
    elif isinstance(module, nn.Linear | nn.Embedding) and module.weight.dtype == torch.float32:
        blocks, kind, dtype = module.weight.detach().view(torch.uint8), F32, torch.float32
    else:
        return None
    rows, qtype = panels(blocks, kind)
    if isinstance(module, nn.Embedding | QuantEmbedding):
        return QuantEmbedding(rows, qtype, module.embedding_dim, dtype)
    bias = module.bias
    paneled = QuantLinear(rows, qtype, module.in_features, dtype, getattr(module, "shard_names", ()),
                          getattr(module, "shard_sizes", ()), bias=bias is not None)
    if bias is not None and paneled.bias is not None:
        paneled.bias.data.copy_(bias.detach())
    return paneled


def _to_panels(model: CausalLM) -> list[tuple[str, nn.Module]]:
    """Puts the decoder's float matrices in panels, module by module (a tied head shares its embedding's); the
    modules replaced, by path, to put back."""
    head, embedding = model.lm_head, model.model.embed_tokens
    tied = getattr(head, "blocks", getattr(head, "weight", None)) is getattr(embedding, "blocks",
                                                                         getattr(embedding, "weight", False))
    layer_paths = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    paths = ["model.embed_tokens", *([] if tied else ["lm_head"]),
             *(f"model.layers.{i}.{path}" for i in range(len(model.model.layers)) for path in layer_paths)]
    replaced = []
    for path in paths:
        module = model.get_submodule(path)
        paneled = _paneled(module)
        if paneled is not None:
            model.set_submodule(path, paneled)
            replaced.append((path, module))
    if tied and replaced and replaced[0][0] == "model.embed_tokens":
        replaced.append(("lm_head", model.lm_head))
        model.lm_head = cast(QuantEmbedding, model.model.embed_tokens).as_linear()
    return replaced


def _weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight.detach()


def _layer(layer: DecoderLayer | GemmaDecoderLayer, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
    """One decoder layer as cpu_decode.DecodeModel takes it: Llama's two norms, or Gemma's four (input,
    post-attention, pre-MLP, post-MLP)."""
    attention, mlp = layer.self_attn, layer.mlp
    if isinstance(layer, GemmaDecoderLayer):
        attn_norm, ffn_norm = layer.input_layernorm, layer.pre_feedforward_layernorm
        post_attn_norm, post_ffn_norm = layer.post_attention_layernorm, layer.post_feedforward_layernorm
    else:
        attn_norm, ffn_norm, post_attn_norm, post_ffn_norm = layer.input_layernorm, layer.post_attention_layernorm, \
            None, None
    return (_weight(attn_norm), _weight(ffn_norm), _rows(attention.qkv_proj), _rows(attention.o_proj),
            _rows(mlp.gate_up_proj), _rows(mlp.down_proj), k_cache, v_cache, attention.attn.sliding_window,
            _weight(attention.q_norm), _weight(attention.k_norm), _weight(post_attn_norm), _weight(post_ffn_norm),
            layer.local_rope, attention.attn.softcap, format_of(k_cache).name)


def _llama_shaped(config: ModelConfig) -> bool:
    """The blocks the C decoder computes: Llama's (Mistral, Qwen2, Phi-3), with QK-norm (Qwen3), or Gemma's
    four-norm block with a scaled embedding, soft-caps and a local RoPE table; SwiGLU or GeGLU."""
    return config.hidden_act in ("silu", "gelu_tanh")


class NativeDecoder:
    """`forward` of the steps it `takes`, and `compute_logits`, over the model's own weights and pages.

    Layers in integer blocks take Q8 inputs, as llama.cpp's do; `exact` keeps them in float32 (the torch
    path's arithmetic, so the two agree token for token)."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, exact: bool = False) -> None:
        kernel = decode_kernel()
        assert kernel is not None
        decoder, config = model.model, model.config
        blocks = [cast(DecoderLayer | GemmaDecoderLayer, layer) for layer in decoder.layers]
        first = blocks[0].self_attn
        dims = (config.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
                config.intermediate_size, config.rms_norm_eps, first.attn.scale)
        layers = [_layer(layer, k_cache, v_cache) for layer, (k_cache, v_cache) in zip(blocks, kv_cache.layers,
                                                                                        strict=True)]
        self.max_tokens: int = kernel.MAX_TOKENS
        self.model = model
        self.adapters: tuple[Any, Any] | None = None  # this step's (LoRA table, groups): see take_adapters
        local = decoder.local_rotary
        self.kernel_model = kernel.DecodeModel(
            dims, decoder.rotary.cos_sin, decoder.norm.weight.detach(), _rows(decoder.embed_tokens),
            _rows(model.lm_head), layers, exact, local_cos_sin=None if local is None else local.cos_sin,
            activation=config.hidden_act, embed_scale=decoder.embed_scale, final_softcap=config.final_logit_softcap,
            threads=torch.get_num_threads())

    @classmethod
    def build(cls, model: CausalLM, kv_cache: PagedKVCache) -> NativeDecoder | None:
        """The native decoder of `model`, or None where it does not apply: the extension is not built, the
        backend is not "auto", or the model is not a float32 decoder of a family the C computes on one CPU rank
        (its pages may be in any format)."""
        if (decode_kernel() is None or requested_backend() != "auto" or model.device.type != "cpu"
                or model.dtype != torch.float32 or model.tp.size != 1 or type(model.model) is not DecoderModel
                or not _llama_shaped(model.config)
                or not all(type(layer) in (DecoderLayer, GemmaDecoderLayer) for layer in model.model.layers)):
            return None
        replaced = _to_panels(model)
        try:
            return cls(model, kv_cache)
        except ValueError:  # a shape the C does not take (head size, group, odd widths): torch runs it
            for path, module in replaced:
                model.set_submodule(path, module)
            return None

    def takes(self, step: StepInputs) -> bool:
        return len(step.input_ids) > 0

    def take_adapters(self, table: Any | None, groups: Any | None) -> NativeDecoder | None:
        """This decoder for the next step, whose tokens `groups` (a cpu_decode.LoRATable's groups; None: none) run
        with adapters in `table`'s slots; None when it cannot add them (no table: the torch hooks must).

        NOTE: the step's adapters are state set before each forward, as the LoRA hooks' are, so that forward()'s
        signature (and engine/forward.py, shared with the tensor-parallel workers) stays the base model's."""
        if groups is not None and table is None:
            return None
        self.adapters = None if groups is None else (table, groups)
        return self

    def forward(self, step: StepInputs) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's tokens (each with its adapter's updates, if any); a step of
        more than max_tokens runs as consecutive calls, each writing its K/V before the next attends to it."""
        table, groups = self.adapters or (None, None)
        if len(step.input_ids) <= self.max_tokens:
            return torch.from_numpy(self.kernel_model.forward(
                step.input_ids, step.positions, step.slot_mapping, step.block_tables, step.seq_lens,
                step.query_start_loc, lora=table, lora_groups=groups, given=step.given, key_ends=step.key_ends))
        return torch.from_numpy(np.concatenate([self.kernel_model.forward(
            *part, lora=table, lora_groups=part_groups, given=given_part(step.given, t0, len(part[0])),
            key_ends=None if step.key_ends is None else step.key_ends[t0:t0 + len(part[0])])
            for (part, part_groups), t0 in cut_step(step, groups, self.max_tokens)]))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of any number of rows on the kernel, each row's as it would be alone."""
        return torch.from_numpy(self.kernel_model.logits(hidden))
