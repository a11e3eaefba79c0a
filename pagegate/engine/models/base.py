"""What every model family is to the engine: hidden states from flattened tokens over the paged cache,
logits of the rows that sample, its page geometry, and a forward at the largest batch for memory profiling."""

from __future__ import annotations

import torch
from torch import nn

from pagegate import kernels
from pagegate.engine.models.config import ModelConfig
from pagegate.engine.models.layers import (
    AttentionMetadata,
    Given,
    KVCache,
    Linear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    softcap,
)
from pagegate.engine.parallel import TensorParallel


class Decoder(nn.Module):
    """The checkpoint's `model.` prefix, whatever the family: embeddings, decoder layers (each with an `mlp`),
    the final norm and the rotary table; `forward` gives the final hidden states."""

    embed_tokens: nn.Module  # nn.Embedding, or a QuantEmbedding kept in GGUF blocks
    layers: nn.ModuleList
    norm: RMSNorm
    rotary: RotaryEmbedding
    local_rotary: RotaryEmbedding | None  # the sliding-window layers' table where it differs (Gemma 3)


class CausalLM(nn.Module):
    """The whole model: `forward` gives hidden states, `compute_logits` the next-token logits.

    Under tensor parallelism (`tp`) each rank holds its slice of the attention heads, KV heads and MLP;
    the embedding and LM head stay whole on every rank: sampling on rank 0 needs every logit, and a
    vocab-parallel head would add an all-gather of [batch, vocab] logits to every step."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, decoder: Decoder) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = decoder
        self.lm_head: nn.Module = Linear(config.hidden_size, config.vocab_size, bias=False)  # or a QuantLinear
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with lm_head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn: AttentionMetadata, given: Given | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for flattened tokens input_ids [T] at positions [T]; `given` input rows (an
        image encoder's) replace their tokens' embeddings."""
        if given is None:
            return self.model(input_ids, positions, kv_caches, attn)
        return self.model(input_ids, positions, kv_caches, attn, given)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the rows of hidden [N, hidden] that sample (soft-capped where the
        config says so)."""
        return softcap(self.lm_head(hidden).float(), self.config.final_logit_softcap)

    def fit_context(self, max_model_len: int) -> None:
        """Adapt to the served context length (LongRoPE picks its factors by it)."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.fit_context(max_model_len)

    def unfused(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A checkpoint tensor as the model's tensors: fused projections split into their parts."""
        return [(name, tensor)]

    def from_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A Hugging Face checkpoint tensor's values as the model holds them (GGUF files already do)."""
        return tensor

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds in every page."""
        return self.tp.kv_heads(self.config.num_key_value_heads)[0]

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype  # the embedding may be kept in quantized blocks

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def use_kernels(self, ops: kernels.AttentionOps) -> None:
        """Run every attention layer on these kernels (chosen once for the model's device)."""
        for module in self.modules():
            if isinstance(module, PagedAttention):
                module.ops = ops

    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, num_logits: int) -> None:
        """The activations of a `num_tokens` batch without the cache (there is none yet): embeddings, every
        layer's MLP (the widest activations) and `num_logits` rows of logits. Under tensor parallelism the
        layers are skipped: a lone rank's all-reduce would wait for peers that are not profiling."""
        hidden = self.model.embed_tokens(torch.zeros(num_tokens, dtype=torch.long, device=self.device))
        for layer in self.model.layers if self.tp.size == 1 else ():
            hidden = hidden + layer.get_submodule("mlp")(hidden)
        self.compute_logits(hidden[-num_logits:])
