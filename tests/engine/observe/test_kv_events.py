"""KV-cache events: the pool's log, vLLM's wire format over real ZMQ sockets, replay, and the invariant a router
relies on: an index built only from the events predicts exactly the cached tokens of the next request."""

from __future__ import annotations

import random

import msgpack
import pytest
import zmq
from prometheus_client import generate_latest

from pagegate import LLM, SamplingParams
from pagegate.config import CacheConfig, EngineConfig, KVEventsConfig, SchedulerConfig
from pagegate.core import BlockPool, compute_block_hash
from pagegate.engine.lora import LoRARequest
from pagegate.engine.observe.kv_events import END_OF_REPLAY, encode_batch
from pagegate.engine.observe.monitor import start_kv_events
from pagegate.testing.kv_index import PageIndex
from pagegate.testing.launcher import free_port

BLOCK = 16


def test_pool_logs_stores_removals_and_clears() -> None:
    pool = BlockPool(2, BLOCK)
    pool.record_events()
    first, second = list(range(BLOCK)), list(range(BLOCK, 2 * BLOCK))
    [a, b] = pool.allocate(2).tolist()
    h1 = pool.cache_block(a, 0, first, first=True)
    h2 = pool.cache_block(b, h1, second)
    pool.free([a, b])
    [c] = pool.allocate(1).tolist()  # takes the least recently freed cached page: evicts it
    pool.reset()
    assert h1 == compute_block_hash(0, first) and h2 == compute_block_hash(h1, second)
    assert pool.take_events() == [("BlockStored", h1, None, first), ("BlockStored", h2, h1, second),
                                  ("BlockRemoved", h1 if c == a else h2), ("AllBlocksCleared",)]
    assert pool.take_events() == []


def test_a_pool_that_replaces_the_last_logs_its_events_too() -> None:
    # a wake or an elastic pool's start gives the engine a fresh pool: the monitor must hear its pages as well
    llm = LLM(None, device="cpu", num_kv_blocks=8, max_model_len=64)
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{free_port()}")
    llm.engine.monitor.kv_events = start_kv_events(config, llm.engine.scheduler.pool)
    try:
        fresh = BlockPool(2, BLOCK)
        llm.engine.monitor.rebind(fresh)
        [page] = fresh.allocate(1).tolist()
        stored = fresh.cache_block(page, 0, list(range(BLOCK)), first=True)
        assert llm.engine.monitor.pool is fresh
        assert fresh.take_events() == [("BlockStored", stored, None, list(range(BLOCK)))]
    finally:
        llm.shutdown()


def test_batches_are_vllm_arrays_and_merge_chains() -> None:
    events = [("BlockStored", 1, None, [1] * BLOCK), ("BlockStored", 2, 1, [2] * BLOCK),
              ("BlockStored", 9, 5, [3] * BLOCK), ("BlockRemoved", 4), ("BlockRemoved", 5), ("AllBlocksCleared",)]
    ts, decoded, rank = msgpack.unpackb(encode_batch(events, BLOCK, ts=12.5))
    assert (ts, rank) == (12.5, 0)
    assert decoded == [
        ["BlockStored", [1, 2], None, [1] * BLOCK + [2] * BLOCK, BLOCK, None, "GPU", None],
        ["BlockStored", [9], 5, [3] * BLOCK, BLOCK, None, "GPU", None],
        ["BlockRemoved", [4, 5], "GPU"],
        ["AllBlocksCleared"],
    ]


def test_pages_of_an_image_carry_its_digest_one_entry_a_page() -> None:
    """extra_keys (vLLM's field after lora_name) only on a chain that holds an image: one entry a page, None for its
    pages of text alone; the entries of one chain stay in its order across the merge."""
    text, image = ("BlockStored", 1, None, [1] * BLOCK), ("BlockStored", 2, 1, [2] * BLOCK, "GPU", None, None, ["ab"])
    after = ("BlockStored", 3, 2, [3] * BLOCK, "GPU", None, None, None)
    _, decoded, _ = msgpack.unpackb(encode_batch([text, image, after, ("BlockStored", 9, 5, [4] * BLOCK)], BLOCK))
    assert decoded == [
        ["BlockStored", [1, 2, 3], None, [1] * BLOCK + [2] * BLOCK + [3] * BLOCK, BLOCK, None, "GPU", None,
         [None, ["ab"], None]],
        ["BlockStored", [9], 5, [4] * BLOCK, BLOCK, None, "GPU", None],
    ]


