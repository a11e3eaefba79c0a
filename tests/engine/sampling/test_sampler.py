"""Sampler: greedy, seeds, top-k/top-p/min-p, penalties, logit bias, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.engine.errors import InvalidParamError
from pagegate.engine.sampling.draws import Draws
from pagegate.engine.sampling.params import SamplingParams
from pagegate.engine.sampling.processors import apply_logit_bias, apply_penalties
from pagegate.engine.sampling.sampler import LogitBias, Sampler, SamplingRow, choice_seed, make_generator

V = 64
EOS = 3


@pytest.fixture(autouse=True, params=["c", "torch"])
def sampler_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on both paths: the C sampler (rows no processor touches) and torch's (the rest, and CUDA)."""
    monkeypatch.setattr(Sampler, "native", request.param == "c")
    return request.param


def _row(prompt: list[int] = (), output: list[int] = (), generator: Draws | None = None,
         **params: object) -> SamplingRow:
    sampling = SamplingParams(**params)
    return SamplingRow(sampling, list(prompt), list(output), generator, LogitBias.of(sampling.logit_bias, V))


def _logits(batch: int, vocab: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax() -> None:
    logits = _logits(5)
    results = Sampler([EOS])(logits, [_row(temperature=0) for _ in range(5)])
    assert [r.token_id for r in results] == logits.argmax(-1).tolist()


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = _logits(4)
    rows = [_row(temperature=0), _row(temperature=1.0), _row(temperature=0, seed=1), _row(temperature=0.7)]
    results = Sampler([EOS])(logits, rows)
    assert results[0].token_id == logits[0].argmax() and results[2].token_id == logits[2].argmax()


def _seeded_run(seed: int, companions: list[dict], steps: int = 12, sampler_seed: int = 0) -> list[int]:
    """The tokens a seeded row samples over several steps, next to other rows."""
    sampler, generator, tokens = Sampler([EOS], seed=sampler_seed), make_generator(seed), []
    for step in range(steps):
        logits = _logits(1 + len(companions), seed=100 + step, scale=0.5)  # flat: many likely tokens
        rows = [_row(generator=generator, seed=seed, temperature=0.9, top_p=0.95)]
        rows += [_row(generator=make_generator(i) if "seed" in c else None, **c)
                 for i, c in enumerate(companions)]
        order = list(range(len(rows)))[::-1] if step % 2 else list(range(len(rows)))  # move the row around
        results = sampler(logits[order], [rows[i] for i in order])
        tokens.append(results[order.index(0)].token_id)
    return tokens


def test_seed_reproducible_whatever_the_batch() -> None:
    alone = _seeded_run(42, [])
    crowded = _seeded_run(42, [{"temperature": 1.0}, {"seed": 7, "temperature": 0.5}, {"temperature": 0},
                               {"top_k": 3, "min_p": 0.1}], sampler_seed=123)
    assert alone == crowded
    assert _seeded_run(43, []) != alone


def test_unseeded_rows_use_the_sampler_generator() -> None:
    logits = _logits(8, scale=0.3)
    first = [r.token_id for r in Sampler([EOS], seed=5)(logits, [_row() for _ in range(8)])]
    again = [r.token_id for r in Sampler([EOS], seed=5)(logits, [_row() for _ in range(8)])]
    other = [r.token_id for r in Sampler([EOS], seed=6)(logits, [_row() for _ in range(8)])]
    assert first == again and first != other


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().expand(n, 4).clone()
    results = Sampler([EOS], seed=1)(logits, [_row(temperature=1.0) for _ in range(n)])
    freq = torch.bincount(torch.tensor([r.token_id for r in results]), minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.03


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(2000, 4).clone()
    cold = Sampler([EOS], seed=2)(logits, [_row(temperature=0.2) for _ in range(2000)])
    assert sum(r.token_id == 0 for r in cold) / 2000 > 0.95


def _filters() -> st.SearchStrategy:
    return st.fixed_dictionaries({
        "top_k": st.integers(0, 12), "top_p": st.floats(0.05, 1.0), "min_p": st.floats(0.0, 0.9),
        "temperature": st.floats(0.1, 2.0)})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-8, 8), min_size=2, max_size=40), _filters(), st.integers(0, 2**16))
