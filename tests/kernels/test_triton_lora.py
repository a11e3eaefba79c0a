"""The grouped LoRA kernels (kernels/triton_lora.py) against a float64 torch reference, over segment layouts
of a mixed batch: adapters' runs, base rows (slot -1), one adapter in runs apart, decode rows, rows of no segment.

Without a GPU they run on CPU tensors in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so shapes stay
small; bfloat16 runs too (upcast there, as the attention kernels do)."""

from __future__ import annotations

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from pagegate.kernels import triton_lora
from pagegate.kernels.triton_lora import Segments, lora_expand, lora_shrink

INTERPRETED = isinstance(triton_lora._shrink_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.fail("no CUDA device, and the kernels were imported without TRITON_INTERPRET=1", pytrace=False)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # relative to the values' scale
NUM_SLOTS = 3
# (start, stop, slot) of each segment; a step's rows are 0 .. the last stop
LAYOUTS = {
    "one decode row": [(0, 1, 1)],
    "mixed": [(0, 5, 1), (5, 6, -1), (6, 30, 0), (30, 31, 2), (31, 33, -1), (33, 34, 1)],
    "one adapter in runs apart": [(0, 3, 2), (3, 20, -1), (20, 21, 2), (21, 40, 2)],
    "rows in no segment": [(2, 4, 0), (9, 10, 1)],
    "base rows only": [(0, 7, -1)],
    "no segments": [],
}


def rows_of(layout: list[tuple[int, int, int]]) -> int:
    return max((stop for _, stop, _ in layout), default=4) + 3  # and a few rows after the last segment


def reference_shrink(x: torch.Tensor, lora_a: torch.Tensor, layout: list[tuple[int, int, int]]) -> torch.Tensor:
    s = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64)
    for start, stop, slot in layout:
        if slot >= 0:
            s[start:stop] = x[start:stop].double() @ lora_a[slot].double().T
    return s


def reference_expand(shrunk: torch.Tensor, lora_b: torch.Tensor, layout: list[tuple[int, int, int]],
                     y: torch.Tensor) -> torch.Tensor:
    expected = y.double()
    for start, stop, slot in layout:
        if slot >= 0:
            expected[start:stop] += shrunk[start:stop].to(lora_b.dtype).double() @ lora_b[slot].double().T
    return expected


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(got.double().cpu(), expected, rtol=0, atol=TOLERANCE[dtype] * scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_shrink_then_expand_per_segment(layout, dtype):
    gen = torch.Generator().manual_seed(0)
    rows, in_features, rank, out_features = rows_of(layout), 96, 12, 80  # none a multiple of its tile
    x = torch.randn(rows, in_features, generator=gen).to(DEVICE, dtype)
    lora_a = (0.1 * torch.randn(NUM_SLOTS, rank, in_features, generator=gen)).to(DEVICE, dtype)
    lora_b = (0.1 * torch.randn(NUM_SLOTS, out_features, rank, generator=gen)).to(DEVICE, dtype)
    y = torch.randn(rows, out_features, generator=gen).to(DEVICE, dtype)
    segments = Segments.of(layout, DEVICE)

    shrunk = lora_shrink(x, lora_a, segments)
    assert shrunk.dtype == dtype and shrunk.shape == (rows, rank)
    assert_close(shrunk, reference_shrink(x.cpu(), lora_a.cpu(), layout), dtype)

    expected = reference_expand(shrunk.cpu(), lora_b.cpu(), layout, y.cpu())
    lora_expand(shrunk, lora_b, segments, y)
    assert_close(y, expected, dtype)
    adapted = {row for start, stop, slot in layout if slot >= 0 for row in range(start, stop)}
    untouched = [row for row in range(rows) if row not in adapted]
    assert torch.equal(y[untouched].cpu(), expected[untouched].to(dtype))  # bit for bit: never written


def test_shards_of_a_packed_projection_and_ranks_past_one_tile():
    """As the model calls them: a float32 shrink of every shard's ranks at once (rank 72 > one 64-rank tile), then
    one expand per shard from its columns of the shrunk rows into its columns of the packed output."""
    gen = torch.Generator().manual_seed(1)
    layout = [(0, 17, 0), (17, 18, -1), (18, 19, 1)]
    rows, in_features, shard_rank, shard_sizes = 19, 64, 24, (48, 16, 16)  # q, k, v
    x = torch.randn(rows, in_features, generator=gen).to(DEVICE)
    lora_a = (0.1 * torch.randn(2, 3 * shard_rank, in_features, generator=gen)).to(DEVICE)
    segments = Segments.of(layout, DEVICE)
    shrunk = lora_shrink(x, lora_a, segments, out=torch.empty(rows, 3 * shard_rank, device=DEVICE))
    output = torch.randn(rows, sum(shard_sizes), generator=gen).to(DEVICE)
    expected = output.double().cpu()
    first_column = 0
    for shard, size in enumerate(shard_sizes):
        ranks, columns = slice(shard * shard_rank, (shard + 1) * shard_rank), slice(first_column, first_column + size)
        lora_b = (0.1 * torch.randn(2, size, shard_rank, generator=gen)).to(DEVICE)
        expected[:, columns] = reference_expand(
            reference_shrink(x.cpu(), lora_a.cpu(), layout)[:, ranks].float(), lora_b.cpu(), layout,
            expected[:, columns])
        lora_expand(shrunk[:, ranks], lora_b, segments, output[:, columns])
        first_column += size
    assert_close(output, expected, torch.float32)


def test_segments_keep_their_spans_and_bad_shapes_are_refused():
    segments = Segments.of([(0, 5, 1), (5, 6, -1), (8, 40, 0)], DEVICE)
    assert segments.starts.tolist() == [0, 5, 8] and segments.lengths.tolist() == [5, 1, 32]
    assert segments.slots.tolist() == [1, -1, 0] and segments.max_length == 32 and len(segments) == 3
    assert len(Segments.of([], DEVICE)) == 0
    x, lora_a = torch.zeros(4, 8, device=DEVICE), torch.zeros(2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="8 features"):
        lora_shrink(x, lora_a, segments)
    with pytest.raises(ValueError, match="does not map"):
        lora_expand(torch.zeros(4, 3, device=DEVICE), torch.zeros(2, 8, 4, device=DEVICE), segments,
                    torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        lora_shrink(torch.zeros(8, 4, device=DEVICE).T, torch.zeros(2, 4, 4, device=DEVICE), segments)
