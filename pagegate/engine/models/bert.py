"""The BERT encoder family (BertModel: all-MiniLM, bge, e5, ...): bidirectional attention over whole sentences,
no KV cache. Module names follow the checkpoint's (`embeddings.`, `encoder.layer.N.`), so a Hugging Face
state dict loads as it is; `pooler.` (the CLS head) is not used by sentence embeddings and not built."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pagegate.engine.errors import ModelLoadError

ENCODER_ARCHITECTURES = ("BertModel",)


@dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT config.json the encoder reads."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    @classmethod
    def from_folder(cls, folder: Path) -> BertConfig:
        raw = json.loads((folder / "config.json").read_text())
        architectures = raw.get("architectures") or ["BertModel" if raw.get("model_type") == "bert" else "?"]
        if architectures[0] not in ENCODER_ARCHITECTURES or raw.get("position_embedding_type",
                                                                     "absolute") != "absolute":
            raise ModelLoadError(f"{folder} is a {architectures[0]} ({raw.get('model_type')}); --task embed serves "
                                 f"{', '.join(ENCODER_ARCHITECTURES)} checkpoints with absolute positions")
        if raw.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise ModelLoadError(f"{folder}: hidden_act {raw['hidden_act']!r} is not one of {sorted(_ACTIVATIONS)}")
        names = cls.__dataclass_fields__
        return cls(**{key: value for key, value in raw.items() if key in names})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] token ids (one sentence each: token type 0) -> [B, L, hidden]."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Every token attends to every real token of its sentence (mask [B, 1, 1, L], True = attend)."""
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
                                             attn_mask=mask)
        return out.transpose(1, 2).reshape(b, n, -1)


class DenseNorm(nn.Module):
    """LayerNorm(dense(x) + residual): BERT's `attention.output` and `output`."""

    def __init__(self, width: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(width, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = SelfAttention(config)
        self.output = DenseNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class EncoderLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.intermediate = Intermediate(config)
        self.output = DenseNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """Token embeddings of padded sentences: `forward(input_ids [B, L], lengths [B])` -> [B, L, hidden]."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        real = token_mask(lengths, input_ids.shape[1])
        mask = real[:, None, None, :]
        x = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    @property
    def device(self) -> torch.device:
        return self.embeddings.word_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.word_embeddings.weight.dtype


def token_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] True where a position holds one of the sentence's `lengths[b]` tokens (the rest is padding)."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
