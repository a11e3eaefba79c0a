"""Each request's timeline: queue, prefill and decode times, preemptions (swap or recompute) and their resumes,
prefix-hit pages and the pages held, recorded by the scheduler and read back as a RequestTiming."""

from __future__ import annotations

import pytest

from pagegate import LLM, SamplingParams
from pagegate.engine.observe.timeline import (
    RECOMPUTE,
    SWAP,
    Preemption,
    RequestTiming,
    Timeline,
    merged_breakdown,
)
from pagegate.engine.serving.frames import DeltaWriter

from ..test_llm import assert_all_pages_free, make_prompts

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def timing_of(output) -> RequestTiming:
    timing = RequestTiming.from_metrics(output.request_id, output.metrics, len(output.prompt_token_ids),
                                        len(output.outputs[0].token_ids), output.num_cached_tokens)
    assert timing is not None
    return timing


def test_a_plain_request_has_ordered_milestones_and_its_pages(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64)
    prompt = make_prompts()[7]  # 70 tokens: 4 full pages and a partial one
    first = timing_of(llm.generate(prompt, PARAMS, use_tqdm=False)[0])
    assert first.arrival <= first.first_scheduled <= first.first_token <= first.finished
    assert first.preemptions == () and first.prefix_hit_pages == 0
    assert first.pages_held == -(-(70 + 12 - 1) // 16)  # the last token is sampled, never written
    second = timing_of(llm.generate(prompt, PARAMS, use_tqdm=False)[0])
    assert second.prefix_hit_pages == 4 and second.cached_tokens == 64
    row = second.breakdown()
    assert row["preemptions"] == row["swaps"] == 0 and row["prefix_hit_pages"] == 4
    assert row["queue_ms"] >= 0 and row["e2e_ms"] >= row["prefill_ms"] + row["decode_ms"] - 0.01
    assert_all_pages_free(llm)


@pytest.mark.parametrize("mode", [RECOMPUTE, SWAP])
def test_preemptions_under_page_pressure_are_on_the_timeline(llama_model, mode):
    prompts = [make_prompts()[i % 8][: 20 + i] for i in range(24)]
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=24, max_model_len=128, preemption_mode=mode,
              swap_space=0.002 if mode == SWAP else 0.0, enable_prefix_caching=False)
    timings = [timing_of(o) for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    preempted = [t for t in timings if t.preemptions]
    assert preempted and sum(len(t.preemptions) for t in timings) == llm.stats().preemptions
    for timing in preempted:
        for p in timing.preemptions:
            assert p.kind in (mode, RECOMPUTE) and p.pages > 0  # swap mode recomputes when the CPU pool is full
            assert timing.first_scheduled <= p.at <= timing.finished
            assert p.resumed_at is not None and p.at <= p.resumed_at <= timing.finished
        assert timing.preempted_s > 0 and timing.pages_held >= max(p.pages for p in timing.preemptions)
        assert timing.num_swaps == sum(p.kind == SWAP for p in timing.preemptions)
    assert sum(t.num_swaps for t in timings) == llm.stats().swap_outs and (mode == RECOMPUTE) != bool(
        llm.stats().swap_outs)
    assert_all_pages_free(llm)


def test_the_timeline_crosses_the_core_frames_with_the_final_delta_only(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64)
    engine, writer = llm.engine, DeltaWriter()
    request = engine.add_request("r", make_prompts()[3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    request.timeline.preempted(SWAP, 1.0, 3, 0)  # as if: the wire carries it whatever it holds
    deltas = []
    while engine.has_unfinished():
        deltas += [writer.delta(r) for r in engine.step_requests()]
    assert all(d.timings is None for d in deltas[:-1]) and deltas[-1].timings is not None
    output = deltas[0].output(None, request.prompt_token_ids)
    for delta in deltas[1:]:
        output.add(delta.output(None, request.prompt_token_ids))
    timing = timing_of(output)
    assert timing.preemptions == (Preemption(SWAP, 1.0, 3, 0, None),) and timing.pages_held >= 3


def test_timeline_resumes_the_choice_that_was_preempted():
    timeline = Timeline()
    timeline.preempted(SWAP, 1.0, 2, index=0)
    timeline.preempted(RECOMPUTE, 1.5, 5, index=1)
    timeline.resumed(1, 2.0)
    assert [p.resumed_at for p in timeline.preemptions] == [None, 2.0] and timeline.pages_held == 5
    timeline.resumed(0, 3.0)
    assert timeline.preemptions[0].resumed_at == 3.0


def test_merged_breakdown_takes_the_longest_durations_and_sums_counts():
    a = RequestTiming("a", 0.0, 0.1, 0.3, 1.0, 5, 3, 0, 1, 4, (Preemption(SWAP, 0.5, 2, 0, 0.6),))
    b = RequestTiming("b", 0.0, 0.2, 0.25, 0.5, 5, 3, 0, 2, 3)
    merged = merged_breakdown([a, b])
    assert merged["queue_ms"] == 200.0 and merged["decode_ms"] == 700.0
    assert merged["preemptions"] == merged["swaps"] == 1 and merged["prefix_hit_pages"] == 3
    assert merged["pages_held"] == 7
    assert RequestTiming.from_metrics("x", {"arrival_time": 1.0}, 1, 0) is None