def test_stored_pages_carry_their_adapter_and_chains_of_two_adapters_stay_apart() -> None:
    events = [("BlockStored", 1, None, [1] * BLOCK, "GPU", 3, "sql"), ("BlockStored", 2, 1, [2] * BLOCK, "GPU", 3, "sql"),
              ("BlockStored", 7, 2, [4] * BLOCK, "GPU", 4, "chat"), ("BlockStored", 8, None, [5] * BLOCK, "CPU")]
    _, decoded, _ = msgpack.unpackb(encode_batch(events, BLOCK, ts=1.0))
    assert decoded == [
        ["BlockStored", [1, 2], None, [1] * BLOCK + [2] * BLOCK, BLOCK, 3, "GPU", "sql"],
        ["BlockStored", [7], 2, [4] * BLOCK, BLOCK, 4, "GPU", "chat"],  # another adapter: not merged into the chain
        ["BlockStored", [8], None, [5] * BLOCK, BLOCK, None, "CPU", None],
    ]


def test_serve_flag_rejects_a_bad_config() -> None:
    from pagegate.gateway.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert args.kv_events_config.enable_kv_cache_events
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-events-config", '{"publisher": "kafka"}'])


def test_config_takes_vllms_keys_only() -> None:
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv@p@m"}')
    assert config.enable_kv_cache_events and config.endpoint == "tcp://*:5557" and config.buffer_steps == 10_000
    with pytest.raises(ValueError, match="unknown"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "bogus": 1}')


def drain(socket: zmq.Socket, index: PageIndex, seqs: list[int]) -> None:
    """Apply what the server published; a router keeps only this index (pagegate/testing/kv_index.py)."""
    while socket.poll(200):
        topic, seq, payload = socket.recv_multipart()
        assert topic == b"kv@pod@model"
        seqs.append(int.from_bytes(seq, "big"))
        index.apply(payload)


def test_events_name_the_tier_and_predict_cached_tokens_with_tiers() -> None:
    """With a host-memory tier, pages leaving the pool are announced as stored on "CPU", and a router's index
    of both media still predicts every request's cached tokens exactly."""
    port = free_port()
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.bind(f"tcp://127.0.0.1:{port}")
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@pod@model")
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}",
                            replay_endpoint=None, topic="kv@pod@model")
    cache = CacheConfig(num_kv_blocks=24, kv_offload_memory="4MiB", kv_offload_min_reuse=1)
    llm = LLM.from_config(EngineConfig(cache=cache, scheduler=SchedulerConfig(max_model_len=256)))
    llm.engine.monitor.kv_events = start_kv_events(config, llm.engine.scheduler.pool)
    try:
        index, seqs, rng = PageIndex(), [], random.Random(1)
        systems = [[rng.randrange(3, 2000) for _ in range(5 * BLOCK + 5)] for _ in range(4)]
        drain(subscriber, index, seqs)
        served_from_tiers = 0
        for turn in range(20):
            prompt = rng.choice(systems) + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 40))]
            predicted, from_pool = index.cached_tokens(prompt), PageIndex.cached_tokens_of(index.pages, prompt)
            output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
            assert output.num_cached_tokens == predicted, turn
            served_from_tiers += predicted - from_pool
            drain(subscriber, index, seqs)
        assert index.media["CPU"] and served_from_tiers > 0
    finally:
        llm.shutdown()
        context.destroy(linger=0)


def test_events_predict_cached_tokens_under_eviction_and_replay() -> None:
    port, replay_port = free_port(), free_port()
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.bind(f"tcp://127.0.0.1:{port}")  # the server connects: its endpoint has no wildcard
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@pod@model")
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}",
                            replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv@pod@model")
    llm = LLM(None, device="cpu", num_kv_blocks=24, max_model_len=256)
    llm.engine.monitor.kv_events = start_kv_events(config, llm.engine.scheduler.pool)
    try:
        index, seqs, rng = PageIndex(), [], random.Random(0)
        systems = [[rng.randrange(3, 2000) for _ in range(3 * BLOCK + 5)] for _ in range(3)]
        drain(subscriber, index, seqs)
        for turn in range(24):  # 24 pages hold about two prompts: older prefixes get evicted
            prompt = rng.choice(systems) + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 40))]
            predicted = index.cached_tokens(prompt)
            output = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=3), use_tqdm=False)[0]
            assert output.num_cached_tokens == predicted, turn
            drain(subscriber, index, seqs)
        # consecutive from 0, except that PUB/SUB may drop what is sent before the connection is up (replay below)
        first = seqs[0]
        assert first <= 1 and seqs == list(range(first, first + len(seqs))) and len(seqs) > 10
        assert any(k[0] is not None for k in index.pages) and index.removed > 0  # chains, and evictions
        metrics = generate_latest(llm.engine.metrics.registry).decode()
        assert 'block_size="16"' in metrics and 'num_gpu_blocks="24"' in metrics  # vllm:cache_config_info
        assert "pagegate:kv_events_dropped_total 0.0" in metrics.replace('{model_name="pagegate-default"}', "")

        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            _, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            replayed.append(int.from_bytes(seq, "big"))
        assert replayed == list(range(seqs[-1] + 1))
    finally:
        llm.shutdown()
        context.destroy(linger=0)


