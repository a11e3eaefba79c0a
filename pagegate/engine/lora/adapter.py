"""A PEFT LoRA folder read into the model's own layout, and checked against it.

The model packs projections (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`); an adapter's A and B are per
checkpoint projection. Each packed module gets its shards' A matrices stacked into one shrink [R, in] and one
expand per shard, B (scaled) [shard rows, r], written at the shard's output columns.

A GGUF LoRA file (llama.cpp's) is read into the same PEFT form first (gguf_adapter.py)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from pagegate.engine.loading.gguf_loader import is_gguf
from pagegate.engine.lora.gguf_adapter import read_gguf_adapter
from pagegate.engine.models.base import CausalLM

# the modules of a decoder layer that take adapters, as paths inside the layer
TARGET_PATHS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_UNSUPPORTED_SWITCHES = ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save")


@dataclass(frozen=True)
class Shard:
    """One checkpoint projection inside a model module: its name and its output columns there."""

    name: str
    columns: slice


@dataclass(frozen=True)
class TargetModule:
    """A module that takes adapters: where it is (layer, path), its input width and its shards."""

    layer: int
    path: str
    in_features: int
    shards: tuple[Shard, ...]


@dataclass
class ModuleLoRA:
    """One module's update for one adapter: x -> (x @ shrink.T)[:, ranks] @ expand.T into `columns`."""

    shrink: torch.Tensor  # [sum of the shards' ranks, in]: every shard's A, stacked
    expands: list[tuple[slice, slice, torch.Tensor]] = field(default_factory=list)  # (columns, ranks, B * scale)


@dataclass
class AdapterWeights:
    """An adapter in the model's layout: its updates keyed by (layer, module path)."""

    name: str
    rank: int
    modules: dict[tuple[int, str], ModuleLoRA]

    @property
    def nbytes(self) -> int:
        tensors = [t for m in self.modules.values() for t in (m.shrink, *(b for _, _, b in m.expands))]
        return sum(t.numel() * t.element_size() for t in tensors)


def model_targets(model: CausalLM) -> dict[str, TargetModule]:
    """Every module of `model` that takes adapters, keyed by "layer.shard name" (e.g. "3.k_proj")."""
    targets: dict[str, TargetModule] = {}
    for index, layer in enumerate(model.model.layers):
        for path in TARGET_PATHS:
            module = layer.get_submodule(path)
            target = TargetModule(index, path, _in_features(module), _shards(module, path))
            targets.update({f"{index}.{shard.name}": target for shard in target.shards})
    return targets


def _in_features(module: nn.Module) -> int:
    return int(module.in_features)  # type: ignore[arg-type]


def _shards(module: nn.Module, path: str) -> tuple[Shard, ...]:
    names: tuple[str, ...] = getattr(module, "shard_names", ()) or (path.rsplit(".", 1)[1],)
    sizes: tuple[int, ...] = getattr(module, "shard_sizes", ()) or (int(module.out_features),)  # type: ignore[arg-type]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(Shard(name, slice(start, start + size)) for name, start, size in zip(names, starts, sizes,
                                                                                      strict=True))


def model_heads(model: CausalLM) -> dict[str, int]:
    """The head count of each rotary projection: what un-permutes a GGUF adapter's Q and K rows."""
    return {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}