def test_filters_only_pick_allowed_tokens(values: list[float], params: dict, seed: int) -> None:
    logits = torch.tensor(values, dtype=torch.float32)
    rows = [_row(**params, generator=make_generator(seed + i)) for i in range(16)]
    tokens = [r.token_id for r in Sampler([EOS])(logits.expand(16, -1).clone(), rows)]
    probs = torch.softmax(logits.double() / params["temperature"], dim=-1)
    for token in tokens:
        p = probs[token]
        assert p >= params["min_p"] * probs.max() - 1e-6
        if params["top_k"]:
            assert int((probs > p).sum()) < params["top_k"]
        if params["top_k"] == 0:  # top-p over the whole distribution: the mass strictly above stays below p
            assert float(probs[probs > p].sum()) < params["top_p"] + 1e-6


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=3, max_size=30), st.integers(1, 5), st.integers(0, 2**16))
def test_top_k_alone_picks_from_the_k_best(values: list[float], k: int, seed: int) -> None:
    logits = torch.tensor(values)
    rows = [_row(top_k=k, generator=make_generator(seed + i)) for i in range(8)]
    for result in Sampler([EOS])(logits.expand(8, -1).clone(), rows):
        assert int((logits > logits[result.token_id]).sum()) < k


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(3000, 4).clone()
    results = Sampler([EOS], seed=3)(logits, [_row(top_p=0.75) for _ in range(3000)])
    picked = {r.token_id for r in results}
    assert picked == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.tensor([0.5, 0.3, 0.12, 0.08]).log().expand(3000, 4).clone()
    results = Sampler([EOS], seed=4)(logits, [_row(min_p=0.3) for _ in range(3000)])
    assert {r.token_id for r in results} == {0, 1}  # 0.12 < 0.3 * 0.5 <= 0.3


def test_repetition_penalty_follows_hf() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    apply_penalties(logits, [_row(prompt=[0, 1], output=[1, 2], repetition_penalty=2.0)])
    torch.testing.assert_close(logits, torch.tensor([[1.0, -4.0, 0.5, -1.0, 0.5]]))


def test_presence_and_frequency_penalties_follow_openai() -> None:
    logits = torch.zeros(2, 5)
    rows = [_row(prompt=[4, 4, 4], output=[0, 0, 0, 2], presence_penalty=0.5, frequency_penalty=0.25),
            _row(output=[1])]
    apply_penalties(logits, rows)
    # token 0: 3 * 0.25 + 0.5; token 2: 0.25 + 0.5; prompt tokens (4) are not penalised
    torch.testing.assert_close(logits[0], torch.tensor([-1.25, 0.0, -0.75, 0.0, 0.0]))
    assert torch.equal(logits[1], torch.zeros(5))


def test_logit_bias_steers_greedy() -> None:
    logits = _logits(2)
    worst = int(logits[0].argmin())
    rows = [_row(temperature=0, logit_bias={worst: 100.0, V + 5: 5.0}), _row(temperature=0)]
    results = Sampler([EOS])(logits, rows)
    assert results[0].token_id == worst and results[1].token_id == logits[1].argmax()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_blocks_eos_and_stop_tokens(ignore_eos: bool) -> None:
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 9], logits[0, 5] = 10.0, 9.0, 8.0
    sampler = Sampler([EOS])
    params = dict(temperature=0, min_tokens=3, stop_token_ids=[9], ignore_eos=ignore_eos)
    early = sampler(logits, [_row(output=[1, 2], **params)])[0].token_id
    assert early == (EOS if ignore_eos else 5)
    assert sampler(logits, [_row(output=[1, 2, 4], **params)])[0].token_id == EOS


def test_logprobs_are_log_softmax_after_penalties() -> None:
    logits = _logits(3)
    rows = [_row(logprobs=5, temperature=0.7, top_k=4, output=[7, 7], frequency_penalty=1.0),
            _row(logprobs=0), _row()]
    results = Sampler([EOS], seed=9)(logits.clone(), rows)
    penalised = logits[0].clone()
    penalised[7] -= 2.0
    expected = torch.log_softmax(penalised, dim=-1)  # before temperature and top-k
    first = results[0].logprob
    assert first.token_id == results[0].token_id
    assert math.isclose(first.logprob, expected[first.token_id].item(), abs_tol=1e-5)
    values, ids = expected.topk(5)
    assert list(first.top) == ids.tolist()
    assert [round(v, 5) for v in first.top.values()] == [round(v, 5) for v in values.tolist()]
    assert results[1].logprob.top == {}
    assert math.isclose(results[1].logprob.logprob,
                        torch.log_softmax(logits[1], -1)[results[1].token_id].item(), abs_tol=1e-5)
    assert results[2].logprob is None


def test_input_logits_are_not_modified() -> None:
    logits = _logits(2)
    before = logits.clone()
    Sampler([EOS])(logits, [_row(repetition_penalty=1.5, prompt=[1, 2]), _row(logit_bias={0: 3.0})])
    assert torch.equal(logits, before)


