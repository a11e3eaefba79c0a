"""Phi-3 / 3.5: the Llama graph (LongRoPE comes from the config); its checkpoints store q/k/v and gate/up each
as one fused tensor, split here into the parts the packed layers stack."""

from __future__ import annotations

import torch

from pagegate.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi3ForCausalLM checkpoints (the GGUF keeps the same two fused tensors)."""

    def unfused(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        config = self.config
        parts: tuple[str, ...]
        if name.endswith("self_attn.qkv_proj.weight"):
            q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
            parts, sizes = ("q_proj", "k_proj", "v_proj"), [q, kv, kv]
        elif name.endswith("mlp.gate_up_proj.weight"):
            parts, sizes = ("gate_proj", "up_proj"), [config.intermediate_size] * 2
        else:
            return [(name, tensor)]
        prefix = name.rsplit(".", 2)[0]
        return [(f"{prefix}.{part}.weight", rows) for part, rows in zip(parts, tensor.split(sizes), strict=True)]
