"""The Triton kernels on every KV page format (pagegate/kernels/kv_format.py) against the reference.

write_kv must store the bytes reference.write_kv stores (values, two a byte for int4, and for the scaled formats
each row's float16 scale in its last two bytes). Attention runs on pages the reference wrote and must match the
reference and a float64 oracle over the same stored values: both dequantize the same bytes, so only arithmetic
separates them, and the outputs go to float32 buffers so the comparison sees that arithmetic rather than the
output's rounding. The kernels are called directly, not through AttentionOps: int4 rows hold whatever they were
given (AttentionOps rotates what it writes and the queries, and rotates the output back; the last test checks that
the Triton backend fits that path).

Without a GPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1): shapes stay small.
"""

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from pagegate.kernels import (
    AttentionOps,
    reference,
    triton_common,
    triton_decode,
    triton_ops,
    triton_write,
)
from pagegate.kernels.kv_format import FORMATS, KVFormat, as_bytes, dequantize_rows, resolve_format

from .paged_cases import PagedBatch, dense_attention, heat, make_batch, slots_of

INTERPRETED = isinstance(triton_write._write_kv_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():  # a misconfigured run must fail, not pass silently
    pytest.fail("no CUDA device, and the kernels were imported without TRITON_INTERPRET=1 "
                "(tests/kernels/conftest.py sets it)", pytrace=False)

# queries in the dtype a model on a GPU has for them: its own for float pages, float16 for scaled ones
# (whose dots run in the query's dtype; float32 queries have their own test)
QUERY_DTYPES = {name: torch.float16 if fmt.scaled else fmt.dtype for name, fmt in FORMATS.items()}
SCALED = [name for name, fmt in FORMATS.items() if fmt.scaled]
MIXED = [(17, 1), (33, 1), (24, 24), (45, 13)]  # decodes, a whole prefill, a chunk after a prefix
DECODE = [(1, 1), (16, 1), (32, 1), (33, 1), (65, 1)]


def poisoned_cache(kv_format: KVFormat, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """A cache of the format whose every byte is 0xFF: NaN in every float format and a NaN scale in every
    scaled row, so a slot a kernel should not touch (or forgets to write) shows."""
    cache = kv_format.empty(num_blocks, block_size, num_kv_heads, head_dim)
    cache.view(torch.uint8).fill_(255)
    return cache


def stored_values(cache: torch.Tensor, slots: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The values [len(slots), Hkv, D] the cache holds at `slots`, in float64."""
    rows = as_bytes(cache).view(-1, *cache.shape[2:])[slots.to(cache.device)].cpu().view(cache.dtype)
    return dequantize_rows(rows, head_dim, torch.float64)


def format_batch(shape: list[tuple[int, int]], heads: tuple[int, int], name: str, query_dtype: torch.dtype,
                 block_size: int = 16, head_dim: int = 64, seed: int = 0) -> PagedBatch:
    """A make_batch batch whose pages are in format `name`, written by the reference (rows at magnitudes from
    1/8 to 8, so their scales differ); keys and values become the float64 values the pages hold."""
    kv_format = FORMATS[name]
    batch = make_batch(shape, *heads, head_dim, query_dtype, block_size=block_size, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    caches = [poisoned_cache(kv_format, batch.k_cache.shape[0], block_size, heads[1], head_dim) for _ in range(2)]
    keys, values = [], []
    for b, rows in enumerate(zip(batch.keys, batch.values, strict=True)):
        gains = [2.0 ** torch.randint(-3, 4, (len(rows[0]), heads[1], 1), generator=gen) for _ in range(2)]
        slots = slots_of(batch.block_tables[b], torch.arange(len(rows[0])), block_size)
        reference.write_kv(*(r * g.to(r.dtype) for r, g in zip(rows, gains, strict=True)), *caches, slots)
        keys.append(stored_values(caches[0], slots, head_dim))
        values.append(stored_values(caches[1], slots, head_dim))
    batch.keys, batch.values = keys, values
    batch.k_cache, batch.v_cache = (cache.to(DEVICE) for cache in caches)
    for field in ("query", "block_tables", "seq_lens", "query_start_loc"):
        setattr(batch, field, getattr(batch, field).to(DEVICE))
    return batch


def attend(batch: PagedBatch, backend: str, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """The backend's paged_attention into a NaN-filled float32 buffer (a row left unwritten shows)."""
    out = torch.full(batch.query.shape, float("nan"), dtype=torch.float32, device=DEVICE)
    ops = triton_ops if backend == "triton" else reference
    result = ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                 batch.query_start_loc, batch.scale, sliding_window, softcap=softcap, out=out)
    assert result is out
    return out.cpu().double()


def tolerance(name: str, query_dtype: torch.dtype) -> float:
    """Relative to the output's scale: what the dtype the dots run in costs (the probabilities are rounded to
    it before the P.V dot; stored values convert to it exactly). Scaled pages dot in the query's dtype, float
    pages in their own; bfloat16 runs in float32 under the interpreter."""
    compute = query_dtype if FORMATS[name].scaled else FORMATS[name].dtype
    if compute == torch.bfloat16 and not INTERPRETED:
        return 4e-3  # 2**-9 per probability
    if compute == torch.float16:
        return 5e-4  # 2**-12 per probability
    return 2e-5


def check(batch: PagedBatch, name: str, query_dtype: torch.dtype, sliding_window: int | None = None,
          softcap: float | None = None) -> None:
    """Triton against the reference on the same pages, and both against the float64 oracle of the stored values."""
    got = attend(batch, "triton", sliding_window, softcap)
    want = attend(batch, "reference", sliding_window, softcap)
    oracle = dense_attention(batch, sliding_window, softcap)
    assert torch.isfinite(got).all(), "output has NaN/inf"
    scale = oracle.abs().max().item()
    tol = tolerance(name, query_dtype)
    for label, actual, expected, allowed in (("Triton vs reference", got, want, tol),
                                             ("Triton vs oracle", got, oracle, tol),
                                             ("reference vs oracle", want, oracle, 1e-4)):
        err = (actual - expected).abs().max().item()
        assert err <= allowed * scale, f"{label}: max error {err:.3g} > {allowed} x {scale:.3g}"


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(FORMATS))
def test_write_kv_stores_the_reference_bytes(name, key_dtype):
    # the expected bytes come from the reference on the CPU, the definition of every format
    gen = torch.Generator().manual_seed(11)
    num_tokens, num_kv_heads, head_dim, block_size = 16, 3, 64, 16 if key_dtype == torch.float32 else 32
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen)
    fused *= 2.0 ** torch.randint(-12, 13, (num_tokens, 3, num_kv_heads, 1), generator=gen)  # scales far apart
    fused[1] = 0.0  # amax 0: scale 0, values 0
    fused[2, :, 0] = -0.0
    fused[3, :, 1, :5] = 1e-7  # an amax among float16's subnormals
    fused[4, :, 2] = torch.linspace(-1, 1, head_dim) * 1000  # ties and the format's largest value
    fused[5, :, 0, 0] = 3e5  # amax beyond float16 (inf in float16 keys): kept as 65504, the row saturates
    fused = fused.to(key_dtype)
    slots = torch.randperm(4 * block_size, generator=gen)[:num_tokens]
    slots[[0, 9]] = -1  # padding
    caches = [poisoned_cache(FORMATS[name], 4, block_size, num_kv_heads, head_dim) for _ in range(4)]
    # strided views, as from a fused qkv projection
    reference.write_kv(fused[:, 1], fused[:, 2], caches[2], caches[3], slots)
    triton_caches = [cache.to(DEVICE) for cache in caches[:2]]
    triton_write.write_kv(fused[:, 1].to(DEVICE), fused[:, 2].to(DEVICE), *triton_caches, slots.to(DEVICE))
    for got, want in zip(triton_caches, caches[2:], strict=True):
        got, want = got.cpu().view(torch.uint8), want.view(torch.uint8)
        differ = (got != want).nonzero()
        assert not len(differ), f"{len(differ)} bytes differ, first at {differ[:3].tolist()}"


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kind", ["mixed", "decode"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_attention_reads_every_format(name, kind, block_size):
    shape = MIXED if kind == "mixed" else DECODE
    check(format_batch(shape, (4, 2), name, QUERY_DTYPES[name], block_size, seed=1), name, QUERY_DTYPES[name])


