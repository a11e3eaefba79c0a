"""The C sampler (pagegate.kernels.cpu_sample) against its definition, written in float64 numpy: greedy is the
argmax, logprobs are log_softmax with the best alternatives, a draw is the inverse CDF of the kept tokens at the
row's uniform, and no row's result depends on the rows beside it or the thread count."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.kernels import cpu_sample


def run(logits: np.ndarray, temperature, top_k=0, top_p=1.0, min_p=0.0, uniform=0.5, logprobs=-1, width: int = 0,
        threads: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rows = logits.shape[0]

    def column(value, dtype):
        return np.broadcast_to(np.asarray(value, dtype), (rows,)).copy()

    tokens, chosen = np.empty(rows, np.int32), np.empty(rows, np.float32)
    top_ids, top_values = np.empty((rows, width), np.int32), np.empty((rows, width), np.float32)
    cpu_sample.sample(np.ascontiguousarray(logits, np.float32), column(temperature, np.float32),
                      column(top_k, np.int32), column(top_p, np.float32), column(min_p, np.float32),
                      column(uniform, np.float32), column(logprobs, np.int32), tokens, chosen, top_ids, top_values,
                      threads)
    return tokens, chosen, top_ids, top_values


def kept_in_order(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> tuple:
    """(ids, probabilities) the filters keep, in the order a draw walks them (vLLM's filter order); the parameters
    as the kernel gets them, in float32 (a top_p just under 1 is 1 there: off)."""
    temperature, top_p, min_p = (float(np.float32(v)) for v in (temperature, top_p, min_p))
    e = np.exp((x.astype(np.float64) - x.max()) / temperature)
    ids = np.arange(len(x))[e >= min_p]
    if not (0 < top_k < len(x)) and top_p >= 1:
        return ids, e[ids]
    ids = ids[np.lexsort((ids, -x[ids]))]
    if 0 < top_k < len(x):
        ids = ids[:top_k]
    if top_p < 1:
        before = np.cumsum(e[ids]) - e[ids]
        ids = ids[(before < top_p * e[ids].sum()) | (np.arange(len(ids)) == 0)]
    return ids, e[ids]


def test_greedy_is_the_first_argmax() -> None:
    logits = np.random.default_rng(0).normal(size=(5, 1000)).astype(np.float32)
    logits[3, [7, 500]] = 100.0  # a tie: the lower id
    assert run(logits, 0.0)[0].tolist() == logits.argmax(-1).tolist()


def test_logprobs_are_log_softmax_with_the_best_alternatives() -> None:
    logits = np.random.default_rng(1).normal(size=(4, 3000)).astype(np.float32) * 3
    tokens, chosen, top_ids, top_values = run(logits, 0.0, logprobs=[0, 1, 5, 20], width=20)
    x = logits.astype(np.float64)
    reference = x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    np.testing.assert_allclose(chosen, reference[np.arange(4), tokens], atol=1e-5)
    for row, want in enumerate([0, 1, 5, 20]):
        best = np.argsort(-x[row], kind="stable")[:want]
        assert top_ids[row, :want].tolist() == best.tolist() and (top_ids[row, want:] == -1).all()
        np.testing.assert_allclose(top_values[row, :want], reference[row, best], atol=1e-5)


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 300), st.integers(0, 2**16), st.floats(0.2, 2.0), st.integers(0, 20), st.floats(0.05, 1.0),
       st.floats(0.0, 0.5), st.floats(0.0, 0.999))
def test_a_draw_is_the_inverse_cdf_of_the_kept_tokens(vocab: int, seed: int, temperature: float, top_k: int,
                                                      top_p: float, min_p: float, u: float) -> None:
    x = np.random.default_rng(seed).normal(size=vocab).astype(np.float32) * 2
    token = int(run(x[None], temperature, top_k, top_p, min_p, u)[0][0])
    ids, weights = kept_in_order(x, temperature, top_k, top_p, min_p)
    cdf = np.cumsum(weights) / weights.sum()
    at = int(np.searchsorted(cdf, u, side="right"))
    # the float32 kernel and this float64 reference may part only where u falls on a step of the CDF
    near = np.abs(cdf - u) < 1e-4
    assert token == ids[min(at, len(ids) - 1)] or near.any()


def test_a_large_vocabulary_sorts_only_the_candidates_and_keeps_the_nucleus() -> None:
    x = np.random.default_rng(2).normal(size=128256).astype(np.float32) * 4
    for u in (0.0, 0.3, 0.9, 0.9999):
        token = int(run(x[None], 0.8, 0, 0.9, 0.0, u)[0][0])
        ids, weights = kept_in_order(x, 0.8, 0, 0.9, 0.0)
        assert token == ids[min(int(np.searchsorted(np.cumsum(weights) / weights.sum(), u, side="right")),
                                len(ids) - 1)]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_draws_the_same_alone_and_in_any_batch(threads: int) -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(9, 5000)).astype(np.float32)
    params = dict(temperature=rng.uniform(0.3, 1.5, 9), top_k=rng.integers(0, 50, 9), top_p=rng.uniform(0.5, 1, 9),
                  min_p=rng.uniform(0, 0.2, 9), uniform=rng.uniform(0, 1, 9), logprobs=5, width=5)
    batched = run(logits, threads=threads, **params)
    for row in range(9):
        alone = run(logits[row:row + 1], threads=1,
                    **{k: v[row] if isinstance(v, np.ndarray) else v for k, v in params.items()})
        for whole, single in zip(batched, alone, strict=True):
            assert np.array_equal(whole[row], single[0])


def test_masked_tokens_and_an_overflowing_temperature_stay_out() -> None:
    x = np.full((1, 8), -np.inf, np.float32)
    x[0, [2, 5]] = 0.0
    for u in (0.0, 0.49, 0.51, 0.999):
        assert run(x, np.finfo(np.float32).max, uniform=u)[0][0] in (2, 5)
        assert run(x, 1.0, top_p=0.5, uniform=u)[0][0] == 2


def test_arguments_of_another_length_are_refused() -> None:
    with pytest.raises(ValueError, match="one entry per logits row"):
        cpu_sample.sample(np.zeros((2, 4), np.float32), *(np.zeros(1, np.float32),) * 1, np.zeros(2, np.int32),
                          *(np.zeros(2, np.float32),) * 3, np.zeros(2, np.int32), np.empty(2, np.int32),
                          np.empty(2, np.float32), np.empty((2, 0), np.int32), np.empty((2, 0), np.float32), 1)
