"""On CUDA, the loaded adapters stacked by slot for the grouped Triton kernels (kernels/triton_lora.py): each
adapted module of a step then takes one shrink and one expand per shard, whichever adapters its rows run with.

Per adapted module: a shrink stack [max_loras, shards * max_lora_rank, in] (shard j's A in rows j * max_lora_rank
on) and per shard an expand stack [max_loras, shard rows, max_lora_rank] (its B, scaled). Zeros pad a lower rank
and fill the modules an adapter does not target, so they add nothing.

NOTE: this is vLLM's layout (max_loras slots of max_lora_rank, a module's stacks allocated when an adapter first
targets it). The stacks are copies beside the adapters' own tensors (model.py reads those on the torch path), so
on CUDA they are device memory outside the page budget: the pages stand for the adapters' own tensors."""

from __future__ import annotations

import weakref

import torch

from pagegate.config import LoRAConfig
from pagegate.engine.lora.adapter import AdapterWeights, ModuleLoRA, TargetModule
from pagegate.kernels.triton_lora import Segments, lora_expand, lora_shrink

ModuleKey = tuple[int, str]  # (layer, path inside it), as model.LoRAModel keys its hooks


class AdapterSlots:
    """The stacks of every adapted module, each loaded adapter written in the slot LoRAModel gave it on load."""

    def __init__(self, targets: dict[str, TargetModule], config: LoRAConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.modules: dict[ModuleKey, TargetModule] = {(t.layer, t.path): t for t in targets.values()}
        self.num_slots, self.max_rank, self.dtype, self.device = config.max_loras, config.max_lora_rank, dtype, device
        self.shrinks: dict[ModuleKey, torch.Tensor] = {}
        self.expands: dict[ModuleKey, list[tuple[slice, torch.Tensor]]] = {}  # per shard: its columns, its stack
        # slot -> the weights written there, weakly: a dropped adapter's tensors are not kept for it
        self.held: dict[int, weakref.ref[AdapterWeights]] = {}
        self.segments: Segments | None = None  # this step's rows of each adapter, by slot

    def set_step(self, loaded: dict[str, AdapterWeights], slot_of: dict[str, int],
                 runs: dict[str, list[tuple[int, int]]]) -> None:
        """This step's row spans [start, stop) of each adapter: its weights are written into its slot (`slot_of`,
        given as it was loaded) unless they are there, and the spans become the kernels' segments."""
        for name in runs:
            self._hold(slot_of[name], loaded[name])
        spans = [(start, stop, slot_of[name]) for name, spans in runs.items() for start, stop in spans]
        self.segments = Segments.of(spans, self.device) if spans else None

    def add_updates(self, key: ModuleKey, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None:
        """Add this step's low-rank updates of module `key` into its output [T, out] (x: its input [T, in])."""
        shrink = self.shrinks.get(key)
        if self.segments is None or shrink is None:
            return None
        shrunk = lora_shrink(x, shrink, self.segments)
        for shard, (columns, expand) in enumerate(self.expands[key]):
            ranks = slice(shard * self.max_rank, (shard + 1) * self.max_rank)
            lora_expand(shrunk[:, ranks], expand, self.segments, output[:, columns])
        return output

    def _hold(self, slot: int, weights: AdapterWeights) -> None:
        held = self.held.get(slot)
        if held is None or held() is not weights:  # another adapter's slot before, or this one read again
            self._write(slot, weights)
            self.held[slot] = weakref.ref(weights)

    def _write(self, slot: int, weights: AdapterWeights) -> None:
        for key in self.shrinks.keys() | weights.modules.keys():
            shrink, expands = self._stacks(key)
            shrink[slot].zero_()
            for _, expand in expands:
                expand[slot].zero_()
            lora = weights.modules.get(key)
            if lora is not None:
                self._write_module(slot, lora, shrink, expands)

    def _write_module(self, slot: int, lora: ModuleLoRA, shrink: torch.Tensor,
                      expands: list[tuple[slice, torch.Tensor]]) -> None:
        for columns, ranks, b in lora.expands:
            shard = next(i for i, (shard_columns, _) in enumerate(expands) if shard_columns == columns)
            rank = ranks.stop - ranks.start
            first = shard * self.max_rank
            shrink[slot, first:first + rank] = lora.shrink[ranks]
            expands[shard][1][slot, :, :rank] = b

    def _stacks(self, key: ModuleKey) -> tuple[torch.Tensor, list[tuple[slice, torch.Tensor]]]:
        """Module `key`'s shrink stack and its shards' expand stacks, zeros when first asked for."""
        if key not in self.shrinks:
            target = self.modules[key]
            self.shrinks[key] = self._zeros(len(target.shards) * self.max_rank, target.in_features)
            self.expands[key] = [(shard.columns, self._zeros(shard.columns.stop - shard.columns.start, self.max_rank))
                                 for shard in target.shards]
        return self.shrinks[key], self.expands[key]

    def _zeros(self, rows: int, columns: int) -> torch.Tensor:
        return torch.zeros(self.num_slots, rows, columns, dtype=self.dtype, device=self.device)
