"""Fair pages per API key (issue 60): among waiting sequences of one lane and priority, the key furthest below its
weighted share of pages goes first, and a key's quota caps the pages its running sequences hold; checked as
scheduler state."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate.engine.key_pages import key_name
from pagegate.engine.key_slices import LINGER_S
from pagegate.engine.sequence import SeqStatus

from .scheduler_harness import BATCH, BLOCK, ONLINE, Driver, KeyShare, scheduler

A, B = KeyShare("alice"), KeyShare("bob")


def test_the_key_below_its_share_is_admitted_before_one_that_arrived_first():
    driver = Driver(scheduler(12))
    driver.add(4 * BLOCK, key=A, max_tokens=50)
    driver.step()  # alice holds 5 pages, bob none
    alices = driver.add(2 * BLOCK, key=A)
    bobs = driver.add(2 * BLOCK, key=B)
    driver.sched.config.max_num_batched_tokens = 2 * BLOCK + 1  # one decode and one prompt a step
    driver.step()
    assert bobs.status is SeqStatus.RUNNING and alices.status is SeqStatus.WAITING


def test_a_weight_scales_the_share():
    heavy = KeyShare("heavy", weight=4)
    driver = Driver(scheduler(32, budget=2 * BLOCK + 2))
    driver.add(8 * BLOCK - 1, key=heavy, max_tokens=50)  # 8 pages: 2 a unit of weight
    driver.add(3 * BLOCK - 1, key=B, max_tokens=50)  # 3 pages: 3 a unit of weight
    driver.sched.config.max_num_batched_tokens = 11 * BLOCK
    driver.step()
    driver.sched.config.max_num_batched_tokens = 2 * BLOCK + 2  # two decodes and one prompt a step
    bobs = driver.add(2 * BLOCK, key=B)
    heavys = driver.add(2 * BLOCK, key=heavy)
    driver.step()
    assert heavys.status is SeqStatus.RUNNING and bobs.status is SeqStatus.WAITING


def test_admissions_alternate_between_keys_by_the_pages_they_take():
    """Weighed again after each admission: two keys of three equal prompts each, room for four, get two each."""
    driver = Driver(scheduler(8))
    alices = [driver.add(2 * BLOCK - 1, key=A) for _ in range(3)]
    bobs = [driver.add(2 * BLOCK - 1, key=B) for _ in range(3)]
    driver.step()
    assert [s.status for s in alices].count(SeqStatus.RUNNING) == 2
    assert [s.status for s in bobs].count(SeqStatus.RUNNING) == 2


def test_a_key_at_its_quota_waits_and_lets_other_keys_pass():
    capped = KeyShare("capped", max_kv_blocks=6)
    driver = Driver(scheduler(32))
    driver.add(4 * BLOCK - 1, key=capped, max_tokens=3)  # 4 pages, and no fifth in these two steps
    driver.step()
    held_back = driver.add(3 * BLOCK, key=capped)  # 4 + 3 > 6
    bobs = driver.add(3 * BLOCK, key=B)
    driver.step()
    assert held_back.status is SeqStatus.WAITING and bobs.status is SeqStatus.RUNNING
    assert driver.key_pages("capped") == 4


def test_growth_past_the_quota_preempts_the_keys_own_least_urgent_sequence():
    capped = KeyShare("capped", max_kv_blocks=5)
    driver = Driver(scheduler(32))
    urgent = driver.add(3 * BLOCK, key=capped, max_tokens=50)
    later = driver.add(2 * BLOCK - 1, key=capped, max_tokens=50)
    bobs = driver.add(BLOCK, key=B, max_tokens=50)  # the least urgent of all, and untouched
    driver.step()  # 3 + 2 pages: the quota; urgent's first token needs a fourth page next step
    batch = driver.step()
    assert urgent.status is SeqStatus.RUNNING and later.status is SeqStatus.WAITING
    assert bobs.status is SeqStatus.RUNNING and batch.yielded == 1
    assert driver.key_pages("capped") == 4


def test_a_prompt_larger_than_its_keys_quota_fails():
    driver = Driver(scheduler(32))
    seq = driver.add(3 * BLOCK, key=KeyShare("capped", max_kv_blocks=2))
    driver.step()
    assert seq in driver.finished and "quota of 2" in (seq.request.error or "")


def test_an_online_request_at_its_keys_quota_preempts_the_keys_batch_work():
    capped = KeyShare("capped", max_kv_blocks=6)
    driver = Driver(scheduler(32))
    own_batch = driver.add(4 * BLOCK, BATCH, key=capped, max_tokens=50)
    others = driver.add(4 * BLOCK, BATCH, key=B, max_tokens=50)
    driver.step()
    online = driver.add(3 * BLOCK, ONLINE, key=capped)
    driver.step()
    assert online.status is SeqStatus.RUNNING and own_batch.status is SeqStatus.WAITING
    assert others.status is SeqStatus.RUNNING


def test_pages_by_key_counts_the_running_sequences_of_named_keys():
    driver = Driver(scheduler(32))
    driver.add(3 * BLOCK, key=A, max_tokens=50)
    driver.add(2 * BLOCK, key=A, max_tokens=50)
    driver.add(2 * BLOCK)  # no key: not shown
    driver.step()
    assert driver.sched.pages_by_key() == {"alice": 5}


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(8, 40), swap=st.booleans(),
       keys=st.lists(st.tuples(st.floats(0.5, 4.0), st.one_of(st.none(), st.integers(1, 12))), min_size=1, max_size=3),
       arrivals=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.sampled_from([ONLINE, BATCH]),
                                   st.integers(1, 5 * BLOCK), st.integers(1, 12)), min_size=1, max_size=14))
def test_no_key_ever_holds_more_pages_than_its_quota(num_blocks, swap, keys, arrivals):
    """Random keys (weights, quotas) and arrivals of both lanes: after every step each key's running sequences hold
    at most its quota of pages (their block tables counted), and the keys over their share beside a light one took
    at most their slice; everything finishes or fails, nothing is left holding."""
    shares = [KeyShare(f"k{i}", weight, quota) for i, (weight, quota) in enumerate(keys)]
    driver = Driver(scheduler(num_blocks, swap_blocks=4 * num_blocks if swap else 0, slice_tokens=3))
    pending = sorted(arrivals, key=lambda a: a[0])
    steps = 0
    while pending or driver.sched.num_unfinished:
        while pending and pending[0][0] <= steps:
            _, key, lane, prompt, max_tokens = pending.pop(0)
            driver.add(min(prompt, (num_blocks - 1) * BLOCK), lane, shares[key % len(shares)], max_tokens=max_tokens)
        batch = driver.step()
        steps += 1
        over = driver.sched.slices.over
        assert sum(n for seq, n in zip(batch.seqs, batch.num_tokens, strict=True) if key_name(seq) in over) <= 3
        for share in shares:
            if share.max_kv_blocks is not None:
                assert driver.key_pages(share.name) <= share.max_kv_blocks
        counted = {name: pages for name, pages in driver.sched.key_pages.held.items() if pages}
        assert counted == {name: pages for name, pages in driver.sched.pages_by_key().items() if pages}
        assert steps < 2_000
    assert driver.sched.pool.num_free_blocks == num_blocks


def heavy_decodes(driver: Driver, count: int = 4) -> list:
    """`count` running sequences of alice's, past their prompts."""
    heavy = [driver.add(2 * BLOCK - 1, key=A, max_tokens=50) for _ in range(count)]
    driver.step()
    assert all(seq.status is SeqStatus.RUNNING for seq in heavy)
    return heavy