def stored_events(socket: zmq.Socket) -> list[list]:
    """Every BlockStored the server published so far, one per page: [hash, parent, tokens, lora_id, lora_name]."""
    pages = []
    while socket.poll(200):
        _, _, payload = socket.recv_multipart()
        for event in msgpack.unpackb(payload)[1]:
            if event[0] == "BlockStored":
                _, hashes, parent, tokens, size, lora_id, _, lora_name = event
                for i, block_hash in enumerate(hashes):
                    pages.append([block_hash, parent, tokens[i * size:(i + 1) * size], lora_id, lora_name])
                    parent = block_hash
    return pages


def test_pages_computed_under_an_adapter_carry_its_id_and_name(llama_model, tmp_path) -> None:
    """One mixed batch: the same 40-token prompt on the base model and under two adapters, and a 5-token prompt
    under one (its first page fills while it generates). Each stored page names the adapter it was computed under
    (vLLM's lora_id and lora_name), so a router keying pages on them never offers one adapter's pages to another."""
    pytest.importorskip("peft")
    from ..lora.test_lora import make_adapter

    folders = {name: tmp_path / name for name in ("sql", "chat")}
    for seed, folder in enumerate(folders.values()):
        make_adapter(llama_model.hf_model, folder, ["q_proj", "v_proj"], 4, 8, False, seed=seed)
    port = free_port()
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.bind(f"tcp://127.0.0.1:{port}")
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@pod@model")
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}",
                            replay_endpoint=None, topic="kv@pod@model")
    llm = LLM(str(llama_model.path), device="cpu", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    llm.engine.monitor.kv_events = start_kv_events(config, llm.engine.scheduler.pool)
    try:
        sql, chat = (LoRARequest(name, 7 + i, str(folder)) for i, (name, folder) in enumerate(folders.items()))
        prompt, short = list(range(30, 70)), [5, 17, 99, 3, 8]
        assert stored_events(subscriber) == []  # waits for the connection: PUB drops what is sent before it
        outputs = llm.generate([prompt, prompt, prompt, short], SamplingParams(temperature=0, max_tokens=20,
                               ignore_eos=True), use_tqdm=False, lora_request=[None, sql, chat, chat])
        pages = stored_events(subscriber)
    finally:
        llm.shutdown()
        context.destroy(linger=0)
    chains: dict[tuple, list[list]] = {}
    for block_hash, parent, tokens, lora_id, lora_name in pages:
        chains.setdefault((lora_id, lora_name), []).append([block_hash, parent, tokens])
    assert set(chains) == {(None, None), (7, "sql"), (8, "chat")}
    # 59 tokens of each long prompt and its answer computed: 3 whole pages; 24 of the short one: 1
    assert {adapter: len(chain) for adapter, chain in chains.items()} == {(None, None): 3, (7, "sql"): 3,
                                                                          (8, "chat"): 4}
    short_first_page = (short + outputs[3].outputs[0].token_ids)[:BLOCK]
    firsts = {adapter: sorted(tokens for _, parent, tokens in chain if parent is None)
              for adapter, chain in chains.items()}
    assert firsts == {(None, None): [prompt[:BLOCK]], (7, "sql"): [prompt[:BLOCK]],
                      (8, "chat"): sorted([prompt[:BLOCK], short_first_page])}
    for adapter, chain in chains.items():  # every later page's parent is a page of the same adapter
        assert all(parent is None or parent in {h for h, _, _ in chain} for _, parent, _ in chain), adapter
