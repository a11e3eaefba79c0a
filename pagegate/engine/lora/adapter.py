"""A PEFT LoRA folder read into the model's own layout, and checked against it.

The model packs projections (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`); an adapter's A and B are per
checkpoint projection. Each packed module gets its shards' A matrices stacked into one shrink [R, in] and one
expand per shard, B (scaled) [shard rows, r], written at the shard's output columns.

A GGUF LoRA file (llama.cpp's) is read into the same PEFT form first (gguf_adapter.py).

NOTE: an adapter is read and checked once, when it is registered, into host tensors (CPU, float32) that stay with it
(model.Registered.weights): loading it into a slot again after an eviction never reads its files again, so a folder
removed or rewritten after the load changes nothing served, and its identity (a digest of those very tensors) always
names the weights served. Reading is bounded before it starts (a GGUF's header must say "adapter"; no file may be
larger than --max-lora-rank allows for this model's shapes) and uses numpy, never a torch op that could start an
OpenMP team: the engine core reads on a worker thread (loader.py) while its main thread keeps stepping."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from pagegate.engine.loading.gguf_file import is_gguf
from pagegate.engine.lora.gguf_adapter import check_gguf_header, read_gguf_adapter
from pagegate.engine.models.base import CausalLM

# the modules of a decoder layer that take adapters, as paths inside the layer
TARGET_PATHS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_UNSUPPORTED_SWITCHES = ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# NOTE: PEFT's usual lora_alpha is r to 4r (a scale of 1 to 4; rsLoRA's alpha / sqrt(r) a few tens at most): a
# scale past 1024 only makes garbage (overflowing activations, empty answers), so it is refused at load.
MAX_SCALE = 1024.0
CONFIG_BYTES = 1 << 20  # adapter_config.json is a few hundred bytes
_SLACK_BYTES = 1 << 20  # a weights file's header and names, past its tensors' bytes
_ITEM_BYTES = 8  # float64: the widest dtype a weights file may hold


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
    """An adapter in the model's layout: its updates keyed by (layer, module path); `digest` names these weights."""

    name: str
    rank: int
    modules: dict[tuple[int, str], ModuleLoRA]
    digest: str = ""

    @property
    def numel(self) -> int:
        return sum(t.numel() for m in self.modules.values() for t in (m.shrink, *(b for _, _, b in m.expands)))

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


def max_adapter_bytes(targets: dict[str, TargetModule], max_rank: int) -> int:
    """The largest weights file an adapter of rank `max_rank` over every target could be (float64 A and B)."""
    shapes = sum(t.in_features + _shard(t, key).columns.stop - _shard(t, key).columns.start
                 for key, t in targets.items())
    return _SLACK_BYTES + shapes * max_rank * _ITEM_BYTES + 1024 * len(targets)


def resolve_path(path: str, lora_dir: str | None) -> Path:
    """`path` with its symlinks resolved; ValueError when `lora_dir` (--lora-dir) is set and it is not inside it."""
    if "\0" in path:
        raise ValueError("the path holds a NUL character")
    real = os.path.realpath(path)
    if lora_dir is not None:
        root = os.path.realpath(lora_dir)
        # NOTE: resolved first, so a symlink inside the folder that points out of it, or a "..", is outside
        if os.path.commonpath([root, real]) != root:
            raise ValueError(f"{path} is not inside --lora-dir {lora_dir} (symlinks resolved): adapters are loaded "
                             f"from there only")
    return Path(real)