@pytest.mark.parametrize("kind", ["mixed", "decode"])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", SCALED)
def test_float32_and_bfloat16_queries_on_scaled_pages(name, query_dtype, kind):
    # float32: IEEE dots, so the Triton kernels and the reference agree to float32 rounding; bfloat16 (a bfloat16
    # model's) dots in bfloat16 on a GPU, in float32 under the interpreter
    shape = MIXED if kind == "mixed" else DECODE
    check(format_batch(shape, (4, 2), name, query_dtype, 32, seed=4), name, query_dtype)


@pytest.mark.parametrize("kind", ["mixed", "decode"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_sliding_window_softcap_gqa8_head_dim_128(name, kind):
    # one KV head for 8 query heads, rows of 128 (+2) elements, hot scores bent by a cap of 5, a window of 7
    query_dtype = QUERY_DTYPES[name]
    shape = [(24, 24), (29, 5)] if kind == "mixed" else DECODE[1:]
    batch = heat(format_batch(shape, (8, 1), name, query_dtype, head_dim=128, seed=2))
    check(batch, name, query_dtype, sliding_window=7, softcap=5.0)


@pytest.mark.parametrize("name", ["int8", "fp8_e5m2", "int4"])
def test_decode_splits_on_scaled_pages(name):
    # the split kernel's partials over scaled pages, merged by the reduction
    seqs = [(700, 1), (260, 1)]
    assert triton_decode.split_length(2, 1, 700, torch.device(DEVICE)) < 700 or DEVICE == "cuda"
    check(format_batch(seqs, (2, 1), name, torch.float16, 32, seed=3), name, torch.float16, sliding_window=300)


def test_layouts_the_kernels_would_misread_are_refused():
    batch = format_batch(DECODE[:2], (2, 1), "int8", torch.float32)
    key = torch.zeros(1, 1, 64, device=DEVICE)
    slot = torch.zeros(1, dtype=torch.long, device=DEVICE)
    float_cache = torch.zeros(batch.k_cache.shape[:-1] + (64,), dtype=torch.float16, device=DEVICE)
    narrow = batch.k_cache[..., :64]  # int8 rows without their scale bytes
    odd_key = torch.zeros(1, 1, 63, device=DEVICE)
    odd_cache = FORMATS["int8"].empty(2, 16, 1, 63, device=DEVICE)  # scales at odd byte offsets
    int4_cache = FORMATS["int4"].empty(2, 16, 1, 64, device=DEVICE)
    key_48 = torch.zeros(1, 1, 48, device=DEVICE)
    int4_48 = torch.zeros(2, 16, 1, 26, dtype=torch.uint8, device=DEVICE)  # int4 rows of head_dim 48
    for call, match in (
            (lambda: triton_write.write_kv(key, key, batch.k_cache, float_cache, slot), "one page format"),
            (lambda: triton_write.write_kv(key, key, narrow, narrow, slot), "rows of 66"),
            (lambda: triton_write.write_kv(odd_key, odd_key, odd_cache, odd_cache, slot), "even"),
            (lambda: triton_write.write_kv(key, key, int4_cache[..., :32], int4_cache[..., :32], slot), "rows of 34"),
            (lambda: triton_write.write_kv(key_48, key_48, int4_48, int4_48, slot), "power-of-two"),
            (lambda: triton_ops.paged_attention(batch.query[:, :, :32], batch.k_cache, batch.v_cache,
                                                batch.block_tables, batch.seq_lens, batch.query_start_loc, 1.0),
             "head_dim 32")):
        with pytest.raises(ValueError, match=match):
            call()


def test_fp8_e4m3_is_refused_below_compute_capability_8_9(monkeypatch):
    # Triton compiles fp8 e4m3 conversions for sm_89+ only; an A100 (8.0) must hear why, not fail in the compiler
    monkeypatch.setattr(triton_common, "_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        triton_common.check_device_format(FORMATS["fp8_e4m3"], "cuda")
    for name in ("int8", "fp8_e5m2", "bfloat16", "int4"):
        triton_common.check_device_format(FORMATS[name], "cuda")
    assert resolve_format("int4", torch.float16, torch.device("cuda")) is FORMATS["int4"]
    monkeypatch.setattr(triton_common, "_capability", lambda device: (9, 0))
    triton_common.check_device_format(FORMATS["fp8_e4m3"], "cuda")


def test_int4_through_attention_ops_matches_the_reference():
    # AttentionOps rotates keys, values and queries for int4 pages and rotates the output back: on the Triton
    # backend the pages get the reference's bytes and the attention the reference's output
    query_dtype = torch.float16
    batch = make_batch([(33, 1), (20, 4)], 4, 2, 64, query_dtype, seed=5)
    ops = {backend: AttentionOps(DEVICE, backend) for backend in ("triton", "reference")}
    caches = {backend: [poisoned_cache(FORMATS["int4"], batch.k_cache.shape[0], 16, 2, 64).to(DEVICE)
                        for _ in range(2)] for backend in ops}
    for b, (keys, values) in enumerate(zip(batch.keys, batch.values, strict=True)):
        slots = slots_of(batch.block_tables[b], torch.arange(len(keys)), 16).to(DEVICE)
        for backend, op in ops.items():
            op.write_kv(keys.to(DEVICE), values.to(DEVICE), *caches[backend], slots)
    for got, want in zip(caches["triton"], caches["reference"], strict=True):
        assert torch.equal(got.cpu(), want.cpu())
    inputs = [t.to(DEVICE) for t in (batch.query, batch.block_tables, batch.seq_lens, batch.query_start_loc)]
    got, want = (op.paged_attention(inputs[0], *caches[backend], *inputs[1:], batch.scale).cpu().double()
                 for backend, op in ops.items())
    assert torch.isfinite(got).all()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2e-3 * scale