def adapter_digest(path: str | Path) -> str:
    """A short digest of an adapter's config and weights (a GGUF file's bytes): its identity in prefix-cache
    hashes."""
    folder, digest = Path(path), hashlib.sha256()
    files = [folder] if folder.is_file() else [folder / "adapter_config.json", _weight_file(folder)]
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def read_adapter(name: str, path: str | Path, targets: dict[str, TargetModule], max_rank: int,
                 dtype: torch.dtype, device: torch.device, heads: dict[str, int]) -> AdapterWeights:
    """Read and check a PEFT LoRA folder or a GGUF LoRA file; ValueError naming what does not fit this model or
    these limits."""
    folder = Path(path)
    if folder.is_file() and is_gguf(folder):
        config, tensors = read_gguf_adapter(folder, heads)
    else:
        config, tensors = _read_config(folder), _read_tensors(folder)
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if rank > max_rank:
        raise ValueError(f"adapter {name!r} has rank {rank}, more than --max-lora-rank {max_rank}")
    # NOTE: rsLoRA scales by alpha / sqrt(r) (PEFT's use_rslora), plain LoRA by alpha / r.
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs = _pairs(name, tensors)
    modules: dict[tuple[int, str], list[tuple[Shard, torch.Tensor, torch.Tensor]]] = {}
    for key, (a, b) in sorted(pairs.items()):
        target = targets.get(key)
        if target is None:
            raise ValueError(f"adapter {name!r} targets {key.split('.', 1)[1]} of layer {key.split('.', 1)[0]}, "
                             f"which this model does not have (it takes {_known_names(targets)})")
        shard = next(s for s in target.shards if s.name == key.split(".", 1)[1])
        _check_shapes(name, key, a, b, target.in_features, shard.columns.stop - shard.columns.start, rank)
        modules.setdefault((target.layer, target.path), []).append((shard, a, b))
    if not modules:
        raise ValueError(f"adapter {name!r} holds no LoRA weights")
    return AdapterWeights(name, rank, {key: _module_lora(parts, scale, dtype, device)
                                       for key, parts in modules.items()})


def _read_config(folder: Path) -> dict[str, Any]:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a PEFT adapter folder: it has no adapter_config.json")
    try:
        config: dict[str, Any] = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file} is not JSON: {error}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{folder} is a {config['peft_type']} adapter; only LoRA adapters are served")
    switched = [key for key in _UNSUPPORTED_SWITCHES if config.get(key)]
    if config.get("bias", "none") != "none":
        switched.append(f"bias={config['bias']!r}")
    if switched:
        raise ValueError(f"{folder}: adapters with {', '.join(switched)} are not supported")
    return config


def _weight_file(folder: Path) -> Path:
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"{folder} has no adapter weights ({' or '.join(WEIGHT_FILES)})")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    file = _weight_file(folder)
    try:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        tensors: dict[str, torch.Tensor] = torch.load(file, map_location="cpu", weights_only=True)
        return tensors
    except Exception as error:  # a truncated or foreign file: the caller's mistake, named
        raise ValueError(f"cannot read {file}: {type(error).__name__}: {error}") from None


def _pairs(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"layer.shard name": (A, B)} of the file's tensors; any other tensor is refused by name."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"adapter {name!r} holds {key}, which is not a LoRA A or B of a decoder layer's "
                             f"projection (embedding, lm_head and DoRA weights are not supported)")
        layer, _, module, half = match.groups()
        halves.setdefault(f"{layer}.{module}", {})[half] = tensor
    incomplete = [key for key, pair in halves.items() if len(pair) != 2]
    if incomplete:
        raise ValueError(f"adapter {name!r} lacks lora_A or lora_B for {', '.join(sorted(incomplete))}")
    return {key: (pair["A"], pair["B"]) for key, pair in halves.items()}


def _check_shapes(name: str, key: str, a: torch.Tensor, b: torch.Tensor, in_features: int, out_features: int,
                  rank: int) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
            or a.shape[0] != b.shape[1] or a.shape[0] > rank:
        raise ValueError(f"adapter {name!r}: {key} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but "
                         f"this model's projection is [{out_features}, {in_features}] (rank at most {rank})")


def _module_lora(parts: list[tuple[Shard, torch.Tensor, torch.Tensor]], scale: float, dtype: torch.dtype,
                 device: torch.device) -> ModuleLoRA:
    lora = ModuleLoRA(torch.cat([a for _, a, _ in parts]).to(device, dtype).contiguous())
    first = 0
    for shard, a, b in parts:
        ranks = slice(first, first + a.shape[0])
        lora.expands.append((shard.columns, ranks, (b.float() * scale).to(device, dtype).contiguous()))
        first = ranks.stop
    return lora


def _known_names(targets: dict[str, TargetModule]) -> str:
    return ", ".join(sorted({key.split(".", 1)[1] for key in targets}))