def read_adapter(name: str, path: str | Path, targets: dict[str, TargetModule], max_rank: int,
                 heads: dict[str, int], lora_dir: str | None = None, limit: float = float("inf")) -> AdapterWeights:
    """Read and check a PEFT LoRA folder or a GGUF LoRA file into host tensors (CPU, float32); ValueError naming
    what does not fit this model or these limits, for anything about the path or the files. `limit`: the largest
    magnitude the model's dtype holds (a scaled B past it is refused)."""
    try:
        file = resolve_path(str(path), lora_dir)
        config, arrays = _read_files(name, file, targets, max_rank, heads)
    except OSError as error:  # a path too long, a device that cannot be read, a file gone: the caller's path
        raise ValueError(f"cannot read {path}: {error.strerror or error}") from None
    rank, scale = _rank_and_scale(name, config, max_rank)
    modules: dict[tuple[int, str], list[tuple[Shard, np.ndarray, np.ndarray]]] = {}
    for key, (a, b) in sorted(_pairs(name, arrays).items()):
        target = targets.get(key)
        if target is None:
            raise ValueError(f"adapter {name!r} targets {key.split('.', 1)[1]} of layer {key.split('.', 1)[0]}, "
                             f"which this model does not have (it takes {_known_names(targets)})")
        shard = _shard(target, key)
        _check_shapes(name, key, a, b, target.in_features, shard.columns.stop - shard.columns.start, rank)
        modules.setdefault((target.layer, target.path), []).append((shard, a, b))
    if not modules:
        raise ValueError(f"adapter {name!r} holds no LoRA weights")
    built = {key: _module_lora(name, parts, scale, limit) for key, parts in modules.items()}
    return AdapterWeights(name, rank, built, _digest(rank, built))


def to_device(weights: AdapterWeights, dtype: torch.dtype, device: torch.device) -> AdapterWeights:
    """The host weights in the model's dtype on its device (the very same tensors for a CPU float32 model)."""
    if dtype == torch.float32 and device.type == "cpu":
        return weights
    modules = {key: ModuleLoRA(m.shrink.to(device, dtype).contiguous(),
                               [(c, r, b.to(device, dtype).contiguous()) for c, r, b in m.expands])
               for key, m in weights.modules.items()}
    return AdapterWeights(weights.name, weights.rank, modules, weights.digest)


def _read_files(name: str, file: Path, targets: dict[str, TargetModule], max_rank: int,
                heads: dict[str, int]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config, {tensor name: float32 array}) of a GGUF LoRA file or a PEFT folder, sizes bounded before reading."""
    bound = max_adapter_bytes(targets, max_rank)
    if file.is_file() and is_gguf(file):
        check_gguf_header(file, 2 * len(targets))  # a model's GGUF is refused by its header, before it is read
        _check_size(name, file, bound, max_rank)
        config, arrays = read_gguf_adapter(file, heads)
        return config, {key: _finite(name, key, values) for key, values in arrays.items()}
    config = _read_config(file)
    weights = _weight_file(file)
    _check_size(name, weights, bound, max_rank)
    return config, {str(key): _float32(name, str(key), t) for key, t in _read_tensors(weights).items()}


def _check_size(name: str, file: Path, bound: int, max_rank: int) -> None:
    info = file.stat()
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"adapter {name!r}: {file} is not a regular file")
    if info.st_size > bound:
        raise ValueError(f"adapter {name!r}: {file} has {info.st_size} bytes, more than an adapter of rank "
                         f"--max-lora-rank {max_rank} over this model can take ({bound}); it is not read")


def _rank_and_scale(name: str, config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """The config's rank r and its updates' scale; ValueError naming the field that is not sane."""
    rank = config.get("r", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"adapter {name!r}: its config's r (the LoRA rank) must be a positive integer, got {_shown(rank)}")
    if rank > max_rank:
        raise ValueError(f"adapter {name!r} has rank {rank}, more than --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    try:
        finite = not isinstance(alpha, bool) and isinstance(alpha, int | float) and math.isfinite(alpha)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise ValueError(f"adapter {name!r}: its config's lora_alpha must be a finite number, got {_shown(alpha)}")
    # NOTE: rsLoRA scales by alpha / sqrt(r) (PEFT's use_rslora), plain LoRA by alpha / r.
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    if abs(scale) > MAX_SCALE:
        raise ValueError(f"adapter {name!r}: its config's lora_alpha {_shown(alpha)} over r {rank} scales its updates by "
                         f"{scale:g}; at most {MAX_SCALE:g} is accepted")
    return rank, scale


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _read_config(folder: Path) -> dict[str, Any]:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder} is not a PEFT adapter folder: it has no adapter_config.json")
    with config_file.open("rb") as stream:
        text = stream.read(CONFIG_BYTES + 1)
    if len(text) > CONFIG_BYTES:
        raise ValueError(f"{config_file} is larger than {CONFIG_BYTES} bytes: not an adapter's config")
    try:
        config: Any = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_file} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} is not a JSON object (it is a {type(config).__name__})")
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


def _read_tensors(file: Path) -> dict[Any, Any]:
    try:
        if file.suffix == ".safetensors":
            return load_file(str(file))
        tensors: Any = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: the caller's mistake, named
        raise ValueError(f"cannot read {file}: {type(error).__name__}: {error}") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError(f"{file} is not a dictionary of tensors")
    return tensors


def _float32(name: str, key: str, tensor: torch.Tensor) -> np.ndarray:
    """A weights file's tensor as a float32 array (numpy only: no torch op), refused unless float and finite."""
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"adapter {name!r}: tensor {key} is {str(tensor.dtype).removeprefix('torch.')}; LoRA "
                         f"weights must be float16, bfloat16, float32 or float64")
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits are a float32's upper half
        bits = tensor.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        return _finite(name, key, bits.view(np.float32))
    with np.errstate(over="ignore"):  # a float64 past float32's range turns Inf: refused below
        return _finite(name, key, tensor.numpy().astype(np.float32))


