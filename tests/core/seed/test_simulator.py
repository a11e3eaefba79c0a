import json

import numpy as np

from pagegate.core.seed.simulator import GIB, Trace, compare, main, seed_trace, simulate_contiguous


def test_paged_holds_far_more_sequences_on_the_seed_workload():
    result = compare(seed_trace(6000, seed=1))
    cont, paged = result["contiguous"], result["paged"]
    assert cont["completed"] == paged["completed"] == 6000
    assert cont["peak_concurrent"] == 20 * GIB // (2048 * 16 * 1024)  # 640 max-length regions
    assert result["capacity_ratio"] >= 3.3
    assert paged["waste_per_seq_tokens"] <= 16  # at most one partly filled page per sequence
    assert cont["internal_waste_bytes"] > 10 * paged["internal_waste_bytes"]


def test_contiguous_first_fit_sees_external_fragmentation():
    # 3 small requests then a large one: after the middle one leaves, the hole is too small
    trace = Trace(arrival=np.array([0, 0, 0, 1]), prompt_len=np.array([1, 1, 1, 1]),
                  output_len=np.array([50, 1, 50, 10]), max_len=np.array([4, 4, 4, 6]))
    result = simulate_contiguous(trace, total_bytes=12, bytes_per_token=1)
    assert result.completed == 4 and result.external_waste_bytes > 0


def test_cli_prints_json(capsys):
    assert main(["--requests", "300", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"contiguous", "paged", "capacity_ratio"}