def test_a_prompt_of_a_key_far_below_its_share_gets_a_step_of_its_own():
    driver = Driver(scheduler(64))
    heavy = heavy_decodes(driver)
    light = driver.add(BLOCK, key=B, max_tokens=5)
    owed = driver.step()
    assert owed.seqs == [light]  # no decode of the heavy key beside it
    normal = driver.step()
    assert set(normal.seqs) == {*heavy, light}


def test_never_two_owed_steps_in_a_row():
    driver = Driver(scheduler(64))
    heavy = heavy_decodes(driver)
    first = driver.add(BLOCK, key=B, max_tokens=5)
    driver.step()
    second = driver.add(BLOCK, key=KeyShare("carol"), max_tokens=5)
    batch = driver.step()
    assert set(batch.seqs) == {*heavy, first, second}


def test_no_owed_step_for_a_lone_key_nor_a_key_near_its_share():
    driver = Driver(scheduler(64))
    heavy = heavy_decodes(driver)
    more = driver.add(BLOCK, key=A)
    assert set(driver.step().seqs) == {*heavy, more}  # one key at work: nothing is owed
    bobs = [driver.add(2 * BLOCK - 1, key=B, max_tokens=50) for _ in range(3)]
    driver.step()
    assert (driver.key_pages("alice"), driver.key_pages("bob")) == (9, 6)  # bob's share: 7.5; half of it, 3.75
    later = driver.add(BLOCK, key=B)
    batch = driver.step()
    assert later in batch.seqs and set(heavy + bobs) <= set(batch.seqs)


def test_beside_a_light_key_the_heavy_keys_decodes_take_turns_in_a_slice():
    driver = Driver(scheduler(64, slice_tokens=3))
    heavy = heavy_decodes(driver, 6)
    light = driver.add(BLOCK, key=B, max_tokens=10)
    assert driver.step().seqs == [light]  # its own step (owed)
    served = []
    for _ in range(4):
        batch = driver.step()
        assert light in batch.seqs
        served.append({seq for seq in batch.seqs if seq in heavy})
    assert [len(s) for s in served] == [3, 3, 3, 3]
    assert served[0] | served[1] == set(heavy) and served[0] == served[2]  # least recently served first


def test_the_heavy_keys_prompts_share_their_slice():
    driver = Driver(scheduler(64, slice_tokens=4))
    heavy = heavy_decodes(driver, 2)
    driver.add(BLOCK, key=B, max_tokens=10)
    driver.step()  # the light prompt's own
    prompt = driver.add(5 * BLOCK, key=A)
    batch = driver.step()
    assert dict(zip(batch.seqs, batch.num_tokens, strict=True))[prompt] == 2  # the slice's 4 less the two decodes
    assert set(heavy) <= set(batch.seqs)


def test_the_slice_lasts_while_the_light_key_is_between_requests_and_ends_after():
    driver = Driver(scheduler(64, slice_tokens=2))
    heavy = heavy_decodes(driver, 4)
    light = driver.add(BLOCK, key=B, max_tokens=1)
    driver.step()
    assert light in driver.finished
    assert len(driver.step().seqs) == 2  # bob has nothing running, but may send the next request any moment
    driver.now += LINGER_S
    assert set(driver.step().seqs) == set(heavy)


def test_no_slice_for_a_lone_key_nor_for_keys_near_their_shares():
    driver = Driver(scheduler(64, slice_tokens=2))
    heavy = heavy_decodes(driver, 4)
    assert set(driver.step().seqs) == set(heavy)
    bobs = [driver.add(2 * BLOCK - 1, key=B, max_tokens=50) for _ in range(3)]
    driver.step()
    assert set(driver.step().seqs) == {*heavy, *bobs}  # 9 pages against 6: bob holds over half his share
