"""bench/kv_speed.py's worker process and table on SmolLM2, so the script keeps working as the API under it changes
(its figures are the bench's business, not this test's)."""

from __future__ import annotations

from bench.kv_speed import PEERS, FormatWorker, table


def test_a_format_worker_measures_decode_after_a_context() -> None:
    worker = FormatWorker("int8", 128)
    try:
        assert worker.decode_tok_s(40, 4) > 0
        assert worker.decode_tok_s(40, 4) > 0  # the same prompt again: a prefix hit
    finally:
        worker.close()
    assert worker.process.returncode == 0


def test_table_gives_ratios_to_float32_and_the_best_peer() -> None:
    peer_a, peer_b, peer_c = PEERS
    medians = {"float32": {128: 40.0}, "int8": {128: 60.0}, peer_a: {128: 50.0}, peer_b: {128: 30.0},
               peer_c: {128: 20.0}}
    lines = table(medians, [128]).splitlines()
    assert "| int8 / float32 | 1.50x |" in lines
    assert "| int8 / best llama-bench | 1.20x |" in lines
