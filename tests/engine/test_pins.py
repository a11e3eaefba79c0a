"""Prefix pins: a request's pages held for its next turn or a later prompt with its prefix, within a budget, released
under pressure, refreshed by hits of the same key, expired on the engine's clock."""

import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate import LLM, SamplingParams
from pagegate.core import BlockPool
from pagegate.engine.pin import Pin
from pagegate.engine.pins import PrefixPins
from pagegate.engine.tenants import KeyShare

from .test_llm import assert_all_pages_free

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams = GREEDY, pin: Pin | None = None,
        key: KeyShare | None = None):
    request = llm.engine.intake.make_request(request_id, prompt, params, pins=(pin,) if pin else (), key=key)
    llm.engine.add(request)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert request.error is None
    return request


def next_turn(request) -> list[int]:
    return request.prompt_token_ids + request.seqs[0].output_token_ids + [2]


def test_a_pinned_conversation_outlives_eviction(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=20, max_model_len=256)  # pin budget: 5 pages
    a = run(llm, "a", [11] * 64 + [1], pin=Pin("conversation-a", 60.0))
    b = run(llm, "b", [12] * 64 + [1])  # the same shape, not pinned
    assert llm.stats().pinned_blocks == 4  # 70 tokens written: 4 full pages
    run(llm, "filler", [13] * 200, SamplingParams(temperature=0, max_tokens=1))  # evicts b's pages, not a's
    assert run(llm, "a2", next_turn(a)).num_cached_tokens == 64
    assert run(llm, "b2", next_turn(b)).num_cached_tokens == 48  # b's tail page went (pages are freed last first)
    assert llm.engine.unpin("conversation-a") and not llm.engine.unpin("conversation-a")
    assert llm.stats().pinned_blocks == 0
    assert_all_pages_free(llm)


def pinned(llama_model, num_kv_blocks: int, ttl_s: float) -> LLM:
    """An engine whose pool holds one pinned request of 4 full pages."""
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=num_kv_blocks, max_model_len=256)
    run(llm, "a", [11] * 64 + [1], pin=Pin("a", ttl_s))
    assert llm.stats().pinned_blocks == 4
    return llm


def test_pins_give_way_to_a_request_that_needs_the_pages(llama_model):
    llm = pinned(llama_model, 16, 60.0)
    big = run(llm, "big", [13] * 240, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # all 16 pages
    assert len(big.seqs[0].output_token_ids) == 8
    assert llm.stats().pinned_blocks == 0
    assert_all_pages_free(llm)


def test_pins_expire_after_their_ttl(llama_model):
    llm = pinned(llama_model, 20, 0.0)
    run(llm, "b", [12] * 20)  # the next step finds the pin expired
    assert llm.stats().pinned_blocks == 0


def test_a_pin_over_the_budget_holds_nothing(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=8, max_model_len=120)  # budget: 2 pages
    run(llm, "a", [11] * 64 + [1], pin=Pin("a", 60.0))
    assert llm.stats().pinned_blocks == 0
    assert_all_pages_free(llm)


def test_a_prefix_pin_holds_the_prompt_pages_once_the_prompt_is_computed(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=20, max_model_len=256)
    request = llm.engine.intake.make_request("a", [11] * 64 + [1], GREEDY, pins=(Pin("p", 300.0, 40),))
    llm.engine.add(request)
    while not request.seqs[0].output_token_ids:
        llm.engine.step()
    assert request.output().pinned_tokens == [32] and llm.stats().pinned_blocks == 2  # 40 tokens: 2 full pages
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert run(llm, "b", [11] * 32 + [5] * 40).num_cached_tokens == 32


def test_a_pin_expires_on_the_engine_clock_and_a_hit_of_its_key_refreshes_it(llama_model):
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=20, max_model_len=256)
    offset = [0.0]
    llm.engine.clock = lambda: time.monotonic() + offset[0]
    prompt, ours, theirs = [11] * 64 + [1], KeyShare("ours"), KeyShare("theirs")
    assert run(llm, "a", prompt, pin=Pin("p", 300.0, 64), key=ours).pinned_tokens == [64]
    offset[0] = 200.0
    assert run(llm, "b", prompt, key=ours).num_cached_tokens == 64  # a hit of the same key: 300 s again from here
    offset[0] = 450.0
    run(llm, "c", prompt, key=theirs)  # another key's hit keeps nothing alive
    assert llm.stats().pinned_blocks == 4
    assert llm.engine.scheduler.pinned_by_key() == {"ours": 4}
    offset[0] = 501.0
    llm.engine.step()
    assert llm.stats().pinned_blocks == 0 and llm.engine.scheduler.pinned_by_key() == {}
    assert_all_pages_free(llm)


