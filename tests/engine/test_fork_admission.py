"""n > 1 prompts fork into n sequences when their prefill ends: admission counts the n up front, so forks
never overflow the block tables' slots or the running cap (issue 22: one request with 9 prompts and
n = 128 raised inside Engine.step and ended the engine loop)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate import LLM, SamplingParams
from pagegate.engine.errors import InvalidParamError

from .test_llm import assert_all_pages_free


def run_checking_seats(llm: LLM, max_num_seqs: int) -> int:
    """Step until done; after each step the running sequences, forks to come included, fit the cap and
    the block tables. Returns the number of steps."""
    engine, steps = llm.engine, 0
    scheduler = engine.scheduler
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert len(scheduler.running) + len(scheduler.swapped) <= scheduler.num_occupied_seats <= max_num_seqs
        assert scheduler.tables.num_sequences <= scheduler.tables.max_seqs
        assert steps < 10_000
    return steps


def test_nine_prompts_of_128_choices_run_without_overflowing_the_slots(llama_model):
    """The issue's request: 9 x 128 = 1,152 sequences against 1,024 block-table slots and 256 running."""
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=400)
    params = SamplingParams(n=128, max_tokens=2, temperature=1.0, ignore_eos=True)
    requests = [llm.engine.add_request(f"r{i}", [5, 6, 7], params) for i in range(9)]
    run_checking_seats(llm, 256)
    assert all(r.error is None and len(r.output().outputs) == 128 for r in requests)
    assert_all_pages_free(llm)


@pytest.fixture(scope="module")
def llm_with_cap(llama_model):
    """An LLM per running cap, shared by the examples below."""
    llms: dict[int, LLM] = {}

    def get(max_num_seqs: int) -> LLM:
        if max_num_seqs not in llms:
            llms[max_num_seqs] = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64, max_num_seqs=max_num_seqs)
        return llms[max_num_seqs]

    return get


@settings(max_examples=15, deadline=None)
@given(ns=st.lists(st.integers(1, 6), min_size=1, max_size=8), max_num_seqs=st.integers(2, 6))
def test_running_sequences_never_exceed_the_cap(llm_with_cap, ns: list[int], max_num_seqs: int) -> None:
    llm = llm_with_cap(max_num_seqs)
    requests = [llm.engine.add_request(f"h{i}", [3 + i, 4], SamplingParams(n=min(n, max_num_seqs), max_tokens=3,
                                                                         temperature=1.0, ignore_eos=True))
                for i, n in enumerate(ns)]
    run_checking_seats(llm, max_num_seqs)
    assert all(r.error is None and len(r.output().outputs) == r.params.n for r in requests)
    assert_all_pages_free(llm)


def test_more_choices_than_can_ever_run_is_refused(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64, max_num_seqs=4)
    with pytest.raises(InvalidParamError) as error:
        llm.engine.add_request("big", [5, 6], SamplingParams(n=5, max_tokens=2))
    assert error.value.param == "n"
    assert_all_pages_free(llm)