def test_no_rows_sample_nothing() -> None:
    assert Sampler([EOS])(torch.zeros(0, V), []) == []


@pytest.mark.parametrize("temperature", [1e-39, 5e-324, 1e-6])
def test_vanishing_temperature_is_greedy(temperature: float) -> None:
    """Dividing by it would overflow float32 to inf and NaN; its limit is the argmax (issue 12)."""
    logits = _logits(4)
    rows = [_row(temperature=temperature), _row(temperature=1.0),
            _row(temperature=temperature, seed=3, generator=make_generator(3)), _row(temperature=temperature, logprobs=2)]
    results = Sampler([EOS])(logits, rows)
    assert [results[i].token_id for i in (0, 2, 3)] == logits[[0, 2, 3]].argmax(-1).tolist()
    assert all(math.isfinite(v) for v in [results[3].logprob.logprob, *results[3].logprob.top.values()])


def test_small_temperature_above_greedy_stays_finite() -> None:
    logits = torch.tensor([[3.0, 2.9, -1.0, float("-inf")]]).expand(200, 4).clone()
    results = Sampler([EOS], seed=1)(logits, [_row(temperature=2e-5) for _ in range(200)])
    assert {r.token_id for r in results} == {0}  # p(1) / p(0) = exp(-0.1 / 2e-5): never


def test_temperature_beyond_float32_keeps_masked_tokens_out() -> None:
    """float32(1e300) is inf, and -inf / inf is NaN: a min_tokens-masked EOS must stay unsampled."""
    logits = _logits(64, vocab=8)
    results = Sampler([EOS], seed=2)(logits, [_row(temperature=1e300, min_tokens=2) for _ in range(64)])
    tokens = [r.token_id for r in results]
    assert EOS not in tokens and len(set(tokens)) > 3  # the limit of an infinite temperature: uniform


@pytest.mark.parametrize("params, param", [
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 1e3}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"logit_bias": {5: -math.inf}}, "logit_bias"),
])
def test_numerically_unsafe_params_are_refused(params: dict, param: str) -> None:
    with pytest.raises(InvalidParamError) as caught:
        SamplingParams(**params)
    assert caught.value.param == param


def test_repetition_penalty_bounds_give_finite_logprobs() -> None:
    logits = _logits(2) * 10
    rows = [_row(prompt=list(range(V)), repetition_penalty=low_or_high, logprobs=5)
            for low_or_high in (0.01, 100.0)]
    for result in Sampler([EOS])(logits, rows):
        assert all(math.isfinite(v) for v in [result.logprob.logprob, *result.logprob.top.values()])


def test_logit_bias_of_many_rows_is_one_indexed_add(monkeypatch: pytest.MonkeyPatch) -> None:
    """n choices of a whole-vocabulary bias: one index_put_ over all rows, the same sums as a loop."""
    bias = {token: float(token % 7) - 3.0 for token in range(V)}
    rows = [_row(logit_bias=bias) for _ in range(8)] + [_row()]
    logits = _logits(9)
    expected = logits.clone()
    expected[:8] += torch.tensor([bias[t] for t in range(V)])
    calls = []
    original = torch.Tensor.index_put_

    def counting(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_put_", counting)
    apply_logit_bias(logits, rows)
    assert len(calls) == 1
    assert torch.allclose(logits, expected)


def test_logit_bias_tensors_ignore_ids_outside_the_vocabulary() -> None:
    assert LogitBias.of({V: 1.0, V + 9: 2.0}, V) is None
    bias = LogitBias.of({1: 0.5, V: 1.0}, V)
    assert bias is not None and bias.token_ids.tolist() == [1] and bias.values.tolist() == [0.5]


def test_list_caps() -> None:
    with pytest.raises(InvalidParamError) as error:
        SamplingParams(stop_token_ids=list(range(257)))
    assert error.value.param == "stop_token_ids"
    with pytest.raises(InvalidParamError) as error:
        SamplingParams(logit_bias={t: 1.0 for t in range(301)})
    assert error.value.param == "logit_bias"
    assert SamplingParams(stop_token_ids=[5, 5, 9]).stop_token_set == frozenset({5, 9})


def test_choice_seeds_of_different_seeds_never_meet() -> None:
    """seed + i made (seed 1, choice 1) equal (seed 2, choice 0); mixed seeds share no choice stream."""
    streams = {(seed, i): choice_seed(seed, i) for seed in range(-50, 50) for i in range(128)}
    assert len(set(streams.values())) == len(streams)
    assert choice_seed(7, 0) == 7  # n = 1 samples as before
    assert all(0 <= value < 2**64 for (_, index), value in streams.items() if index)
