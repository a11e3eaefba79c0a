"""A GGUF LoRA adapter (llama.cpp's `convert_lora_to_gguf.py` output) read into PEFT's form: the config keys and
tensor names adapter.py reads from a PEFT folder, so both formats take one path from there on.

The file says `general.type = "adapter"`, `adapter.type = "lora"` and `adapter.lora.alpha`; its tensors are
`blk.N.<module>.weight.lora_a` [r, in] and `.lora_b` [out, r] (F32, F16, BF16 or Q8_0). llama.cpp scales an update
by alpha / r with r each tensor's own rank (rsLoRA's alpha / sqrt(r) does not survive the conversion)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

from pagegate.engine.loading.gguf_loader import hf_name

_HALVES = {"lora_a": "lora_A", "lora_b": "lora_B"}
# NOTE: llama.cpp's converter permutes Q and K rows for "llama" (each head's rotary halves interleaved), and a
# LoRA's B goes through the same permute (its rows are the projection's rows); undone here like the base weights.
_PERMUTED = {"llama": ("self_attn.q_proj", "self_attn.k_proj")}


def read_gguf_adapter(path: Path, heads: dict[str, int]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json's keys, {PEFT tensor name: tensor}) of a GGUF LoRA file; ValueError naming what is
    wrong with it. `heads` is the base model's head count per projection ("q_proj", "k_proj")."""
    try:
        reader = GGUFReader(path)
    except Exception as error:  # the gguf package raises whatever numpy hits on a bad file
        raise ValueError(f"cannot read {path} as GGUF (truncated or corrupt?): {error}") from None
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    if metadata.get("general.type") != "adapter" or metadata.get("adapter.type") != "lora":
        raise ValueError(f"{path} is a GGUF file but not a LoRA adapter (general.type "
                         f"{metadata.get('general.type')!r}, adapter.type {metadata.get('adapter.type')!r})")
    arch = str(metadata.get("general.architecture"))
    tensors = {_peft_name(path, tensor.name, arch): _array(path, tensor) for tensor in reader.tensors}
    tensors = {name: _unpermuted(name, values, arch, heads) for name, values in tensors.items()}
    ranks = {int(t.shape[0]) for name, t in tensors.items() if name.endswith("lora_A.weight")}
    if len(ranks) != 1:
        raise ValueError(f"{path}: its LoRA tensors have ranks {sorted(ranks)}; one rank for all is supported")
    return {"r": ranks.pop(), "lora_alpha": float(metadata.get("adapter.lora.alpha", 0.0))}, tensors


def _peft_name(path: Path, gguf_name: str, arch: str) -> str:
    """`blk.3.attn_q.weight.lora_a` -> `model.layers.3.self_attn.q_proj.lora_A.weight`."""
    base, _, half = gguf_name.rpartition(".")
    if half not in _HALVES or not base.endswith(".weight"):
        raise ValueError(f"{path} holds {gguf_name}, which is not a lora_a or lora_b tensor (norms, embeddings "
                         f"and output adapters are not supported)")
    return f"{hf_name(base, arch).removesuffix('.weight')}.{_HALVES[half]}.weight"


def _array(path: Path, tensor: ReaderTensor) -> torch.Tensor:
    """One tensor as float32 in PyTorch's [rows, columns] order (GGUF lists dims innermost first)."""
    try:
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which pagegate "
                         f"cannot dequantize") from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(values.reshape(shape).copy())  # the file is mapped read-only


def _unpermuted(name: str, values: torch.Tensor, arch: str, heads: dict[str, int]) -> torch.Tensor:
    """A Q or K lora_B's rows back in the checkpoint's order (see gguf_loader.GGUFFile._unpermuted)."""
    module = next((m for m in _PERMUTED.get(arch, ()) if name.endswith(f"{m}.lora_B.weight")), None)
    if module is None:
        return values
    count = heads[module.rsplit(".", 1)[1]]
    if values.shape[0] % (2 * count):
        raise ValueError(f"{name} has {values.shape[0]} rows, which this model's {count} heads do not divide")
    return values.reshape(count, -1, 2, values.shape[1]).transpose(1, 2).reshape(values.shape)
