"""KV-cache events in vLLM's wire format, for prefix-aware routers (llm-d's kv-cache-manager, NVIDIA Dynamo).

The page pool logs each page that enters or leaves the prefix cache; the engine hands one batch per step to
a publisher thread through a bounded queue (a full queue drops the batch and counts it: the engine thread
never waits). The thread sends ZMQ multipart messages `[topic, seq, payload]`: `seq` an 8-byte big-endian
counter from 0, `payload` msgpack arrays `[ts, events, data_parallel_rank]` with events
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
extra_keys]` (`extra_keys` only where a page holds an image: one entry a page, the hex SHA-256 digests of the images
its tokens belong to, or None; its token_ids are the prompt's own tokens, the placeholders, as vLLM publishes them),
`["BlockRemoved", block_hashes, medium]` and `["AllBlocksCleared"]`; `medium` is "GPU" for the pool's pages (on CPU
servers too, as vLLM names them), "CPU" for the host-memory tier and "DISK" for the disk tier; `lora_id` and
`lora_name` name the LoRA adapter a page was computed under (AdapterTags), None for the base model. A ROUTER socket
replays the buffered batches from a requested sequence number.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from pagegate.config import KVEventsConfig

if TYPE_CHECKING:
    from pagegate.core import BlockPool
    from pagegate.engine.kv_tiers import TierEvent
    from pagegate.engine.sequence import Request

log = logging.getLogger(__name__)

MEDIUM = "GPU"  # vLLM's name for device pages, on CPU-only servers too
# a BlockStored's medium, lora_id, lora_name and image digests where the event leaves them out (the pool's: its pages,
# no adapter, no image)
STORED_DEFAULTS: tuple[Any, ...] = (MEDIUM, None, None, None)
LoRATag = tuple[int, str]  # (lora_int_id, lora_name) of the adapter a page was computed under
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def encode_batch(events: Sequence[tuple[Any, ...]], block_size: int, ts: float | None = None,
                 data_parallel_rank: int = 0) -> bytes:
    """One msgpack batch from the pool's events; a chain of pages stored in a row becomes one BlockStored."""
    encoded: list[list[Any]] = []
    for event in events:
        kind = event[0]
        last = encoded[-1] if encoded else None
        if kind == "BlockStored":
            _, block_hash, parent, tokens, *given = event
            medium, lora_id, lora_name, images = (*given, *STORED_DEFAULTS[len(given):])
            if last is not None and last[0] == "BlockStored" and parent == last[1][-1] and last[6] == medium \
                    and last[5] == lora_id:
                last[1].append(block_hash)
                last[3].extend(tokens)
            else:
                last = ["BlockStored", [block_hash], parent, list(tokens), block_size, lora_id, medium, lora_name]
                encoded.append(last)
            if images is not None and len(last) == 8:  # the chain's earlier pages hold no image
                last.append([None] * (len(last[1]) - 1))
            if len(last) == 9:
                last[8].append(images)
        elif kind == "BlockRemoved":
            medium = event[2] if len(event) > 2 else MEDIUM
            if last is not None and last[0] == "BlockRemoved" and last[2] == medium:
                last[1].append(event[1])
            else:
                encoded.append(["BlockRemoved", [event[1]], medium])
        else:
            encoded.append(["AllBlocksCleared"])
    return msgpack.packb([time.time() if ts is None else ts, encoded, data_parallel_rank])


def tier_events(events: Sequence[TierEvent]) -> list[tuple[Any, ...]]:
    """The KV tiers' events as the pool's, with their medium ("CPU", "DISK") last."""
    out: list[tuple[Any, ...]] = []
    for event in events:
        for key in event.keys:
            if event.name == "BlockStored":
                out.append(("BlockStored", key.hash, None if key.first else key.parent, key.token_ids, event.medium))
            else:
                out.append(("BlockRemoved", key.hash, event.medium))
    return out


class AdapterTags:
    """Which LoRA adapter each page entering a cache was computed under, for BlockStored's lora_id and lora_name
    (llm-d's indexer keys pages on them).

    NOTE: the pool logs pages by hash and knows no sequence. An adapter's pages chain from a root hash salted with
    its identity (intake.py), so a page is its parent's adapter's, and a chain's first page is an adapter's when it
    hashes from the root of a sequence of the step that stored it running with that adapter (pages are stored by
    the step's own sequences). The pages remembered are bounded, least recently stored out first: a page whose
    parent fell out is published with no adapter, as every page was before."""

    def __init__(self, pool: BlockPool, max_pages: int = 1 << 16) -> None:
        self.pool, self.max_pages = pool, max_pages
        self.pages: OrderedDict[int, LoRATag] = OrderedDict()  # page hash -> its adapter

    def tag(self, events: Sequence[tuple[Any, ...]], roots: Callable[[], dict[int, LoRATag]]) -> list[tuple[Any, ...]]:
        """The pool's and tiers' events, every BlockStored with its medium, lora_id and lora_name; `roots()`: the
        chain roots of the step's sequences that run with an adapter (asked at most once)."""
        tagged, step_roots = [], None
        for event in events:
            if event[0] == "BlockStored":
                _, block_hash, parent, tokens, *given = event
                lora = self.pages.get(block_hash if parent is None else parent)
                if lora is None and parent is None:
                    step_roots = roots() if step_roots is None else step_roots
                    lora = self._first_page_adapter(block_hash, tokens, step_roots)
                if lora is not None:
                    self._remember(block_hash, lora)
                event = (*event[:4], given[0] if given else MEDIUM, *(lora or (None, None)))
            tagged.append(event)
        return tagged

    def _first_page_adapter(self, block_hash: int, tokens: Sequence[int],
                            roots: dict[int, LoRATag]) -> LoRATag | None:
        return next((lora for root, lora in roots.items()
                     if int(self.pool.prefix_hashes(tokens, root)[0]) == block_hash), None)

    def _remember(self, block_hash: int, lora: LoRATag) -> None:
        self.pages[block_hash] = lora
        self.pages.move_to_end(block_hash)
        if len(self.pages) > self.max_pages:
            self.pages.popitem(last=False)


