"""pagegate's GGUF reader against the gguf package's GGUFReader: the same metadata values (types included) and the
same tensor views, on the real SmolLM2 file and on files holding every value type, in both byte orders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from pagegate.engine.loading.gguf_reader import GGUFContents

VALUES: list[tuple[str, object, GGUFValueType, GGUFValueType | None]] = [
    ("test.uint8", 200, GGUFValueType.UINT8, None), ("test.int8", -100, GGUFValueType.INT8, None),
    ("test.uint16", 60000, GGUFValueType.UINT16, None), ("test.int16", -30000, GGUFValueType.INT16, None),
    ("test.uint32", 4_000_000_000, GGUFValueType.UINT32, None), ("test.int32", -2_000_000_000, GGUFValueType.INT32, None),
    ("test.uint64", 2**63 + 5, GGUFValueType.UINT64, None), ("test.int64", -(2**62), GGUFValueType.INT64, None),
    ("test.float32", 0.1, GGUFValueType.FLOAT32, None), ("test.float64", 0.1, GGUFValueType.FLOAT64, None),
    ("test.bool", True, GGUFValueType.BOOL, None), ("test.string", "héllo ▁wörld", GGUFValueType.STRING, None),
    ("test.strings", ["a", "", "ĠĊ", "日本"], GGUFValueType.ARRAY, GGUFValueType.STRING),
    ("test.floats", [0.5, -1.25, 3.1], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    ("test.ints", [1, -2, 3], GGUFValueType.ARRAY, GGUFValueType.INT32),
    ("test.bools", [True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL),
    ("test.nested", [[1, 2], [3]], GGUFValueType.ARRAY, GGUFValueType.ARRAY),
]


def write_every_type(path: Path, endianess: GGUFEndian) -> Path:
    writer = GGUFWriter(str(path), "llama", endianess=endianess)
    for key, value, kind, sub_kind in VALUES:
        writer.add_key_value(key, value, kind, sub_kind)
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal((2, 4)).astype(np.float16))
    if endianess == GGUFEndian.LITTLE:  # quantized blocks are written as they are: little-endian files only
        for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1):
            blocks = quantize(rng.standard_normal((4, 64)).astype(np.float32), qtype)
            writer.add_tensor(f"blocks.{qtype.name}", blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_as_gguf(path: Path) -> None:
    theirs, ours = GGUFReader(path), GGUFContents(path)
    expected = {name: field.contents() for name, field in theirs.fields.items() if not name.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, their in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == their.tensor_type
        assert mine.shape == tuple(int(d) for d in their.shape)
        assert mine.data.dtype == their.data.dtype and mine.data.shape == their.data.shape
        assert np.array_equal(mine.data, their.data)


def test_smollm2_reads_as_the_gguf_package_reads_it(smollm2_gguf: Path) -> None:
    assert_same_as_gguf(smollm2_gguf)


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_type_reads_as_the_gguf_package_reads_it(endianess: GGUFEndian, tmp_path: Path) -> None:
    path = write_every_type(tmp_path / "every.gguf", endianess)
    assert_same_as_gguf(path)
    metadata = GGUFContents(path).metadata
    assert metadata["test.strings"] == ["a", "", "ĠĊ", "日本"] and metadata["test.nested"] == [1, 2, 3]


def test_tensor_data_is_a_read_only_view_of_the_file(tmp_path: Path) -> None:
    tensor = GGUFContents(write_every_type(tmp_path / "every.gguf", GGUFEndian.LITTLE)).tensors[0]
    assert isinstance(tensor.data, np.memmap) and not tensor.data.flags.writeable


@pytest.mark.parametrize("damage", ["magic", "truncated"])
def test_a_damaged_file_is_refused(damage: str, tmp_path: Path) -> None:
    data = write_every_type(tmp_path / "every.gguf", GGUFEndian.LITTLE).read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:] if damage == "magic" else data[:200])
    with pytest.raises(Exception):  # noqa: B017 - GGUFFile turns any of them into a ModelLoadError
        GGUFContents(bad)
