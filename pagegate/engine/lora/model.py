"""The model's adapters: registered by name, their weights loaded while their pages are held (pages.py), and
each step's rows grouped by adapter so every adapted projection adds its rows' low-rank updates.

NOTE: the base matmul runs once for the whole batch (base rows and adapter rows alike); a forward hook on each
adapted module then adds, per adapter in the step, (x[rows] @ A.T) @ B.T into those rows (S-LoRA/Punica's
shrink and expand, grouped by adapter: a step holds few adapters, and a sequence's rows are one contiguous run).
Hooks keep the modules' types, so the GGUF blocks, the native decoder and the loaders see the model unchanged.

NOTE: on a CPU float32 model with the native extension (the "auto" backend), a loaded adapter takes a slot of a
`cpu_decode.LoRATable` (max_loras slots, float32 weights whatever the base's blocks): the native decode step adds
the updates inside its C layers, so a step with adapter rows stays on it, and the torch forward (prefill, big steps)
adds them with one C call per projection from the hook, every adapter of the step at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pagegate.config import LoRAConfig
from pagegate.engine.errors import InvalidParamError
from pagegate.engine.lora.adapter import (
    TARGET_PATHS,
    AdapterWeights,
    TargetModule,
    model_heads,
    model_targets,
    read_adapter,
    to_device,
)
from pagegate.engine.lora.request import LoRARequest
from pagegate.engine.models.base import CausalLM
from pagegate.engine.step_parts import Groups, slot_groups
from pagegate.kernels.dispatch import decode_kernel, requested_backend

if TYPE_CHECKING:
    from pagegate.engine.lora.slots import AdapterSlots

Rows = slice | torch.Tensor  # a step's rows of one adapter: one contiguous run, or their indices


@dataclass(frozen=True)
class Registered:
    """A known adapter: what names it, its identity (name and weights digest), its size in bytes on the model's
    device, and its weights as read and checked when it was registered (host memory: a load into a slot copies
    them from there, never from its files again)."""

    request: LoRARequest
    identity: str
    nbytes: int
    weights: AdapterWeights = field(compare=False, repr=False)


class LoRAModel:
    """Adapters over one base model. `page_bytes` is one KV page's bytes: an adapter takes
    ceil(nbytes / page_bytes) pages of the pool while its weights are loaded."""

    def __init__(self, model: CausalLM, config: LoRAConfig, page_bytes: int) -> None:
        if model.tp.size > 1:
            raise ValueError("--enable-lora does not combine with tensor parallelism yet")
        self.config, self.page_bytes, self.max_loras = config, page_bytes, config.max_loras
        self.dtype, self.device = model.dtype, model.device
        self.value_limit = float(torch.finfo(model.dtype).max)  # a scaled B past it is refused when it is read
        self.targets: dict[str, TargetModule] = model_targets(model)
        self.heads = model_heads(model)
        self.registered: dict[str, Registered] = {}
        self.loaded: dict[str, AdapterWeights] = {}  # the torch ops' weights (where there is no kernel table)
        self.groups: list[tuple[AdapterWeights, Rows]] = []  # this step's rows of each adapter
        self.table = kernel_table(model, self.targets, config)  # the native extension's slots, or None
        self.table_slot: dict[str, int] = {}  # each loaded adapter's slot of max_loras
        self.step_groups: Groups | None = None  # this step's adapted rows by slot
        self.slots: AdapterSlots | None = None  # CUDA: the adapters stacked for the grouped Triton kernels
        if self.device.type == "cuda":
            from pagegate.engine.lora.slots import AdapterSlots  # imports triton: only where it runs

            self.slots = AdapterSlots(self.targets, config, self.dtype, self.device)
        for target in {(t.layer, t.path): t for t in self.targets.values()}.values():
            module: nn.Module = model.model.layers[target.layer].get_submodule(target.path)
            module.register_forward_hook(partial(self._add_updates, (target.layer, target.path)))
        for lora_int_id, (name, path) in enumerate(config.modules, start=1):
            self.register(LoRARequest(name, lora_int_id, path))

    # ---- the adapters known -------------------------------------------------------------------------

    def register(self, lora: LoRARequest) -> Registered:
        """Check an adapter against the model and the limits (read whole once, here) and remember it; the same
        request again is a no-op. ValueError naming what does not fit; nothing is held after it."""
        known = self.registered.get(lora.lora_name)
        if known is not None:
            if known.request != lora:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} is already loaded as {known.request}")
            return known
        return self.install(lora, self.read(lora.lora_name, lora.lora_path))

    def read(self, name: str, path: str, lora_dir: str | None = None) -> AdapterWeights:
        """An adapter's weights read and checked into host tensors; ValueError naming what does not fit. Touches no
        state of this model and runs no torch op: the engine core calls it on its loader thread (loader.py)."""
        return read_adapter(name, path, self.targets, self.config.max_lora_rank, self.heads, lora_dir,
                            self.value_limit)

    def install(self, lora: LoRARequest, weights: AdapterWeights) -> Registered:
        """Remember an adapter read by `read`: ValueError when its name or id is another's. The same name, path and
        weights again is the adapter already there (a retried load)."""
        identity = f"{lora.lora_name}:{weights.digest}"
        known = self.registered.get(lora.lora_name)
        if known is not None:
            if known.request.lora_path == lora.lora_path and known.identity == identity:
                return known
            raise ValueError(f"LoRA adapter {lora.lora_name!r} is already loaded as {known.request}")
        clash = next((r for r in self.registered.values() if r.request.lora_int_id == lora.lora_int_id), None)
        if clash is not None:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already {clash.request.lora_name!r}'s")
        registered = Registered(lora, identity, weights.numel * self.dtype.itemsize, weights)
        self.registered[lora.lora_name] = registered
        return registered

    def unregister(self, name: str) -> None:
        """Forget an adapter (its pages were released first: Scheduler.unload_adapter)."""
        if name not in self.registered:
            raise InvalidParamError(f"the LoRA adapter {name!r} does not exist", "lora_name", "model_not_found")
        self.drop(name)
        del self.registered[name]

    @property
    def next_id(self) -> int:
        """An integer id no registered adapter has (for adapters loaded at run time by name and path)."""
        return max((r.request.lora_int_id for r in self.registered.values()), default=0) + 1

    def nbytes(self, name: str) -> int:
        return self.registered[name].nbytes

    def load(self, name: str) -> None:
        """A registered adapter's weights onto the model's device, from the host copy checked when it was registered
        (never its files again), and into a free slot (its pages were just taken; pages.py keeps at most max_loras
        adapters loaded)."""
        weights = to_device(self.registered[name].weights, self.dtype, self.device)
        slot = next((s for s in range(self.max_loras) if s not in self.table_slot.values()), None)
        if slot is None:
            raise RuntimeError(f"all {self.max_loras} LoRA slots are taken; {name!r} cannot load")
        if self.table is None:
            self.loaded[name] = weights
        else:
            try:
                fill_slot(self.table, slot, weights)
            except BaseException:
                self.table.clear(slot)
                raise
        self.table_slot[name] = slot

    def drop(self, name: str) -> None:
        """Its pages went back: the device weights and its slot go too (the host copy stays until it is
        unregistered)."""
        self.loaded.pop(name, None)
        slot = self.table_slot.pop(name, None)
        if slot is not None and self.table is not None:
            self.table.clear(slot)

    # ---- one step -----------------------------------------------------------------------------------

    def set_step(self, adapter_names: Sequence[str | None], starts: np.ndarray) -> Groups | None:
        """Group the step's rows by adapter (sequence i's rows are starts[i]:starts[i + 1]) for the hooks; the
        groups by slot (what the kernel takes), or None when no row takes an adapter."""
        self.step_groups, self.groups = None, []
        if all(name is None for name in adapter_names):
            return None
        row_slots = np.repeat(np.array([-1 if n is None else self.table_slot[n] for n in adapter_names], np.int32),
                              np.diff(starts))
        self.step_groups = slot_groups(row_slots)
        if self.table is not None:  # the kernel adds them: no torch rows to build
            return self.step_groups
        runs: dict[str, list[tuple[int, int]]] = {}
        for i, name in enumerate(adapter_names):
            if name is not None:
                runs.setdefault(name, []).append((int(starts[i]), int(starts[i + 1])))
        self.groups = [(self.loaded[name], _as_rows(spans, self.device)) for name, spans in runs.items()]
        if self.slots is not None:
            self.slots.set_step(self.loaded, self.table_slot, runs)
        return self.step_groups

    def _add_updates(self, key: tuple[int, str], module: nn.Module, inputs: tuple[torch.Tensor, ...],
                     output: torch.Tensor) -> torch.Tensor | None:
        if self.step_groups is None:
            return None
        if self.table is not None:  # one C call adds every adapter of the step (cpu_lora.h)
            layer, path = key
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).contiguous()
            self.table.add(layer, TARGET_PATHS.index(path), x, output.view(-1, output.shape[-1]), self.step_groups)
            return output
        if self.slots is not None:  # CUDA: one grouped shrink and expand per shard (kernels/triton_lora.py)
            return self.slots.add_updates(key, inputs[0], output)
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


def kernel_table(model: CausalLM, targets: dict[str, TargetModule], config: LoRAConfig) -> Any | None:
    """The native extension's adapter slots for `model` (cpu_decode.LoRATable) where its C may add the updates: a
    CPU float32 model, the "auto" backend, the extension built; else None."""
    kernel = decode_kernel()
    if kernel is None or requested_backend() != "auto" or model.device.type != "cpu" or model.dtype != torch.float32:
        return None
    modules = {(t.layer, t.path): t for t in targets.values()}
    shapes = [[(modules[layer, path].in_features, modules[layer, path].shards[-1].columns.stop)
               for path in TARGET_PATHS] for layer in range(len(model.model.layers))]
    widest = max(len(t.shards) for t in modules.values())
    table = kernel.LoRATable(config.max_loras, shapes, widest * config.max_lora_rank)
    table.threads = torch.get_num_threads()
    return table


def fill_slot(table: Any, slot: int, weights: AdapterWeights) -> None:
    """An adapter's updates into a table slot: its shrinks as they are, each shard's B transposed (the C streams it
    along the output)."""
    for (layer, path), lora in weights.modules.items():
        shards = [(columns.start, ranks.start, expand.T.contiguous()) for columns, ranks, expand in lora.expands]
        table.set(slot, layer, TARGET_PATHS.index(path), lora.shrink, shards)


def _as_rows(spans: list[tuple[int, int]], device: torch.device) -> Rows:
    """Row spans [start, stop) in batch order: one contiguous run as a slice (a view, no copy), else the indices."""
    if all(stop == next_start for (_, stop), (next_start, _) in zip(spans, spans[1:], strict=False)):
        return slice(spans[0][0], spans[-1][1])
    return torch.cat([torch.arange(start, stop, device=device) for start, stop in spans])
