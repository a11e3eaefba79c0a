"""Load a model: a Hugging Face folder (config.json, *.safetensors, generation_config.json) or a GGUF file."""

from __future__ import annotations

import json
import logging
import resource
import time
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from pagegate.config import EngineConfig
from pagegate.engine.errors import ModelLoadError
from pagegate.engine.loading.generation import GenerationDefaults
from pagegate.engine.loading.gguf_file import GGUFFile, is_gguf
from pagegate.engine.loading.gguf_loader import keep_blocks
from pagegate.engine.loading.gguf_loader import load_weights as load_gguf_weights
from pagegate.engine.loading.gguf_tokenizer import tokenizer_from_gguf
from pagegate.engine.loading.layout import checkpoint_layout, copy_into
from pagegate.engine.loading.tokenizer import Tokenizer
from pagegate.engine.models.base import CausalLM
from pagegate.engine.models.config import ModelConfig, token_id_list
from pagegate.engine.models.registry import build_empty_model
from pagegate.engine.parallel import SINGLE, TensorParallel
from pagegate.kernels.quant import block_types

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}
# the image encoder's tensors: Idefics3's, Gemma 3's (transformers 5's names, then the hub checkpoints' older ones)
VISION_PREFIXES = ("model.vision_model.", "model.connector.", "model.vision_tower.", "model.multi_modal_projector.",
                   "vision_tower.", "multi_modal_projector.")
# a vision-language checkpoint's text-model prefixes -> the text model's own
TEXT_PREFIXES = {"model.text_model.": "model.", "model.language_model.": "model.", "language_model.model.": "model.",
                 "language_model.lm_head.": "lm_head."}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LoadedModel(NamedTuple):
    model: CausalLM
    config: ModelConfig
    generation: GenerationDefaults


DEFAULT_MODEL = Path(__file__).parent.parent / "default_model"


def model_path(config: EngineConfig) -> Path:
    """The checkpoint the config names, or the embedded default model."""
    return Path(config.model) if config.model else DEFAULT_MODEL


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               quantization: str | None = None) -> LoadedModel:
    """Build the model for a folder or a GGUF file and fill its weights."""
    return load_checkpoint(path, dtype, device, quantization)[0]


def load_checkpoint(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
                    quantization: str | None = None, tp: TensorParallel = SINGLE) -> tuple[LoadedModel, Tokenizer | None]:
    """The model (this rank's slice of it) and its tokenizer (None: a folder without tokenizer.json); logs
    time and peak memory. A rank reads only its slices of a safetensors checkpoint.

    A GGUF's Q4_0 / Q4_1 / Q8_0 / F16 weights stay in their blocks on CPU unless quantization is "none"
    (or the model is split across ranks: each rank then dequantizes its slices).
    """
    path, device, start = Path(path), torch.device(device), time.perf_counter()
    if quantization not in (None, "gguf", "none"):
        raise ModelLoadError(f"quantization {quantization!r} is not supported; use gguf or none")
    tokenizer: Tokenizer | None
    if is_gguf(path):
        gguf = GGUFFile(path)
        model = build_empty_model(gguf.config, resolve_dtype(dtype, gguf.config, device), device, tp)
        if quantization != "none" and device.type == "cpu" and tp.size == 1:
            keep_blocks(gguf, model, block_types())
        load_gguf_weights(gguf, model)
        generation = GenerationDefaults(eos_token_ids=list(gguf.config.eos_token_ids))
        try:
            tokenizer = tokenizer_from_gguf(gguf.metadata)
        except (KeyError, ValueError) as error:
            raise ModelLoadError(f"cannot build the tokenizer of {path.name}: {error}") from error
        loaded = LoadedModel(model, gguf.config, generation)
    else:
        config = ModelConfig.from_folder(path)
        model = build_empty_model(config, resolve_dtype(dtype, config, device), device, tp)
        load_weights(model, weight_files(path))
        loaded = LoadedModel(model, config, read_generation_defaults(path, config))
        tokenizer = Tokenizer.from_folder(path)
    log.info("loaded %s (%s, %s, weights %.0f MiB) in %.1f s; peak RSS %.0f MiB", path.name,
             loaded.config.architecture, str(model.dtype).removeprefix("torch."), weight_bytes(model) / 2**20,
             time.perf_counter() - start, peak_rss_mib())
    return loaded, tokenizer


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's weights (quantized blocks included, shared tensors once)."""
    blocks = [buffer for name, buffer in model.named_buffers() if name.endswith("blocks")]
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *blocks]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def peak_rss_mib() -> float:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto` follows the config on accelerators and is float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        dtype = config.torch_dtype or "float32"
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files: the index's shards, model.safetensors, or any *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in shards]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights (PyTorch .bin files are not supported)")
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"weight shard {file.name} listed in the index is missing from {folder}")
    return files


def load_weights(model: CausalLM, files: list[Path]) -> None:
    """Copy every checkpoint tensor into place; missing, unexpected or misshapen tensors fail."""
    layout = checkpoint_layout(model)
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for stored in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = _text_model_name(stored, model.config)
                if name is None or _ignorable(name, model.config):
                    continue
                if name in layout:  # the common case: read only this rank's slice
                    target = layout[name]
                    tensor = reader.get_slice(stored)[target.source] if target.source else reader.get_tensor(stored)
                    copy_into(name, model.from_hf(name, tensor), target)
                    loaded.add(name)
                    continue
                for part, tensor in model.unfused(name, reader.get_tensor(stored)):
                    if part not in layout:
                        raise ModelLoadError(f"unexpected tensor {name} in {file.name}: the model has no such "
                                             "weight")
                    target = layout[part]
                    copy_into(part, model.from_hf(part, tensor[target.source]), target)
                    loaded.add(part)
    missing = sorted(set(layout) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint is missing tensor(s): {shown}")


def _text_model_name(name: str, config: ModelConfig) -> str | None:
    """A vision-language checkpoint's text-model tensor under the text model's own name; None for the image
    encoder's tensors (engine/models/idefics3_vision.py loads those)."""
    if config.vision is None:
        return name
    if name.startswith(VISION_PREFIXES):
        return None
    prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
    return name if prefix is None else TEXT_PREFIXES[prefix] + name.removeprefix(prefix)


def _ignorable(name: str, config: ModelConfig) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    return config.tie_word_embeddings and name == "lm_head.weight"


def read_generation_defaults(folder: Path, config: ModelConfig) -> GenerationDefaults:
    """Eos ids (generation_config first, then config.json) and the folder's default sampling values."""
    path = folder / "generation_config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    eos = token_id_list(raw.get("eos_token_id")) + list(config.eos_token_ids)
    return GenerationDefaults(
        eos_token_ids=list(dict.fromkeys(eos)),
        temperature=raw.get("temperature"),
        top_p=raw.get("top_p"),
        top_k=raw.get("top_k"),
        min_p=raw.get("min_p"),
        repetition_penalty=raw.get("repetition_penalty"),
    )