# ---- the pin book on its own -------------------------------------------------------------------------------

OPS = st.lists(st.one_of(
    st.tuples(st.just("hold"), st.integers(0, 3), st.lists(st.integers(0, 11), max_size=6, unique=True),
              st.floats(0, 10), st.floats(0, 10), st.sampled_from(["x", "y", None])),
    st.tuples(st.just("release"), st.integers(0, 3)),
    st.tuples(st.just("oldest")),
    st.tuples(st.just("expire"), st.floats(0, 20)),
    st.tuples(st.just("refresh"), st.lists(st.integers(0, 11), max_size=6, unique=True), st.sampled_from(["x", None]),
              st.floats(0, 10)),
), max_size=30)


class Model:
    """What the pins should hold: key -> (pages, expiry, ttl, owner), least recently used first."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[list[int], float, float, str | None]] = {}

    def pages(self, owner: object = all) -> set[int]:
        return {page for pages, _, _, who in self.held.values() if owner is all or who == owner for page in pages}


@settings(max_examples=200, deadline=None)
@given(ops=OPS, max_blocks=st.integers(0, 8))
def test_pins_hold_one_reference_per_page_within_the_budget(ops, max_blocks):
    """Whatever happens (holds, releases, expiry, refreshes), each pin holds one reference on each of its pages until
    it goes, and goes once; the pins never hold more pages than the budget; each key's pages are counted once."""
    pool = BlockPool(12, block_size=4)
    owned = pool.allocate(12)  # a request's pages: one reference each
    pins = PrefixPins(pool, max_blocks)
    model = Model()
    for op in ops:
        if op[0] == "hold":
            key, pages, now, ttl, owner = f"k{op[1]}", [int(owned[i]) for i in op[2]], op[3], op[4], op[5]
            model.held.pop(key, None)
            ok = pins.hold(key, np.array(pages, dtype=np.int32), now, ttl, owner)
            assert ok == (0 < len(pages) <= max_blocks)
            if ok:
                while len(model.pages() | set(pages)) > max_blocks:
                    model.held.pop(next(iter(model.held)))
                model.held[key] = (pages, now + ttl, ttl, owner)
        elif op[0] == "release":
            assert pins.release(f"k{op[1]}") == (model.held.pop(f"k{op[1]}", None) is not None)
        elif op[0] == "oldest":
            assert pins.release_oldest() == bool(model.held)
            if model.held:
                model.held.pop(next(iter(model.held)))
        elif op[0] == "expire":
            gone = [k for k, (_, expires, _, _) in model.held.items() if expires <= op[1]]
            assert pins.expire(op[1]) == len(gone)
            for key in gone:
                del model.held[key]
        else:
            hit, owner, now = {int(owned[i]) for i in op[1]}, op[2], op[3]
            fresh = [k for k, (pages, _, _, who) in model.held.items() if pages[-1] in hit and who == owner]
            assert pins.refresh(np.array(sorted(hit), dtype=np.int32), owner, now) == len(fresh)
            for key in fresh:
                pages, _, ttl, who = model.held.pop(key)
                model.held[key] = (pages, now + ttl, ttl, who)
        assert pins.keys() == list(model.held)
        assert pins.num_blocks == len(model.pages()) <= max_blocks
        assert pins.pages_by_owner() == {o: len(model.pages(o)) for o in ("x", "y") if model.pages(o)}
        for block in owned:
            assert pool.refcount(int(block)) == 1 + sum(int(block) in p for p, _, _, _ in model.held.values())
    pins.expire(float("inf"))
    assert pins.expire(float("inf")) == 0 and not pins.release_oldest()  # expired pins went, each once
    pool.free(owned)
    assert pool.num_free_blocks == 12 and pins.num_blocks == 0
