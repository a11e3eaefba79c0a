"""A prompt the prefix cache nearly completes (an agent's next turn) is admitted first and finds room in the step,
however long the prompts running or waiting before it (Scheduler._nearly_cached); and a prompt runs in one step
unless the runner needs it cut at its hit's end (Scheduler.cuts_at_hits)."""

from __future__ import annotations

from .scheduler_harness import BLOCK, Driver, scheduler

BUDGET = 16
HISTORY = [10 + i for i in range(10 * BLOCK)]  # ten pages an earlier turn left in the cache


def cached_driver(cuts_at_hits: bool = True) -> Driver:
    driver = Driver(scheduler(64, budget=BUDGET, prefix_caching=True))
    driver.sched.cuts_at_hits = cuts_at_hits
    earlier = driver.add(0, tokens=HISTORY, max_tokens=1)
    while earlier not in driver.finished:
        driver.step()
    return driver


def fresh(n: int, start: int) -> list[int]:
    return [start + i for i in range(n)]


def test_a_nearly_cached_prompt_passes_waiting_prompts_in_a_short_step():
    driver = cached_driver()
    long = driver.add(0, tokens=fresh(60, 1000))
    driver.step()  # the long prompt takes the whole budget
    assert long.num_computed == BUDGET
    earlier = driver.add(0, tokens=fresh(50, 2000))
    turn = driver.add(0, tokens=HISTORY + [7, 8])  # two tokens past the cached pages
    batch = driver.step()
    shares = dict(zip(batch.seqs, batch.num_tokens, strict=True))
    assert shares[turn] == 2 and turn.num_computed == len(turn.token_ids) - 1  # its first token is sampled
    assert shares[long] == BUDGET // 4  # the other prompts take a quarter: a short step
    assert earlier not in shares  # the earlier, longer prompt waits: that quarter is spent
    assert turn.request.num_cached_tokens == len(HISTORY)


def test_without_a_hit_arrival_order_holds():
    driver = cached_driver()
    long = driver.add(0, tokens=fresh(60, 1000))
    driver.step()
    first = driver.add(0, tokens=fresh(50, 2000))
    short = driver.add(0, tokens=fresh(2, 3000))  # short, but nothing of it is cached
    batch = driver.step()
    assert batch.seqs == [long] and batch.num_tokens == [BUDGET]
    assert first in driver.sched.waiting and short in driver.sched.waiting


def test_a_prompt_stops_at_its_hit_end_only_where_the_runner_needs_it():
    for cuts, chunks in ((True, [40, 2]), (False, [42])):
        driver = cached_driver(cuts_at_hits=cuts)
        driver.sched.config.max_num_batched_tokens = 64
        seq = driver.add(0, tokens=fresh(42, 5000))
        taken = []
        while seq.num_computed < len(seq.token_ids) - 1 or not taken:
            batch = driver.step()
            taken += [n for s, n in zip(batch.seqs, batch.num_tokens, strict=True) if s is seq]
        assert taken[:len(chunks)] == chunks


def test_the_others_quarter_never_goes_below_nothing():
    """A decode's guesses (speculation) count against the quarter uncapped and may overdraw it: a prompt then gets
    no tokens that step, never a negative count."""
    driver = cached_driver()
    turn = driver.add(0, tokens=HISTORY + [7, 8])
    prompt = driver.add(0, tokens=fresh(30, 4000))
    sched = driver.sched
    sched._near, sched._others_left = {turn}, -3
    assert sched._allowance(prompt, BUDGET) == 0 and sched._allowance(turn, BUDGET) == BUDGET
