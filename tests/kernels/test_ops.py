"""AttentionOps: the backend chosen once, at construction, and kept whatever the environment does later."""

from types import SimpleNamespace

import pytest
import torch

from pagegate.kernels import BACKEND_ENV, AttentionOps, api, cpu_paged, dispatch, reference

from .paged_cases import MIXED_BATCH, assert_close, dense_attention, heat, make_batch, poisoned_like, slots_of

CPU = torch.device("cpu")
SMALL_BATCH = [(17, 1), (33, 1), (20, 20), (40, 7)]  # decodes and prefills, small enough for the interpreter


def spy(monkeypatch, module, name="paged_attention") -> list[str]:
    """Record each call of module.<name> (still running it); a built AttentionOps calls through the module."""
    calls: list[str] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append(name) or real(*args, **kwargs))
    return calls


def attend(ops, batch, sliding_window=None, softcap=None):
    """ops.paged_attention on `batch` into a NaN-poisoned buffer."""
    out = poisoned_like(batch.query)
    result = ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                 batch.query_start_loc, batch.scale, sliding_window, softcap=softcap, out=out)
    assert result is out
    return out


def refuse_lookups(monkeypatch) -> None:
    """Make every backend lookup raise: the environment, the backend choice, imports, the extension."""
    def refuse(*args, **kwargs):
        raise AssertionError("a built AttentionOps looked its backend up again")

    for module, name in [(dispatch, "requested_backend"), (dispatch, "cpu_kernel"), (api, "requested_backend"),
                         (api, "resolve_backend"), (api, "fused_cpu_kernel")]:
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setattr(api, "importlib", SimpleNamespace(import_module=refuse))


def test_cpu_auto_runs_the_fused_kernel_for_float32_only(monkeypatch):
    ops = AttentionOps(CPU)
    assert ops.backend == "reference" and repr(ops) == "AttentionOps(backend='reference', fused_cpu=True)"
    fused, torch_path = spy(monkeypatch, cpu_paged), spy(monkeypatch, reference)
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    assert_close(attend(ops, batch, 5), dense_attention(batch, 5), torch.float32)
    assert (fused, torch_path) == (["paged_attention"], [])
    half = make_batch(MIXED_BATCH, 4, 2, 64, torch.float16)  # the kernel's dtype check stays per call
    assert_close(attend(ops, half), dense_attention(half), torch.float16)
    assert (fused, torch_path) == (["paged_attention"], ["paged_attention"])


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_cpu_reference_keeps_the_torch_path(monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv(BACKEND_ENV, "reference")
    ops = AttentionOps("cpu", "reference" if how == "argument" else None)
    assert repr(ops) == "AttentionOps(backend='reference', fused_cpu=False)"
    fused, torch_path = spy(monkeypatch, cpu_paged), spy(monkeypatch, reference)
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    assert_close(attend(ops, batch), dense_attention(batch), torch.float32)
    assert (fused, torch_path) == ([], ["paged_attention"])


def test_a_built_ops_ignores_later_environment_changes(monkeypatch):
    auto = AttentionOps(CPU)
    monkeypatch.setenv(BACKEND_ENV, "reference")
    forced = AttentionOps(CPU)
    monkeypatch.setenv(BACKEND_ENV, "auto")  # the opposite of what each was built under
    refuse_lookups(monkeypatch)
    fused, torch_path = spy(monkeypatch, cpu_paged), spy(monkeypatch, reference)
    writes = spy(monkeypatch, reference, "write_kv")
    fused_writes = spy(monkeypatch, cpu_paged, "write_kv")
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    expected = dense_attention(batch)
    for ops in (auto, forced):
        ops.write_kv(batch.query[:1, :2], batch.query[:1, :2], batch.k_cache.clone(), batch.v_cache.clone(),
                     torch.tensor([-1]))
        assert_close(attend(ops, batch), expected, torch.float32)
    assert (fused, torch_path) == (["paged_attention"], ["paged_attention"])
    assert (fused_writes, writes) == (["write_kv"], ["write_kv"])


def test_module_functions_still_choose_per_call(monkeypatch):
    fused = spy(monkeypatch, cpu_paged)
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    for env, runs in (("reference", 0), ("auto", 1)):
        monkeypatch.setenv(BACKEND_ENV, env)
        api.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                            batch.query_start_loc, batch.scale, out=poisoned_like(batch.query))
        assert len(fused) == runs


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_softcap_reaches_every_cpu_path(backend, dtype):
    # auto: the fused kernel for float32, the torch path for float16; reference: always the torch path
    ops = AttentionOps(CPU, backend)
    batch = heat(make_batch(MIXED_BATCH, 4, 2, 64, dtype))
    for window in (None, 5):
        assert_close(attend(ops, batch, window, 5.0), dense_attention(batch, window, 5.0), dtype)
    assert torch.equal(attend(ops, batch, softcap=0.0), attend(ops, batch))


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_negative_softcap_is_refused(backend):
    batch = make_batch(MIXED_BATCH, 4, 2, 64)
    with pytest.raises(ValueError, match="softcap"):
        attend(AttentionOps(CPU, backend), batch, softcap=-30.0)


def test_unknown_backend_is_refused_when_built(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cutlass")
    with pytest.raises(ValueError, match="cutlass"):
        AttentionOps(CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton_ops_agree_with_the_reference(monkeypatch, dtype):
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from pagegate.kernels import triton_ops, triton_write

    # conftest sets TRITON_INTERPRET=1 without a GPU; with one the kernels were compiled for it
    device = "cpu" if isinstance(triton_write._write_kv_kernel, InterpretedFunction) else "cuda"
    ops, expected_ops = AttentionOps(device, "triton"), AttentionOps(device, "reference")
    assert repr(ops) == "AttentionOps(backend='triton', fused_cpu=False)"
    monkeypatch.setenv(BACKEND_ENV, "reference")
    refuse_lookups(monkeypatch)
    launches, writes = spy(monkeypatch, triton_ops), spy(monkeypatch, triton_ops, "write_kv")
    batch = make_batch(SMALL_BATCH, 2, 1, 32, dtype, seed=3, device=device)
    caches = (torch.full_like(batch.k_cache, float("nan")), torch.full_like(batch.v_cache, float("nan")))
    for b, (keys, values) in enumerate(zip(batch.keys, batch.values, strict=True)):
        slots = slots_of(batch.block_tables[b], torch.arange(len(keys), device=device), batch.k_cache.shape[1])
        ops.write_kv(keys.to(device), values.to(device), *caches, slots)
    for written, made in zip(caches, (batch.k_cache, batch.v_cache), strict=True):
        assert torch.equal(written.isnan(), made.isnan()) and torch.equal(written.nan_to_num(), made.nan_to_num())
    batch.k_cache, batch.v_cache = caches
    out = attend(ops, batch, 9)
    assert (launches, writes) == (["paged_attention"], ["write_kv"] * len(SMALL_BATCH))
    assert_close(out, dense_attention(batch, 9), dtype)
    assert_close(out, attend(expected_ops, batch, 9).double(), dtype)
    capped = attend(ops, heat(batch), 9, 5.0)
    assert_close(capped, dense_attention(batch, 9, 5.0), dtype)
    assert_close(capped, attend(expected_ops, batch, 9, 5.0).double(), dtype)
