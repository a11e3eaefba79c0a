"""bench/kv_quality.py's helpers on the embedded default model and a few lines of the bench's text, so the script
keeps working as the API under it changes (its figures are the bench's business, not this test's)."""

from __future__ import annotations

import math

import pytest

from bench.kv_quality import (
    TEXT,
    bucket_perplexities,
    cut_prompts,
    make_llm,
    run,
    table,
    text_tokens,
    windows,
)


def test_windows_prompts_and_buckets() -> None:
    ids = list(range(10))
    assert windows(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a lone last token scores nothing
    assert cut_prompts(ids, [3, 20], places=2, decode=2) == [[0, 1, 2], [5, 6, 7]]  # 20 tokens do not fit
    buckets = bucket_perplexities([(1, 0.0), (2, 2.0), (5, 1.0)], 4)
    assert buckets == [(1.5, pytest.approx(math.e)), (5.0, pytest.approx(math.e))]


def test_run_on_the_embedded_model() -> None:
    reference = make_llm(None, "float32", 256)
    ids = text_tokens(reference, TEXT, 160)
    assert len(ids) == 160
    results = run(None, reference, ["float32", "int8"], ids, window=96, bucket=32, contexts=[48], places=2,
                  decode=6, max_model_len=256)
    base, int8 = results["float32"], results["int8"]
    assert base.ratio == 1.0 and math.isfinite(base.ppl) and base.ppl > 1
    assert len(base.buckets) == len(base.bucket_positions) == 3  # window positions 1..95
    # float32's own greedy choices are float32's best tokens (decode and prompt scoring agree)
    assert [len(g) for g in base.gaps] == [6, 6] and base.max_gap < 1e-3 and base.diverged_at == [None, None]
    assert 0.9 < int8.ratio < 1.1 and all(len(g) == 6 and min(g) >= 0 for g in int8.gaps)
    assert "int8" in table(results)
