"""A GGUF LoRA adapter (llama.cpp's `convert_lora_to_gguf.py` output) read into PEFT's form: the config keys and
tensor names adapter.py reads from a PEFT folder, so both formats take one path from there on.

The file says `general.type = "adapter"`, `adapter.type = "lora"` and `adapter.lora.alpha`; its tensors are
`blk.N.<module>.weight.lora_a` [r, in] and `.lora_b` [out, r] (F32, F16, BF16 or Q8_0). llama.cpp scales an update
by alpha / r with r each tensor's own rank (rsLoRA's alpha / sqrt(r) does not survive the conversion).

Arrays stay numpy (no torch op): the engine core reads adapters on a worker thread (adapter.py)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize

from pagegate.engine.loading.gguf_file import hf_name

_HALVES = {"lora_a": "lora_A", "lora_b": "lora_B"}
# NOTE: llama.cpp's converter permutes Q and K rows for "llama" (each head's rotary halves interleaved), and a
# LoRA's B goes through the same permute (its rows are the projection's rows); undone here like the base weights.
_PERMUTED = {"llama": ("self_attn.q_proj", "self_attn.k_proj")}
# a GGUF header's scalar value types and their sizes in bytes (STRING and ARRAY are read apart)
_SCALAR_BYTES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
                 GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
                 GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}
_MAX_KEY_BYTES = 1 << 16  # a header string longer than this is a corrupt file
# NOTE: llama.cpp writes a dozen keys into an adapter's header; thousands are a bogus file that would take seconds
# of parsing (gguf's reader makes Python objects per key), so such a header is refused before it is read whole.
MAX_HEADER_KEYS = 256


def check_gguf_header(path: Path, max_tensors: int) -> None:
    """ValueError unless the GGUF file's header says `general.type = "adapter"` and holds no more keys and tensors
    than an adapter has (`max_tensors`: A and B of every module the model takes adapters on): only the key-value
    header is read (arrays skipped by seeking), so a model's GGUF named as an adapter is refused before its tensors
    are touched."""
    try:
        with path.open("rb") as stream:
            kind, tensors, keys = _header_type(stream)
    except (struct.error, ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {path} as GGUF (truncated or corrupt?): {error}") from None
    if kind != "adapter":
        raise ValueError(f"{path} is a GGUF file but not a LoRA adapter (general.type {kind!r}); it is not read")
    if tensors > max_tensors or keys > MAX_HEADER_KEYS:
        raise ValueError(f"{path} says it holds {tensors} tensors and {keys} header keys; a LoRA adapter over this "
                         f"model holds at most {max_tensors} and {MAX_HEADER_KEYS}: it is not read")


def _header_type(stream: BinaryIO) -> tuple[str | None, int, int]:
    """(general.type, the tensor count, the key count) of a GGUF header."""
    if stream.read(4) != b"GGUF":
        raise ValueError("no GGUF magic")
    version, tensors, count = struct.unpack("<IQQ", _exactly(stream, 20))
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    for _ in range(min(count, MAX_HEADER_KEYS)):
        key = _string(stream)
        value_type = GGUFValueType(struct.unpack("<I", _exactly(stream, 4))[0])
        if key == "general.type" and value_type == GGUFValueType.STRING:
            return _string(stream), tensors, count
        _skip(stream, value_type)
    return None, tensors, count


def _exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise ValueError("the file ends inside its header")
    return data


def _string(stream: BinaryIO) -> str:
    size = struct.unpack("<Q", _exactly(stream, 8))[0]
    if size > _MAX_KEY_BYTES:
        raise ValueError(f"a header string of {size} bytes")
    return _exactly(stream, size).decode()


def _skip(stream: BinaryIO, value_type: GGUFValueType) -> None:
    if value_type == GGUFValueType.STRING:
        _string(stream)
    elif value_type == GGUFValueType.ARRAY:
        item_type = GGUFValueType(struct.unpack("<I", _exactly(stream, 4))[0])
        count = struct.unpack("<Q", _exactly(stream, 8))[0]
        if item_type in _SCALAR_BYTES:
            stream.seek(count * _SCALAR_BYTES[item_type], 1)
        else:
            for _ in range(count):
                _skip(stream, item_type)
    else:
        stream.seek(_SCALAR_BYTES[value_type], 1)


def read_gguf_adapter(path: Path, heads: dict[str, int]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(adapter_config.json's keys, {PEFT tensor name: float32 array}) of a GGUF LoRA file; ValueError naming what
    is wrong with it. `heads` is the base model's head count per projection ("q_proj", "k_proj")."""
    try:
        reader = GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items()}
    except Exception as error:  # the gguf package raises whatever numpy hits on a bad file
        raise ValueError(f"cannot read {path} as GGUF (truncated or corrupt?): {error}") from None
    if metadata.get("general.type") != "adapter" or metadata.get("adapter.type") != "lora":
        raise ValueError(f"{path} is a GGUF file but not a LoRA adapter (general.type "
                         f"{metadata.get('general.type')!r}, adapter.type {metadata.get('adapter.type')!r})")
    arch = str(metadata.get("general.architecture"))
    tensors = {_peft_name(path, tensor.name, arch): _array(path, tensor) for tensor in reader.tensors}
    tensors = {name: _unpermuted(name, values, arch, heads) for name, values in tensors.items()}
    ranks = {int(t.shape[0]) for name, t in tensors.items() if name.endswith("lora_A.weight")}
    if len(ranks) != 1:
        raise ValueError(f"{path}: its LoRA tensors have ranks {sorted(ranks)}; one rank for all is supported")
    alpha = metadata.get("adapter.lora.alpha", 0.0)
    return {"r": ranks.pop(), "lora_alpha": alpha if isinstance(alpha, int | float) else None}, tensors


def _peft_name(path: Path, gguf_name: str, arch: str) -> str:
    """`blk.3.attn_q.weight.lora_a` -> `model.layers.3.self_attn.q_proj.lora_A.weight`."""
    base, _, half = gguf_name.rpartition(".")
    if half not in _HALVES or not base.endswith(".weight"):
        raise ValueError(f"{path} holds {gguf_name}, which is not a lora_a or lora_b tensor (norms, embeddings "
                         f"and output adapters are not supported)")
    return f"{hf_name(base, arch).removesuffix('.weight')}.{_HALVES[half]}.weight"


def _array(path: Path, tensor: ReaderTensor) -> np.ndarray:
    """One tensor as float32 in PyTorch's [rows, columns] order (GGUF lists dims innermost first); integer types
    are refused (weights that are not numbers of a float type are a broken file)."""
    if tensor.tensor_type.name.startswith("I") and not tensor.tensor_type.name.startswith("IQ"):
        raise ValueError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}; LoRA weights must be "
                         f"float or quantized float")
    try:
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which pagegate "
                         f"cannot dequantize") from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return values.reshape(shape).copy()  # the file is mapped read-only


def _unpermuted(name: str, values: np.ndarray, arch: str, heads: dict[str, int]) -> np.ndarray:
    """A Q or K lora_B's rows back in the checkpoint's order (see gguf_file.GGUFFile.unpermuted)."""
    module = next((m for m in _PERMUTED.get(arch, ()) if name.endswith(f"{m}.lora_B.weight")), None)
    if module is None:
        return values
    count = heads[module.rsplit(".", 1)[1]]
    if values.ndim != 2 or values.shape[0] % (2 * count):
        raise ValueError(f"{name} has {values.shape[0]} rows, which this model's {count} heads do not divide")
    return np.ascontiguousarray(values.reshape(count, -1, 2, values.shape[1]).swapaxes(1, 2).reshape(values.shape))
