"""Prefix pins: a finished request's pages held for its next turn, within a budget, released under pressure."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagegate import LLM, SamplingParams
from pagegate.core import BlockPool
from pagegate.engine.pins import Pin, PrefixPins

from .test_llm import assert_all_pages_free

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams = GREEDY, pin: Pin | None = None):
    request = llm.engine.intake.make_request(request_id, prompt, params, pin=pin)
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


# ---- the pin book on its own -------------------------------------------------------------------------------

OPS = st.lists(st.one_of(
    st.tuples(st.just("hold"), st.integers(0, 3), st.lists(st.integers(0, 11), max_size=6, unique=True),
              st.floats(0, 10)),
    st.tuples(st.just("release"), st.integers(0, 3)),
    st.tuples(st.just("oldest")),
    st.tuples(st.just("expire"), st.floats(0, 10)),
), max_size=30)


def pinned_pages(held: dict[str, tuple[list[int], float]]) -> set[int]:
    return {page for pages, _ in held.values() for page in pages}


@settings(max_examples=200, deadline=None)
@given(ops=OPS, max_blocks=st.integers(0, 8))
def test_pins_hold_one_reference_per_page_within_the_budget(ops, max_blocks):
    pool = BlockPool(12, block_size=4)
    owned = pool.allocate(12)  # a request's pages: one reference each
    pins = PrefixPins(pool, max_blocks)
    held: dict[str, tuple[list[int], float]] = {}  # the model: key -> (pages, expiry), oldest first
    for op in ops:
        if op[0] == "hold":
            key, pages, expires = f"k{op[1]}", [int(owned[i]) for i in op[2]], op[3]
            held.pop(key, None)
            ok = pins.hold(key, np.array(pages, dtype=np.int32), expires)
            assert ok == (0 < len(pages) <= max_blocks)
            if ok:
                while len(pinned_pages(held) | set(pages)) > max_blocks:
                    held.pop(next(iter(held)))
                held[key] = (pages, expires)
        elif op[0] == "release":
            assert pins.release(f"k{op[1]}") == (held.pop(f"k{op[1]}", None) is not None)
        elif op[0] == "oldest":
            assert pins.release_oldest() == bool(held)
            if held:
                held.pop(next(iter(held)))
        else:
            gone = [k for k, (_, expires) in held.items() if expires <= op[1]]
            assert pins.expire(op[1]) == len(gone)
            for key in gone:
                del held[key]
        assert pins.keys() == list(held)
        assert pins.num_blocks == len(pinned_pages(held)) <= max_blocks
        for block in owned:
            assert pool.refcount(int(block)) == 1 + sum(int(block) in p for p, _ in held.values())
    while pins.release_oldest():
        pass
    pool.free(owned)
    assert pool.num_free_blocks == 12 and pins.num_blocks == 0
