"""Where each checkpoint tensor goes in a built model: the one layout both file formats load into."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.models.base import CausalLM


class Target(NamedTuple):
    """Where a checkpoint tensor goes: rows [start, start + rows) of `param`, from the part `source` of the
    checkpoint tensor (everything, or this rank's rows or columns under tensor parallelism)."""

    param: torch.Tensor
    start: int
    rows: int
    source: tuple[slice, ...] = ()


def checkpoint_layout(model: CausalLM) -> dict[str, Target]:
    """Checkpoint tensor name -> its Target, for every expected tensor."""
    layout: dict[str, Target] = {}
    for name, param in model.named_parameters():  # a tied lm_head shares embed_tokens and is listed once
        module_path, leaf = name.rsplit(".", 1)
        module = model.get_submodule(module_path)
        shard_names = getattr(module, "shard_names", ())  # PackedLinear and its QuantLinear stack several tensors
        if not shard_names:
            columns = getattr(module, "in_columns", None)  # a row-parallel layer's slice of the input features
            source = (slice(None), columns) if columns is not None and leaf == "weight" else ()
            layout[name] = Target(param, 0, param.shape[0], source)
            continue
        parent, start = module_path.rsplit(".", 1)[0], 0
        rows = getattr(module, "shard_rows", None) or [slice(None)] * len(shard_names)
        for shard_name, size, part in zip(shard_names, getattr(module, "shard_sizes", ()), rows, strict=True):
            layout[f"{parent}.{shard_name}.{leaf}"] = Target(param, start, size, (part,))
            start += size
    return layout


def copy_into(name: str, tensor: torch.Tensor, target: Target) -> None:
    """Copy a checkpoint tensor into its rows of the parameter; a shape mismatch fails."""
    param, start, rows = target.param, target.start, target.rows
    expected = (rows, *param.shape[1:])
    if tuple(tensor.shape) != expected:
        raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, the model expects {expected}")
    param.data[start:start + rows].copy_(tensor)
