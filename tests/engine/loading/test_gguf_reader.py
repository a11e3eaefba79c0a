"""pagegate's GGUF reader against the gguf package's GGUFReader: the same metadata values (types included; numeric
arrays as numpy views) and the same tensor views, on the real SmolLM2 file and on files holding every value type,
in both byte orders; and a hostile file's metadata read at the cost of what it holds, not ten times it."""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from pagegate.engine.errors import ModelLoadError
from pagegate.engine.loading.gguf_file import GGUFFile, dequantized
from pagegate.engine.loading.gguf_reader import MAX_ARRAY_VALUES, MAX_STRING_BYTES, GGUFContents

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
        mine = ours.metadata[key]
        if isinstance(mine, np.ndarray):  # numbers stay a read-only view of the file
            assert not mine.flags.writeable and (not mine.flags.owndata or key == "test.nested"), key
            mine = mine.tolist()
        assert mine == value and type(mine) is type(value), key
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
    assert metadata["test.strings"] == ["a", "", "ĠĊ", "日本"] and metadata["test.nested"].tolist() == [1, 2, 3]
    assert isinstance(metadata["test.ints"], np.ndarray) and metadata["test.ints"].tolist() == [1, -2, 3]


def test_tensor_data_is_a_read_only_view_of_the_file(tmp_path: Path) -> None:
    tensor = GGUFContents(write_every_type(tmp_path / "every.gguf", GGUFEndian.LITTLE)).tensors[0]
    assert not tensor.data.flags.owndata and not tensor.data.flags.writeable


def test_tensors_dequantize_as_the_gguf_package_dequantizes_them(tmp_path: Path) -> None:
    """F32 and F16 without importing it, blocks by it."""
    for tensor in GGUFContents(write_every_type(tmp_path / "every.gguf", GGUFEndian.LITTLE)).tensors:
        expected = np.asarray(dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type)), dtype=np.float32)
        values = dequantized(tensor)
        assert values.dtype == np.float32 and np.array_equal(values, expected), tensor.name


def test_a_released_tensor_reads_the_same_values_again(tmp_path: Path) -> None:
    writer = GGUFWriter(str(tmp_path / "large.gguf"), "llama")
    rng = np.random.default_rng(0)
    for name in ("first", "second"):  # several pages each, the second's first page shared with the first's last
        writer.add_tensor(name, rng.standard_normal((7, 4099)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    contents = GGUFContents(tmp_path / "large.gguf")
    before = [np.array(tensor.data) for tensor in contents.tensors]
    for tensor in contents.tensors:
        contents.release(tensor)  # its whole pages leave this process's memory; the file still has them
    for tensor, values in zip(contents.tensors, before, strict=True):
        np.testing.assert_array_equal(tensor.data, values)


@pytest.mark.parametrize("damage", ["magic", "truncated"])
def test_a_damaged_file_is_refused(damage: str, tmp_path: Path) -> None:
    data = write_every_type(tmp_path / "every.gguf", GGUFEndian.LITTLE).read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:] if damage == "magic" else data[:200])
    with pytest.raises(Exception):  # noqa: B017 - GGUFFile turns any of them into a ModelLoadError
        GGUFContents(bad)


# Hostile metadata (issue 64, finding 9): read at the cost of what the file holds, bounded where it cannot be.

def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_hostile(path: Path, values: int, arch: str = "evil") -> Path:
    """A GGUF whose first key is an int32 array of `values` zeros (a sparse file) and whose architecture, last
    (order is only a convention), is `arch`; no tensors."""
    with path.open("wb") as file:
        file.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 2))
        file.write(_string("evil.values") + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.INT32, values))
        file.seek(4 * values, 1)
        file.write(_string("general.architecture") + struct.pack("<I", GGUFValueType.STRING) + _string(arch))
    return path


def peak_bytes_of(action) -> tuple[BaseException | None, int]:
    """What `action()` raised, and the most memory Python and numpy held at once meanwhile (tracemalloc)."""
    tracemalloc.start()
    try:
        action()
        raised = None
    except Exception as error:  # noqa: BLE001 - handed back to be checked
        raised = error
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return raised, peak


@pytest.mark.parametrize(("values", "named"), [(24_000_000, "'evil.values'"),  # past the bound: 96 MB of values
                                               (3_000_000, "architecture 'evil'")],  # under it: a 12 MB view
                         ids=["over-the-bound", "under-the-bound"])
def test_a_hostile_metadata_array_is_never_materialized(tmp_path: Path, values: int, named: str) -> None:
    path = write_hostile(tmp_path / "hostile.gguf", values)
    raised, peak = peak_bytes_of(lambda: GGUFFile(path))
    assert peak < 4 << 20, f"reading the metadata held {peak / 2**20:.0f} MiB"  # a list: 24 to 200 MiB (zeros)
    assert isinstance(raised, ModelLoadError) and named in str(raised), raised
    if values <= MAX_ARRAY_VALUES:
        array = GGUFContents(path).metadata["evil.values"]
        assert isinstance(array, np.ndarray) and array.shape == (values,) and not array.flags.owndata


def _header(kv_count: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, kv_count)


@pytest.mark.parametrize(("data", "message"), [
    (_header(1 << 40), "1,099,511,627,776 metadata keys"),
    (_header() + _string("evil.strings") + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.STRING,
                                                        MAX_ARRAY_VALUES + 1) + bytes(64), "'evil.strings'"),
    (_header() + _string("evil.string") + struct.pack("<IQ", GGUFValueType.STRING, MAX_STRING_BYTES + 1)
     + bytes(64), "'evil.string'"),
    (_header() + _string("evil.nested") + struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.ARRAY, 1) * 9
     + bytes(64), "'evil.nested'"),
    (_header() + struct.pack("<Q", 1 << 20) + bytes(64), "a metadata key"),
], ids=["keys", "string-array", "string", "nesting", "key-name"])
def test_metadata_past_a_bound_is_refused_naming_it(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bounded.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match="GGUF") as raised:
        GGUFContents(path)
    assert message in str(raised.value)


def test_strings_read_fast_enough(smollm2_gguf: Path) -> None:
    """The vocabulary and merges (~49k + 49k strings) still come back as lists of str."""
    metadata = GGUFContents(smollm2_gguf).metadata
    tokens, merges = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.merges"]
    assert isinstance(tokens, list) and isinstance(tokens[0], str) and len(tokens) == 49152
    assert isinstance(merges, list) and " " in merges[0]