class ImageTags:
    """The prompt's own tokens and the images behind a stored page whose tokens are an image's prefix keys
    (media/prompt_images.py), for BlockStored's token_ids and extra_keys.

    NOTE: the pool hashes and logs a page's keys, not its tokens. Each key is a word of a stream over one image's
    digest, so the words of the step's prompts with images map back to (token, digest); the words remembered are
    bounded, least recently learned out first (a page whose words fell out is published as the pool logged it)."""

    def __init__(self, max_words: int = 1 << 17) -> None:
        self.max_words = max_words
        self.words: OrderedDict[int, tuple[int, str]] = OrderedDict()  # key word -> (token, the image's hex digest)

    def learn(self, requests: Iterable[Request]) -> None:
        """Remember the key words of the images of `requests` (those already known are skipped)."""
        for request in requests:
            keys = request.prefix_keys
            if keys is None:
                continue
            for span, image in zip(_keyed_spans(keys, request.images), request.images, strict=True):
                if keys[span.start] in self.words:
                    continue
                digest = image.digest.hex()
                for at in span:
                    self.words[keys[at]] = (request.prompt_token_ids[at], digest)
        while len(self.words) > self.max_words:
            self.words.popitem(last=False)

    def tag(self, events: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The events, each BlockStored of keyed tokens with its own tokens and its images' digests."""
        tagged = []
        for event in events:
            if event[0] == "BlockStored" and any(token < 0 for token in event[3]):
                known = [self.words.get(token) for token in event[3]]
                tokens = [token if word is None else word[0] for token, word in zip(event[3], known, strict=True)]
                digests = list(dict.fromkeys(word[1] for word in known if word is not None))
                given = (*event[4:], *STORED_DEFAULTS[len(event) - 4:])
                event = (*event[:3], tokens, *given[:3], digests or None)
            tagged.append(event)
        return tagged


def _keyed_spans(keys: Sequence[int], images: Sequence[Any]) -> list[range]:
    """The positions of `keys` that each image's words replaced: from the page where it starts (or the last image's
    end) to its end; key words are the negative ones (prompt_images.KEY_BIT)."""
    spans, done = [], 0
    for image in images:
        begin = image.start
        while begin > done and keys[begin - 1] < 0:
            begin -= 1
        spans.append(range(begin, image.end))
        done = image.end
    return spans


class EventPublisher:
    """Takes batches from the engine thread without blocking; a thread encodes and sends them."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config, self.block_size = config, block_size
        self.num_dropped = 0
        self._queue: queue.Queue[Sequence[tuple[Any, ...]] | None] = queue.Queue(config.max_queue_size)
        self._sockets = _ZmqSockets(config) if config.publisher == "zmq" else None
        self._thread = threading.Thread(target=self._run, name="pagegate-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[tuple[Any, ...]]) -> bool:
        """Queue one step's events; False (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(events)
            return True
        except queue.Full:
            self.num_dropped += 1
            return False

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        seq, buffer = 0, deque[tuple[int, bytes]](maxlen=self.config.buffer_steps)
        sockets = self._sockets
        while True:
            if sockets is not None:
                sockets.serve_replay(buffer)
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                break
            payload = encode_batch(events, self.block_size)
            if sockets is not None:
                sockets.send(seq, payload)
            buffer.append((seq, payload))
            seq += 1
        if sockets is not None:
            sockets.close()


class _ZmqSockets:
    """The PUB socket and the replay ROUTER socket; used only by the publisher thread."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq  # an optional dependency: only a server with events on needs it

        self.topic = config.topic.encode()
        self.context = zmq.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or endpoint.startswith("ipc://"):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.replay = None
        if config.replay_endpoint:
            self.replay = self.context.socket(zmq.ROUTER)
            self.replay.bind(config.replay_endpoint)
        self.poller = zmq.Poller()
        if self.replay is not None:
            self.poller.register(self.replay, zmq.POLLIN)

    def send(self, seq: int, payload: bytes) -> None:
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def serve_replay(self, buffer: deque[tuple[int, bytes]]) -> None:
        """Answer waiting replay requests: [client, b"", start seq] -> every buffered [seq, payload] from there."""
        if self.replay is None:
            return
        while self.poller.poll(0):
            client, _, start = self.replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in buffer:
                if seq >= first:
                    self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def close(self) -> None:
        self.context.destroy(linger=500)
