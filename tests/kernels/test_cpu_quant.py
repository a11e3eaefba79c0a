"""The quantized matmuls (pagegate.kernels.cpu_quant) against gguf's own dequantization, in float64: the
exact one (`matmul`) and llama.cpp's arithmetic (`matmul_q8`: activations in Q8, integer dot products) on
every instruction set this CPU has, the portable C included."""

from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.kernels import cpu_decode, cpu_quant, dispatch, quant
from pagegate.kernels.quant import FUSED_MAX_ROWS, linear, quantized_matmul

K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # 256 weights a super-block; gguf-py decodes them but cannot encode
INTEGER = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, *K_QUANTS]
TYPES = [Q.F32, Q.F16, Q.BF16, *INTEGER]
HALF_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of a super-block's float16 scales
ISAS = dispatch.integer_isas()


def quantized(qtype: Q, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, the float32 weights they stand for) of a random [n, k] weight; K-quants as random bytes
    with float16 scales of a trained model's size."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        blocks = rng.integers(0, 256, (n, k // 256, cpu_quant.BLOCK_BYTES[qtype]), dtype=np.uint8)
        for at in HALF_SCALES[qtype]:
            blocks[:, :, at:at + 2] = rng.uniform(0.002, 0.02, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
        blocks = blocks.reshape(n, -1)
    else:
        blocks = quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    dequantized = torch.from_numpy(dequantize(blocks, qtype).astype(np.float32))
    return torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8)), dequantized


def on_every_isa_alone_and_batched(matmul: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], x: torch.Tensor,
                                   layouts: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """matmul(x, weights, kind) of each layout on every instruction set, the whole batch and row by row."""
    results = []
    try:
        for isa in ISAS:
            assert dispatch.set_integer_isa(isa)
            for weights, kind in layouts:
                results.append(matmul(x, weights, kind))
                results.append(torch.cat([matmul(x[i:i + 1], weights, kind) for i in range(len(x))]))
    finally:
        dispatch.set_integer_isa(ISAS[0])
    return results


