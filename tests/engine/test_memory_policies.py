"""Prefix caching, shared pages for n > 1, oversubscription in both preemption modes, aging, health."""


import pytest

from pagegate import LLM, SamplingParams
from pagegate.config import HealthThresholds
from pagegate.engine.observe.metrics import health_grade
from pagegate.testing.launcher import wait_for

from .test_llm import assert_all_pages_free, make_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompt_tokens_computed(llm: LLM) -> float:
    return llm.engine.metrics.registry.get_sample_value(
        "vllm:prompt_tokens_total", {"model_name": llm.engine.model_name}) or 0.0


def test_second_identical_prompt_computes_only_the_tail(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64)
    prompt = make_prompts()[7]  # 70 tokens: 4 full pages
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    before = prompt_tokens_computed(llm)
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 64 and first.num_cached_tokens == 0
    assert prompt_tokens_computed(llm) - before == 70 - 64
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_pages_free(llm)


def test_cache_salt_isolates_tenants(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64)
    engine, prompt = llm.engine, make_prompts()[7]
    for request_id, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a")):
        request = engine.add_request(request_id, prompt, GREEDY, cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
        assert request.num_cached_tokens == (64 if request_id == "c" else 0)
    assert_all_pages_free(llm)


def test_cached_pages_survive_until_evicted_least_recently_used_first(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=20, max_model_len=256)
    a, b = [11] * 64 + [1], [12] * 64 + [2]  # 4 full pages each, cached when they finish
    llm.generate([a], GREEDY, use_tqdm=False)
    llm.generate([b], GREEDY, use_tqdm=False)
    assert llm.stats().cached_blocks == 8
    filler = [13] * 200  # 13 pages: the 12 never-cached ones, then the least recently freed cached page
    llm.generate([filler], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert llm.generate([b], GREEDY, use_tqdm=False)[0].num_cached_tokens == 64
    # a's pages were freed last page first: its tail went, its first three pages are still a hit
    assert llm.generate([a], GREEDY, use_tqdm=False)[0].num_cached_tokens == 48
    assert_all_pages_free(llm)


def test_n4_matches_four_single_requests_on_shared_pages(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64, enable_prefix_caching=False)
    prompt = make_prompts()[7]  # 70 tokens: 5 pages
    singles = [llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for _ in range(4)]
    engine = llm.engine
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=0, max_tokens=6, ignore_eos=True))
    peak, outputs = 0, []
    while engine.has_unfinished():
        outputs += engine.step()
        peak = max(peak, engine.stats().used_blocks)
    final = outputs[-1]
    assert [c.token_ids for c in final.outputs] == singles
    assert peak <= 5 + 4  # the prompt's pages once, plus one private page per choice (copy-on-write)
    assert_all_pages_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_oversubscribed_pool_finishes_everything_with_identical_output(llama_model, mode):
    prompts = [make_prompts()[i % 8][: 20 + i] for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    big = LLM(str(llama_model.path), device="cpu", num_kv_blocks=512)
    expected = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    demand = sum(-(-(len(p) + 12) // 16) for p in prompts)
    pool = demand // 4
    swap = 0.002 if mode == "swap" else 0.0
    small = LLM(str(llama_model.path), device="cpu", num_kv_blocks=pool, max_model_len=128, swap_space=swap,
                preemption_mode=mode, enable_prefix_caching=False)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = small.stats()
    assert stats.preemptions > 0
    if mode == "swap":
        assert stats.swap_in_blocks > 0 and stats.swap_in_blocks == stats.swap_out_blocks
    assert_all_pages_free(small)


def test_aging_lets_a_low_priority_request_finish_under_a_flood(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=16, max_model_len=64, max_num_seqs=2,
              enable_prefix_caching=False, scheduling_policy="priority")
    engine = llm.engine
    engine.scheduler.config.aging_rate = 50.0  # priority levels per second: fast enough for a test
    low = engine.add_request("low", [9] * 20, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                             priority=10)
    urgent = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    count = 0

    def flood_and_step() -> bool:
        nonlocal count
        while len(engine.requests) < 6:  # a steady flood of urgent requests
            engine.add_request(f"u{count}", [5] * 20, urgent, priority=0)
            count += 1
        engine.step()
        return low.finished

    wait_for(flood_and_step, "the low-priority request to finish", timeout_s=120, poll_s=0)
    assert low.finished and count > 4
    for request_id in list(engine.requests):
        engine.abort(request_id)
    assert_all_pages_free(llm)


def test_health_grades_match_the_seed_monitor():
    # the seed's five samples (1000 pages): (free, waiting, swaps) -> OK, OK, OK, CRITICAL, WARNING
    samples = [(700, 0, 0), (500, 2, 0), (200, 8, 3), (100, 15, 12), (50, 22, 8)]
    grades = [health_grade((1000 - free) / 1000, waiting, swaps, HealthThresholds())[0]
              for free, waiting, swaps in samples]
    assert grades == ["OK", "OK", "OK", "CRITICAL", "WARNING"]
    assert health_grade(0.96, 0, 0, HealthThresholds())[0] == "WARNING"
    assert health_grade(0.85, 0, 0, HealthThresholds())[0] == "GOOD"


def test_engine_health_and_metrics_report_pages(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64)
    llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    health = llm.engine.health()
    assert health.grade == "OK" and "KV usage" in health.reason
    value = llm.engine.metrics.registry.get_sample_value
    labels = {"model_name": llm.engine.model_name}
    assert value("vllm:generation_tokens_total", labels) == 8 * 6 == llm.stats().generation_tokens
    assert value("vllm:kv_cache_usage_perc", labels) == 0.0
    assert value("vllm:time_to_first_token_seconds_count", labels) == 8
    assert value("pagegate:health", labels) == 0
