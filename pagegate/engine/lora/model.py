"""The model's adapters: registered by name, their weights loaded while their pages are held (pages.py), and
each step's rows grouped by adapter so every adapted projection adds its rows' low-rank updates.

NOTE: the base matmul runs once for the whole batch (base rows and adapter rows alike); a forward hook on each
adapted module then adds, per adapter in the step, (x[rows] @ A.T) @ B.T into those rows (S-LoRA/Punica's
shrink and expand, grouped by adapter: a step holds few adapters, and a sequence's rows are one contiguous run).
Hooks keep the modules' types, so the GGUF blocks, the native decoder and the loaders see the model unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from pagegate.config import LoRAConfig
from pagegate.engine.errors import InvalidParamError
from pagegate.engine.lora.adapter import (
    AdapterWeights,
    TargetModule,
    adapter_digest,
    model_heads,
    model_targets,
    read_adapter,
)
from pagegate.engine.lora.request import LoRARequest
from pagegate.engine.models.base import CausalLM

Rows = slice | torch.Tensor  # a step's rows of one adapter: one contiguous run, or their indices


@dataclass(frozen=True)
class Registered:
    """A known adapter: what names it, its identity (name and weights digest) and its size in bytes."""

    request: LoRARequest
    identity: str
    nbytes: int


class LoRAModel:
    """Adapters over one base model. `page_bytes` is one KV page's bytes: an adapter takes
    ceil(nbytes / page_bytes) pages of the pool while its weights are loaded."""

    def __init__(self, model: CausalLM, config: LoRAConfig, page_bytes: int) -> None:
        if model.tp.size > 1:
            raise ValueError("--enable-lora does not combine with tensor parallelism yet")
        self.config, self.page_bytes, self.max_loras = config, page_bytes, config.max_loras
        self.dtype, self.device = model.dtype, model.device
        self.targets: dict[str, TargetModule] = model_targets(model)
        self.heads = model_heads(model)
        self.registered: dict[str, Registered] = {}
        self.loaded: dict[str, AdapterWeights] = {}
        self.groups: list[tuple[AdapterWeights, Rows]] = []  # this step's rows of each adapter
        for target in {(t.layer, t.path): t for t in self.targets.values()}.values():
            module: nn.Module = model.model.layers[target.layer].get_submodule(target.path)
            module.register_forward_hook(partial(self._add_updates, (target.layer, target.path)))
        for lora_int_id, (name, path) in enumerate(config.modules, start=1):
            self.register(LoRARequest(name, lora_int_id, path))

    # ---- the adapters known -------------------------------------------------------------------------

    def register(self, lora: LoRARequest) -> Registered:
        """Check an adapter against the model and the limits (read whole once) and remember it; the same
        request again is a no-op. ValueError naming what does not fit; nothing is held after it."""
        known = self.registered.get(lora.lora_name)
        if known is not None:
            if known.request != lora:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} is already loaded as {known.request}")
            return known
        clash = next((r for r in self.registered.values() if r.request.lora_int_id == lora.lora_int_id), None)
        if clash is not None:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already {clash.request.lora_name!r}'s")
        weights = self._read(lora)
        registered = Registered(lora, f"{lora.lora_name}:{adapter_digest(lora.lora_path)}", weights.nbytes)
        self.registered[lora.lora_name] = registered
        return registered

    def unregister(self, name: str) -> None:
        """Forget an adapter (its pages were released first: Scheduler.unload_adapter)."""
        if name not in self.registered:
            raise InvalidParamError(f"the LoRA adapter {name!r} does not exist", "lora_name", "model_not_found")
        self.loaded.pop(name, None)
        del self.registered[name]

    @property
    def next_id(self) -> int:
        """An integer id no registered adapter has (for adapters loaded at run time by name and path)."""
        return max((r.request.lora_int_id for r in self.registered.values()), default=0) + 1

    def nbytes(self, name: str) -> int:
        return self.registered[name].nbytes

    def load(self, name: str) -> None:
        """Read a registered adapter's weights onto the model's device (its pages were just taken)."""
        self.loaded[name] = self._read(self.registered[name].request)

    def drop(self, name: str) -> None:
        """Its pages went back: the weights go too (read again from its folder on demand)."""
        self.loaded.pop(name, None)

    def _read(self, lora: LoRARequest) -> AdapterWeights:
        return read_adapter(lora.lora_name, lora.lora_path, self.targets, self.config.max_lora_rank, self.dtype,
                            self.device, self.heads)

    # ---- one step -----------------------------------------------------------------------------------

    def set_step(self, adapter_names: Sequence[str | None], starts: np.ndarray) -> bool:
        """Group the step's rows by adapter: sequence i's rows are starts[i]:starts[i + 1]. Whether any row
        takes an adapter."""
        runs: dict[str, list[tuple[int, int]]] = {}
        for i, name in enumerate(adapter_names):
            if name is not None:
                runs.setdefault(name, []).append((int(starts[i]), int(starts[i + 1])))
        self.groups = [(self.loaded[name], _as_rows(spans, self.device)) for name, spans in runs.items()]
        return bool(self.groups)

    def _add_updates(self, key: tuple[int, str], module: nn.Module, inputs: tuple[torch.Tensor, ...],
                     output: torch.Tensor) -> torch.Tensor | None:
        if not self.groups:
            return None
        x = inputs[0]
        for adapter, rows in self.groups:
            lora = adapter.modules.get(key)
            if lora is None:
                continue
            shrunk = x[rows] @ lora.shrink.T
            for columns, ranks, expand in lora.expands:
                output[rows, columns] += shrunk[:, ranks] @ expand.T
        return output


def resolve_adapter(lora_model: LoRAModel | None, lora: LoRARequest | str | None) -> Registered | None:
    """The adapter a request asks for: a LoRARequest (registered if new) or a registered adapter's name.
    InvalidParamError (param "model") when it cannot have it: "model_not_found" for an unknown name."""
    if lora is None:
        return None
    if lora_model is None:
        raise InvalidParamError("this engine serves no LoRA adapters (start it with enable_lora)", "model")
    if isinstance(lora, LoRARequest):
        try:
            return lora_model.register(lora)
        except ValueError as error:
            raise InvalidParamError(str(error), "model") from None
    known = lora_model.registered.get(lora)
    if known is None:
        raise InvalidParamError(f"the LoRA adapter {lora!r} does not exist", "model", "model_not_found")
    return known


def _as_rows(spans: list[tuple[int, int]], device: torch.device) -> Rows:
    """Row spans [start, stop) in batch order: one contiguous run as a slice (a view, no copy), else the indices."""
    if all(stop == next_start for (_, stop), (next_start, _) in zip(spans, spans[1:], strict=False)):
        return slice(spans[0][0], spans[-1][1])
    return torch.cat([torch.arange(start, stop, device=device) for start, stop in spans])
