"""lm-evaluation-harness scores a task through `pagegate serve` (local-completions: echo + logprobs) exactly as
its own transformers backend does on the same model: the same metrics, every choice's loglikelihood within 1e-4."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.lm_eval_match import compare
from pagegate.engine.loading.loader import DEFAULT_MODEL

pytest.importorskip("lm_eval")


def test_lm_eval_scores_the_same_through_the_server(tmp_path: Path) -> None:
    scores = compare(DEFAULT_MODEL, items=12, work=tmp_path)
    served, hf = scores["served"], scores["hf"]
    assert served.metrics == pytest.approx(hf.metrics)
    assert len(served.loglikelihoods) == 12
    for ours, theirs in zip(served.loglikelihoods, hf.loglikelihoods, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-4)
