"""A GGUF file's metadata and tensor table, read in one pass over the mapped file.

NOTE: the `gguf` package's GGUFReader makes a numpy view per value, so a tokenizer's ~100,000 vocabulary and merge
strings cost it 2 to 4 s on a small machine (most of loading SmolLM2-135M); struct over the same mapping, with the
string arrays in C (gguf_strings.pyx), reads them in milliseconds. The values match `{name: field.contents()}` of
GGUFReader, and each tensor's data is the same read-only view of the file (tests/engine/loading/test_gguf_reader.py
compares them), except that numeric arrays stay read-only numpy views of the file.

NOTE: reading the metadata must cost about what the file holds, whatever the file: a hostile 96 MB file whose one
array held 24M values cost ~1 GB as a Python list. So numeric arrays are views (no copy), and what must become
Python objects is bounded (keys, tensors, values per key, bytes per string), each past its bound a ValueError
naming the key, before any of it is built.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np

from pagegate.engine.loading.gguf_strings import read_strings
from pagegate.engine.loading.gguf_types import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

SUPPORTED_VERSIONS = (2, 3)
MAX_KEYS = 1 << 16  # real files hold tens
MAX_TENSORS = 1 << 16  # a 1T-parameter MoE with merged experts holds ~1,300
MAX_ARRAY_VALUES = 1 << 22  # per key, nested arrays flattened: 16x the largest vocabularies and merge lists (~262k)
MAX_STRING_BYTES = 1 << 22  # one string: chat templates run to tens of KB
MAX_NAME_BYTES = (1 << 16) - 1  # a key or tensor name (the spec's bound for keys)
MAX_NESTING = 8
MAX_DIMS = 8  # ggml's own bound is 4
_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
            GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}
_PLAIN_TENSORS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


class GGUFTensor(NamedTuple):
    """One tensor: `shape` lists its dims innermost first (as the file does); `data` maps its bytes (quantized
    types as uint8 rows of blocks, plain ones as their dtype), in PyTorch's order."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFContents:
    """The metadata ({key: value}; numeric arrays as read-only numpy views of the file, string arrays as lists,
    nested arrays flattened) and tensors of a GGUF file; ValueError when it is not one this reader knows (bad
    magic, an unknown version or value type, a duplicate key or tensor) or is past a bound (MAX_*)."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as file:
            self._mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._mapping, np.uint8)  # read-only, as the mapping
        self.bytes = self.data.data  # the same mapping as a memoryview, for struct
        self.offset = 0
        self.order: Literal["<", ">"] = "<"
        if self._unpack("<I") != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version = self._unpack("<I")
        if version & 0xFFFF == 0:  # a small number read in the wrong order: a big-endian file
            self.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported")
        tensor_count, kv_count = self._unpack("Q"), self._unpack("Q")
        if kv_count > MAX_KEYS or tensor_count > MAX_TENSORS:
            raise ValueError(f"GGUF header claims {kv_count:,} metadata keys and {tensor_count:,} tensors; at most "
                             f"{MAX_KEYS:,} and {MAX_TENSORS:,} are read")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string("a metadata key", MAX_NAME_BYTES)
            if key in self.metadata:
                raise KeyError(f"Duplicate {key} in the metadata")
            self.metadata[key] = self._value(GGUFValueType(self._unpack("I")), key, [MAX_ARRAY_VALUES], 0)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        self.tensors = self._tensors(infos, self._data_start())

    def release(self, tensor: GGUFTensor) -> None:
        """Take a tensor read in full out of this process's resident memory (its whole pages of the mapping; the
        page cache keeps them): a load's peak is then what it keeps, not that plus the file."""
        start, end = np.lib.array_utils.byte_bounds(tensor.data)
        base = self.data.ctypes.data
        first = -(-(start - base) // mmap.PAGESIZE) * mmap.PAGESIZE
        last = (end - base) // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self._mapping.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _unpack(self, fmt: str) -> Any:
        fmt = fmt if fmt[0] in "<>" else self.order + fmt
        (value,) = struct.unpack_from(fmt, self.bytes, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def _string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        size = self._unpack("Q")
        if size > limit or self.offset + size > len(self.bytes):
            raise ValueError(f"GGUF {what}: a string of {size:,} bytes is past the file's end or the bound "
                             f"({limit:,} bytes)")
        start, self.offset = self.offset, self.offset + size
        return str(self.bytes[start:self.offset], "utf-8")

    def _value(self, kind: GGUFValueType, key: str, budget: list[int], depth: int) -> Any:
        """One value of `key`; `budget` holds how many more array values `key` may have (nested arrays share it)."""
        if kind == GGUFValueType.STRING:
            return self._string(f"metadata {key!r}")
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == GGUFValueType.ARRAY:
            return self._array(GGUFValueType(self._unpack("I")), self._unpack("Q"), key, budget, depth)
        raise ValueError(f"Unknown/unhandled field type {kind}")

    def _array(self, kind: GGUFValueType, length: int, key: str, budget: list[int],
               depth: int) -> np.ndarray | list[Any]:
        """A numpy view of the file (numbers), a list (strings), or an array of arrays flattened (as GGUFReader's
        contents() does)."""
        if length > budget[0] or depth >= MAX_NESTING:
            raise ValueError(f"GGUF metadata {key!r}: an array of {length:,} values (nesting {depth + 1}); at "
                             f"most {MAX_ARRAY_VALUES:,} values, {MAX_NESTING} deep, are read per key")
        budget[0] -= length
        if kind in _SCALARS:
            dtype = np.dtype(_SCALARS[kind]).newbyteorder(self.order)
            values = np.frombuffer(self.data, dtype, length, self.offset)
            self.offset += values.nbytes
            return values
        if kind == GGUFValueType.STRING:
            return self._strings(length, key)
        return _flatten([self._value(kind, key, budget, depth + 1) for _ in range(length)])

    def _strings(self, length: int, key: str) -> list[str]:
        """`length` strings in a row: the hot loop of a tokenizer's vocabulary and merges (in C)."""
        strings, self.offset = read_strings(self.bytes, self.offset, length, self.order, MAX_STRING_BYTES, key)
        return strings

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string("a tensor name", MAX_NAME_BYTES)
        count = self._unpack("I")
        if count > MAX_DIMS:
            raise ValueError(f"GGUF tensor {name!r} claims {count:,} dimensions; at most {MAX_DIMS}")
        dims = tuple(self._unpack("Q") for _ in range(count))
        return name, dims, GGMLQuantizationType(self._unpack("I")), self._unpack("Q")

    def _data_start(self) -> int:
        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("Invalid alignment: must be a non-zero power of two")
        return -(-self.offset // alignment) * alignment

    def _tensors(self, infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]],
                 start: int) -> list[GGUFTensor]:
        tensors, names = [], set()
        for name, dims, kind, offset in infos:
            if name in names:
                raise ValueError(f"Found duplicated tensor with name {name}")
            names.add(name)
            elements = int(np.prod(dims))
            shape = tuple(reversed(dims))
            if kind in _PLAIN_TENSORS:
                dtype, count = np.dtype(_PLAIN_TENSORS[kind]).newbyteorder(self.order), elements
            else:
                block_values, block_bytes = GGML_QUANT_SIZES[kind]
                dtype, count = np.dtype(np.uint8), elements * block_bytes // block_values
                shape = _byte_shape(shape, kind)
            at = start + offset
            data = self.data[at:at + count * dtype.itemsize].view(dtype)[:count].reshape(shape)
            tensors.append(GGUFTensor(name, kind, dims, data))
        return tensors


def _byte_shape(shape: tuple[int, ...], kind: GGMLQuantizationType) -> tuple[int, ...]:
    """A quantized tensor's shape in bytes: its rows of blocks (gguf.quants.quant_shape_to_byte_shape)."""
    block_values, block_bytes = GGML_QUANT_SIZES[kind]
    if shape[-1] % block_values != 0:
        raise ValueError(f"Quantized tensor row size ({shape[-1]}) is not a multiple of {kind.name} block size "
                         f"({block_values})")
    return (*shape[:-1], shape[-1] // block_values * block_bytes)


def _flatten(parts: list[Any]) -> np.ndarray | list[Any]:
    """Arrays of one array's elements, end to end: one numpy array when all are numbers of one type."""
    if parts and all(isinstance(part, np.ndarray) for part in parts) and len({part.dtype for part in parts}) == 1:
        flat_numbers = np.concatenate(parts)  # a copy (at most MAX_ARRAY_VALUES), read-only as the views are
        flat_numbers.flags.writeable = False
        return flat_numbers
    flat: list[Any] = []
    for part in parts:
        flat.extend(part.tolist() if isinstance(part, np.ndarray) else part)
    return flat
