"""Load a sentence encoder: a Hugging Face BERT folder (config.json, safetensors or pytorch_model.bin, tokenizer.json)
and, where it has one, its sentence-transformers pipeline (modules.json: the pooling and whether to normalize)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.models.bert import BertConfig, BertModel

log = logging.getLogger(__name__)

POOLING_MODES = ("mean", "cls", "max", "lasttoken")  # sentence-transformers' pooling_mode_<name>(_tokens)
_UNUSED_PREFIXES = ("pooler.", "embeddings.position_ids")  # the CLS head; a buffer older checkpoints keep


@dataclass(frozen=True)
class SentencePipeline:
    """What sentence-transformers does after the encoder: pool the tokens, maybe normalize; inputs longer than
    max_seq_length tokens are refused (sentence-transformers would cut them)."""

    pooling: str = "mean"
    normalize: bool = False
    max_seq_length: int | None = None

    @classmethod
    def from_folder(cls, folder: Path) -> SentencePipeline:
        """The folder's modules.json pipeline; mean pooling without normalizing where it has none (a bare
        BertModel folder)."""
        modules = _read_json(folder / "modules.json") or []
        types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
        pooling = "mean"
        if "Pooling" in types:
            config = _read_json(folder / types["Pooling"].get("path", "") / "config.json") or {}
            chosen = [mode for mode in POOLING_MODES if config.get(f"pooling_mode_{mode}_tokens",
                                                                   config.get(f"pooling_mode_{mode}"))]
            if len(chosen) != 1 or config.get("pooling_mode_mean_sqrt_len_tokens"):
                raise ModelLoadError(f"{folder}: the pooling config asks for {chosen or 'no pooling'}; pagegate "
                                     f"pools with exactly one of {', '.join(POOLING_MODES)}")
            pooling = chosen[0]
        unknown = set(types) - {"Transformer", "Pooling", "Normalize"}
        if unknown:
            raise ModelLoadError(f"{folder}: sentence-transformers modules {sorted(unknown)} are not supported")
        length = (_read_json(folder / "sentence_bert_config.json") or {}).get("max_seq_length")
        return cls(pooling, "Normalize" in types, length)


@dataclass
class LoadedEncoder:
    model: BertModel
    config: BertConfig
    pipeline: SentencePipeline
    tokenizer: Tokenizer


def load_encoder(folder: Path, dtype: torch.dtype, device: torch.device) -> LoadedEncoder:
    """The folder's encoder on `device`, its tokenizer (which adds [CLS] ... [SEP], never pads or cuts) and pipeline."""
    config = BertConfig.from_folder(folder)
    model = BertModel(config)
    state = {name.removeprefix("bert."): tensor for name, tensor in _read_weights(folder).items()
             if not name.removeprefix("bert.").startswith(_UNUSED_PREFIXES)}
    state = {name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): t
             for name, t in state.items()}  # the TF-era names some BERT checkpoints keep
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"{folder}: the checkpoint does not fit a BertModel (missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]})")
    model.to(device=device, dtype=dtype).eval()
    return LoadedEncoder(model, config, SentencePipeline.from_folder(folder), _tokenizer(folder))


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return {name: t for file in files for name, t in load_file(str(file)).items()}
    binary = folder / "pytorch_model.bin"
    if binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{folder} has no *.safetensors or pytorch_model.bin weights")


def _tokenizer(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    backend = HFTokenizer.from_file(str(path))
    backend.no_padding()  # a folder may fix both (all-MiniLM pads and cuts to 128): lengths are the engine's
    backend.no_truncation()
    return Tokenizer(backend, _read_json(folder / "tokenizer_config.json"))


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None