def _finite(name: str, key: str, values: np.ndarray) -> np.ndarray:
    if not np.isfinite(values).all():
        raise ValueError(f"adapter {name!r}: tensor {key} holds NaN or Inf values (or values past float32's range)")
    return values


def _pairs(name: str, arrays: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"layer.shard name": (A, B)} of the file's tensors; any other tensor is refused by name."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for key, values in arrays.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"adapter {name!r} holds {key}, which is not a LoRA A or B of a decoder layer's "
                             f"projection (embedding, lm_head and DoRA weights are not supported)")
        layer, _, module, half = match.groups()
        halves.setdefault(f"{layer}.{module}", {})[half] = values
    incomplete = [key for key, pair in halves.items() if len(pair) != 2]
    if incomplete:
        raise ValueError(f"adapter {name!r} lacks lora_A or lora_B for {', '.join(sorted(incomplete))}")
    return {key: (pair["A"], pair["B"]) for key, pair in halves.items()}


def _shard(target: TargetModule, key: str) -> Shard:
    return next(s for s in target.shards if s.name == key.split(".", 1)[1])


def _check_shapes(name: str, key: str, a: np.ndarray, b: np.ndarray, in_features: int, out_features: int,
                  rank: int) -> None:
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != in_features or b.shape[0] != out_features \
            or a.shape[0] != b.shape[1] or not 0 < a.shape[0] <= rank:
        raise ValueError(f"adapter {name!r}: {key} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but "
                         f"this model's projection is [{out_features}, {in_features}] (rank at most {rank})")


def _module_lora(name: str, parts: list[tuple[Shard, np.ndarray, np.ndarray]], scale: float,
                 limit: float) -> ModuleLoRA:
    lora = ModuleLoRA(torch.from_numpy(np.ascontiguousarray(np.concatenate([a for _, a, _ in parts]))))
    first = 0
    for shard, a, b in parts:
        ranks = slice(first, first + a.shape[0])
        with np.errstate(over="ignore"):
            scaled = np.ascontiguousarray(b * np.float32(scale))
        if not np.abs(scaled).max() <= limit:  # NaN compares False too
            raise ValueError(f"adapter {name!r}: its lora_B of {shard.name} times its scale {scale:g} (lora_alpha "
                             f"over r) is past what the model's dtype holds")
        lora.expands.append((shard.columns, ranks, torch.from_numpy(scaled)))
        first = ranks.stop
    return lora


def _digest(rank: int, modules: dict[tuple[int, str], ModuleLoRA]) -> str:
    """A short digest of the weights as served (scaled, in the model's layout): the adapter's identity in
    prefix-cache hashes."""
    digest = hashlib.sha256(f"rank {rank}".encode())
    for (layer, path), lora in sorted(modules.items()):
        digest.update(f"|{layer}.{path}".encode())
        digest.update(lora.shrink.numpy().data)
        for columns, ranks, expand in lora.expands:
            digest.update(f"|{columns.start}:{columns.stop}:{ranks.start}:{ranks.stop}".encode())
            digest.update(expand.numpy().data)
    return digest.hexdigest()[:16]


def _known_names(targets: dict[str, TargetModule]) -> str:
    return ", ".join(sorted({key.split(".", 1)[1] for key in targets}))
