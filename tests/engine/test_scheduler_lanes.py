"""The batch lane (issue 60): batch-lane sequences take only the pages and step budget online ones leave, are
preempted first, and never preempt an online one; checked as scheduler state (who is admitted, preempted, holding
pages), never as timing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.engine.sequence import SeqStatus

from .scheduler_harness import BATCH, BLOCK, ONLINE, Driver, running, scheduler, waiting


def fill_with_batch(driver: Driver, count: int, prompt: int = 4 * BLOCK, max_tokens: int = 50) -> list:
    """`count` batch sequences admitted and decoding."""
    seqs = [driver.add(prompt, BATCH, max_tokens=max_tokens) for _ in range(count)]
    driver.step()
    assert all(seq.status is SeqStatus.RUNNING for seq in seqs)
    return seqs


def test_online_is_admitted_before_batch_that_arrived_first():
    driver = Driver(scheduler(6))
    early = driver.add(4 * BLOCK, BATCH)
    late = driver.add(4 * BLOCK, ONLINE)
    driver.step()
    assert late.status is SeqStatus.RUNNING and early.status is SeqStatus.WAITING


def test_no_batch_sequence_is_admitted_while_an_online_one_waits_for_pages():
    driver = Driver(scheduler(10))
    driver.add(6 * BLOCK, ONLINE, max_tokens=50)
    driver.step()
    blocked = driver.add(6 * BLOCK, ONLINE)  # 6 pages: only 4 are free
    small = driver.add(BLOCK, BATCH)  # 1 page would fit
    driver.step()
    assert blocked.status is SeqStatus.WAITING and small.status is SeqStatus.WAITING
    assert driver.sched.pool.num_free_blocks == 4 - 1  # the running prompt took its next page, nothing else


def test_an_online_prompt_preempts_running_batch_sequences_least_urgent_first():
    driver = Driver(scheduler(12))
    first, second, third = fill_with_batch(driver, 3, prompt=3 * BLOCK)  # 9 pages of 12
    online = driver.add(2 * BLOCK, ONLINE, max_tokens=50)
    driver.step()  # 2 pages more: 1 free
    arriving = driver.add(4 * BLOCK, ONLINE)
    batch = driver.step()
    assert arriving.status is SeqStatus.RUNNING
    assert online.status is SeqStatus.RUNNING and driver.pages(online) == 3
    assert third.status is SeqStatus.WAITING and second.status is SeqStatus.WAITING  # the latest went first
    assert first.status is SeqStatus.RUNNING
    assert batch.preempted == batch.yielded == 2
    assert driver.sched.cap.value == driver.sched.cap.max  # making way is no sign of a pool too small


def test_online_growth_preempts_batch_even_when_batch_arrived_first():
    driver = Driver(scheduler(7, swap_blocks=16))
    early = fill_with_batch(driver, 1, prompt=3 * BLOCK)[0]
    online = driver.add(4 * BLOCK, ONLINE, max_tokens=50)  # 4 pages: the pool's last
    driver.step()
    assert driver.sched.pool.num_free_blocks == 0
    driver.step()  # the online sequence's next token needs a fifth page: the batch one's go
    assert online.status is SeqStatus.RUNNING and driver.pages(online) == 5
    assert early.status is SeqStatus.SWAPPED
    assert early not in driver.sched.running


def test_batch_growth_never_preempts_an_online_sequence():
    driver = Driver(scheduler(8))
    online = driver.add(4 * BLOCK, ONLINE, max_tokens=50)
    driver.step()
    batch_seq = driver.add(4 * BLOCK - 1, BATCH, max_tokens=50)
    for _ in range(3):
        driver.step()
    assert online.status is SeqStatus.RUNNING and driver.pages(online) == 5
    assert batch_seq.status is SeqStatus.WAITING  # no step without online tokens: it never ran, nor took a page


def test_batch_admission_leaves_headroom_for_an_online_prompt():
    driver = Driver(scheduler(20, headroom=0.25))  # 5 pages of headroom
    assert driver.sched.batch_headroom_blocks == 5
    batch_seqs = [driver.add(4 * BLOCK - 2, BATCH, max_tokens=2) for _ in range(4)]  # never a fifth page
    driver.step()
    assert [s.status for s in batch_seqs].count(SeqStatus.RUNNING) == 3  # 12 pages used; a fourth leaves 4
    arriving = driver.add(4 * BLOCK, ONLINE)
    batch = driver.step()
    assert arriving.status is SeqStatus.RUNNING and batch.preempted == 0


def test_an_online_prompt_takes_a_running_batch_sequences_seat():
    driver = Driver(scheduler(64, max_num_seqs=2))
    first, second = fill_with_batch(driver, 2, prompt=BLOCK)
    online = driver.add(BLOCK, ONLINE)
    driver.step()
    assert online.status is SeqStatus.RUNNING
    assert first.status is SeqStatus.RUNNING and second.status is SeqStatus.WAITING


def test_batch_tokens_run_only_in_steps_without_online_ones_and_at_most_batch_step_tokens():
    driver = Driver(scheduler(64, budget=6 * BLOCK, batch_step_tokens=2 * BLOCK))
    online = driver.add(6 * BLOCK, ONLINE, max_tokens=3)
    batch_seq = driver.add(10 * BLOCK, BATCH)
    while online.status is not SeqStatus.FINISHED:
        batch = driver.step()
        assert batch.seqs == [online] and batch_seq.num_computed == 0  # budget left over, yet not a batch token
    batch = driver.step()  # online is done: a batch step, of at most batch_step_tokens
    assert batch.seqs == [batch_seq] and batch.num_tokens == [2 * BLOCK]
    running = driver.add(BLOCK, ONLINE)
    batch = driver.step()  # an online prompt arrives: the batch sequence keeps its pages and sits the step out
    assert batch.seqs == [running] and batch_seq.status is SeqStatus.RUNNING and batch_seq.num_computed == 2 * BLOCK


def test_a_batch_requests_priority_orders_it_among_batch_requests_only():
    driver = Driver(scheduler(6, policy="priority"))
    urgent_batch = driver.add(4 * BLOCK, BATCH, priority=-100)
    lazy_online = driver.add(4 * BLOCK, ONLINE, priority=100)
    driver.step()
    assert lazy_online.status is SeqStatus.RUNNING and urgent_batch.status is SeqStatus.WAITING
    driver = Driver(scheduler(6, policy="priority"))
    later = driver.add(4 * BLOCK, BATCH, priority=5)
    sooner = driver.add(4 * BLOCK, BATCH, priority=-5)
    driver.step()
    assert sooner.status is SeqStatus.RUNNING and later.status is SeqStatus.WAITING


def test_a_swapped_batch_sequence_does_not_hold_online_admission_back():
    driver = Driver(scheduler(7, swap_blocks=16))
    victim = fill_with_batch(driver, 1, prompt=4 * BLOCK)[0]
    driver.add(4 * BLOCK, ONLINE, max_tokens=50)
    driver.step()  # the batch sequence made way
    assert victim.status is SeqStatus.SWAPPED
    driver.sched.free(driver.sched.running[0])  # the online sequence ends: pages for the next one, or the swapped
    arriving = driver.add(3 * BLOCK, ONLINE)
    driver.step()
    assert arriving.status is SeqStatus.RUNNING and victim.status is SeqStatus.SWAPPED


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(6, 40), swap=st.booleans(), headroom=st.sampled_from([0.0, 0.2]),
       arrivals=st.lists(st.tuples(st.integers(0, 3), st.sampled_from([ONLINE, BATCH]), st.integers(1, 5 * BLOCK),
                                   st.integers(1, 12)), min_size=1, max_size=14))
def test_no_online_sequence_waits_or_is_preempted_while_batch_work_holds_pages(num_blocks, swap, headroom, arrivals):
    """Random arrivals of both lanes on a pool of any size (the budget and running cap never bind, so pages alone
    decide): after every step, while an online sequence waits (new, preempted or swapped), no batch sequence holds
    a page; and everything finishes."""
    driver = Driver(scheduler(num_blocks, swap_blocks=4 * num_blocks if swap else 0, headroom=headroom))
    pending = sorted(arrivals, key=lambda a: a[0])
    steps = 0
    while pending or driver.sched.num_unfinished:
        while pending and pending[0][0] <= steps:
            _, lane, prompt, max_tokens = pending.pop(0)
            driver.add(min(prompt, (num_blocks - 1) * BLOCK), lane, max_tokens=max_tokens)
        driver.step()
        steps += 1
        online_waits = waiting(driver.sched, ONLINE)
        batch_pages = sum(driver.pages(seq) for seq in running(driver.sched, BATCH))
        assert not (online_waits and batch_pages), (online_waits, batch_pages)
        assert steps < 2_000
    assert driver.sched.pool.num_free_blocks == num_blocks