def q8(x: torch.Tensor) -> torch.Tensor:
    """x rounded as matmul_q8 rounds it: per 32 values, int8 steps of d = max|x| / 127 (ties to even), each
    value times the float32 1 / d (a division instead moves a near-tie by one step)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    steps = (blocks * torch.where(scale > 0, 1 / scale, 0)).round()
    return (steps.double() * scale.double()).reshape(x.shape)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_is_exactly_ggufs(qtype: Q) -> None:
    k = 512 if qtype in K_QUANTS else 96
    blocks, weights = quantized(qtype, 37, k)
    assert torch.equal(cpu_quant.dequantize(blocks, int(qtype), k), weights)
    rows = torch.tensor([5, 0, 36, 5])
    assert torch.equal(cpu_quant.dequantize(blocks, int(qtype), k, rows), weights[rows])


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(TYPES), m=st.integers(1, 2 * FUSED_MAX_ROWS + 3), n=st.integers(1, 70),
       blocks_per_row=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_matmul_matches_the_dequantized_weights(qtype: Q, m: int, n: int, blocks_per_row: int, seed: int) -> None:
    """Both paths (fused decode for few rows, float tiles + GEMM for many) give x @ W.T."""
    k = (256 if qtype in K_QUANTS else 32) * blocks_per_row
    blocks, weights = quantized(qtype, n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    expected = (x.double() @ weights.double().t()).float()
    tolerance = 1e-6 * float((x.double().abs() @ weights.double().abs().t()).max())  # float32 sums of k terms
    torch.testing.assert_close(quantized_matmul(x, blocks, int(qtype)), expected, rtol=1e-5, atol=tolerance)
    torch.testing.assert_close(cpu_quant.matmul(x, blocks, int(qtype)), expected, rtol=1e-5, atol=tolerance)


def test_bfloat16_inputs_come_back_in_bfloat16() -> None:
    blocks, weights = quantized(Q.Q4_1, 8, 64)
    x = torch.randn(3, 64).bfloat16()
    out = quantized_matmul(x, blocks, int(Q.Q4_1))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() @ weights.t(), rtol=1e-2, atol=1e-2)


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(INTEGER), m=st.integers(1, 20), n=st.integers(1, 11), blocks_per_row=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_matmul_q8_is_q8_activations_times_the_exact_weights(qtype: Q, m: int, n: int, blocks_per_row: int,
                                                            seed: int) -> None:
    """The integer sums are exact: on every instruction set the result is the float64 product of the rounded
    activations with the dequantized weights, but for float32 roundings of the scales."""
    k = (256 if qtype in K_QUANTS else 32) * blocks_per_row
    blocks, weights = quantized(qtype, n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    expected = (q8(x) @ weights.double().t()).float()
    tolerance = 1e-5 * float((q8(x).abs() @ weights.double().abs().t()).max())
    try:
        for isa in ISAS:
            assert dispatch.set_integer_isa(isa)
            torch.testing.assert_close(cpu_quant.matmul_q8(x, blocks, int(qtype)), expected, rtol=0, atol=tolerance)
    finally:
        dispatch.set_integer_isa(ISAS[0])


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(INTEGER), m=st.integers(1, 40), n=st.integers(1, 27), blocks_per_row=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_nor_the_kernel(qtype: Q, m: int, n: int,
                                                                         blocks_per_row: int, seed: int) -> None:
    """Batch invariance at its root: each row of matmul_q8 is the same bits alone, in a batch, with its weight rows
    interleaved or as the file has them, and on every instruction set (one canonical order of float operations)."""
    k = (256 if qtype in K_QUANTS else 32) * blocks_per_row
    blocks, _ = quantized(qtype, n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    layouts = [(blocks, int(qtype)), quant.interleaved(blocks, int(qtype))]  # rows eight at a time too
    results = on_every_isa_alone_and_batched(cpu_quant.matmul_q8, x, layouts)
    for other in results[1:]:
        assert torch.equal(other, results[0])


@settings(max_examples=30, deadline=None)
@given(qtype=st.sampled_from([Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, *K_QUANTS]), n=st.integers(1, 27),
       blocks_per_row=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_interleaved_rows_are_the_files_bytes_permuted(qtype: Q, n: int, blocks_per_row: int, seed: int) -> None:
    """A matrix repacked eight rows at a time keeps its size and bytes, its last n % 8 rows in place, and reads back
    (each row, the whole, an embedding lookup) as the very weights of the file's layout."""
    k = (256 if qtype in K_QUANTS else 32) * blocks_per_row
    blocks, weights = quantized(qtype, n, k, seed)
    repacked, kind = quant.interleaved(blocks, int(qtype))
    assert kind == (int(qtype) + cpu_quant.X8 if n >= 8 else int(qtype))
    assert repacked.shape == blocks.shape
    assert torch.equal(repacked.flatten().sort().values, blocks.flatten().sort().values)
    assert torch.equal(repacked[n // 8 * 8:], blocks[n // 8 * 8:])
    assert torch.equal(cpu_quant.dequantize(repacked, kind, k), weights)
    rows = torch.randint(0, n, (5,), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(cpu_quant.dequantize(repacked, kind, k, rows), weights[rows])
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(cpu_quant.matmul(x, repacked, kind), cpu_quant.matmul(x, blocks, int(qtype)))


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(TYPES), sizes=st.lists(st.integers(1, 13), min_size=1, max_size=3),
       blocks_per_row=st.integers(1, 2), threads=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_interleaved_parts_in_an_order_are_their_rows_concatenated_and_reordered(
        qtype: Q, sizes: list[int], blocks_per_row: int, threads: int, seed: int) -> None:
    """Shards repacked as one matrix, its rows in any order, read where they lie (read-only, as a file's mapping):
    the bytes of repacking their concatenation so reordered, on any number of threads, into the array `empty`
    gives."""
    k = (256 if qtype in K_QUANTS else 32) * blocks_per_row
    parts = [quantized(qtype, n, k, seed + i)[0].numpy() for i, n in enumerate(sizes)]
    for part in parts:
        part.flags.writeable = False
    order = np.random.default_rng(seed).permutation(sum(sizes))
    expected, kind = cpu_quant.interleaved(np.concatenate(parts)[order], int(qtype))
    given_out: list[np.ndarray] = []

    def empty(shape: tuple[int, ...]) -> np.ndarray:
        given_out.append(np.empty(shape, np.uint8))
        return given_out[-1]

    repacked, found_kind = cpu_quant.interleaved(parts, int(qtype), order, threads, empty)
    assert found_kind == kind and np.array_equal(repacked, expected)
    assert [id(array) for array in given_out] == ([id(repacked)] if kind == int(qtype) + cpu_quant.X8 else [])


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q6_K], ids=lambda q: q.name)
def test_interleaved_rows_serve_the_torch_path_tile_by_tile(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many input rows take the weight in tiles of rows (dequantized, then a GEMM): a tile of an interleaved matrix
    starts and ends on whole groups of eight, whatever its size asks for."""
    k = 256 if qtype in K_QUANTS else 64
    blocks, weights = quantized(qtype, 29, k)
    repacked, kind = quant.interleaved(blocks, int(qtype))
    monkeypatch.setattr(quant, "TILE_BYTES", 4 * k * 3)  # three rows a tile, were it not held to eight
    x = torch.randn(FUSED_MAX_ROWS + 3, k, generator=torch.Generator().manual_seed(0))
    expected = (x.double() @ weights.double().t()).float()  # float32 sums of 256 terms differ by order: ~1e-4 here
    torch.testing.assert_close(quantized_matmul(x, repacked, kind), expected, rtol=1e-4, atol=1e-3)


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from([quant.F32, quant.F16, quant.BF16]), m=st.integers(1, 30), n=st.integers(1, 100),
       k=st.integers(1, 90), seed=st.integers(0, 2**16))
def test_float_panels_are_the_weights_permuted_and_each_output_one_order(qtype: int, m: int, n: int, k: int,
                                                                         seed: int) -> None:
    """F32, F16 and BF16 weights in panels (cpu_panels.h): the same values, permuted, read back exactly (the whole, an
    embedding lookup); every output one chain of multiply-adds over k, so the same bits alone, in a batch and on
    every instruction set, and the product of the weights."""
    generator = torch.Generator().manual_seed(seed)
    weights, x = torch.randn(n, k, generator=generator), torch.randn(m, k, generator=generator)
    stored = weights.to({quant.F32: torch.float32, quant.F16: torch.float16, quant.BF16: torch.bfloat16}[qtype])
    weights = stored.float()
    paneled, kind = quant.panels(stored.view(torch.uint8), qtype)
    assert kind == {quant.F32: quant.F32_PANELS, quant.F16: quant.F16_PANELS, quant.BF16: quant.BF16_PANELS}[qtype]
    assert paneled.shape == (n, k * stored.element_size())
    assert torch.equal(paneled.view(stored.dtype).flatten().sort().values, stored.flatten().sort().values)
    assert torch.equal(cpu_quant.dequantize(paneled, kind, k), weights)
    rows = torch.randint(0, n, (5,), generator=generator)
    assert torch.equal(cpu_quant.dequantize(paneled, kind, k, rows), weights[rows])
    results = on_every_isa_alone_and_batched(cpu_quant.matmul, x, [(paneled, kind)])
    for other in results[1:]:
        assert torch.equal(other, results[0])
    torch.testing.assert_close(results[0], (x.double() @ weights.double().t()).float(), rtol=1e-4, atol=1e-4)


def test_float_panels_serve_the_torch_path_tile_by_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many input rows take panels in tiles of whole panels (dequantized, then a GEMM), the last one narrower."""
    weights = torch.randn(70, 48, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(quant, "TILE_BYTES", 4 * 48 * 3)  # three rows a tile, were it not held to a panel
    x = torch.randn(FUSED_MAX_ROWS + 3, 48, generator=torch.Generator().manual_seed(1))
    paneled, kind = quant.panels(weights.view(torch.uint8), quant.F32)
    torch.testing.assert_close(quantized_matmul(x, paneled, kind), x @ weights.t())


def test_the_fastest_instruction_set_is_chosen() -> None:
    assert dispatch.integer_isa() == ISAS[0]
    assert not dispatch.set_integer_isa("sse1")
    assert dispatch.integer_isa() == ISAS[0]


def test_every_extension_runs_on_the_instruction_set_set() -> None:
    try:
        for isa in ISAS:
            assert dispatch.set_integer_isa(isa)
            assert cpu_quant._isa() == cpu_decode._isa() == dispatch.integer_isa() == isa
    finally:
        dispatch.set_integer_isa(ISAS[0])


@pytest.mark.parametrize("qtype, k, match", [(Q.Q2_K, 256, "no CPU kernel"), (Q.Q4_1, 48, "multiple of 32"),
                                             (Q.Q8_0, 64, "bytes a row")])
def test_bad_blocks_are_refused(qtype: Q, k: int, match: str) -> None:
    blocks = torch.zeros(4, 40, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        cpu_quant.matmul(torch.zeros(1, k), blocks, int(qtype))
    with pytest.raises(IndexError):
        cpu_quant.dequantize(quantized(Q.Q8_0, 4, 32)[0], int(Q.Q8_0), 32, torch.tensor([4]))


@pytest.mark.parametrize("rows", [1, FUSED_MAX_ROWS, FUSED_MAX_ROWS + 1])
def test_linear_agrees_with_torch_on_both_paths(rows: int) -> None:
    weight, bias, x = torch.randn(70, 96), torch.randn(70), torch.randn(rows, 96)
    torch.testing.assert_close(linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
    odd = torch.randn(5, 40)  # not whole blocks of 32: torch's path
    torch.testing.assert_close(linear(x[:, :40], odd), x[:, :40] @ odd.t())
