"""KV-cache events in vLLM's wire format, for prefix-aware routers (llm-d's kv-cache-manager, NVIDIA Dynamo).

The page pool logs each page that enters or leaves the prefix cache; the engine hands one batch per step to
a publisher thread through a bounded queue (a full queue drops the batch and counts it: the engine thread
never waits). The thread sends ZMQ multipart messages `[topic, seq, payload]`: `seq` an 8-byte big-endian
counter from 0, `payload` msgpack arrays `[ts, events, data_parallel_rank]` with events
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`,
`["BlockRemoved", block_hashes, medium]` and `["AllBlocksCleared"]`; `medium` is "GPU" for the pool's pages (on CPU
servers too, as vLLM names them), "CPU" for the host-memory tier and "DISK" for the disk tier. A ROUTER socket replays the buffered
batches from a requested sequence number.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from pagegate.config import KVEventsConfig

if TYPE_CHECKING:
    from pagegate.engine.kv_tiers import TierEvent

log = logging.getLogger(__name__)

MEDIUM = "GPU"  # vLLM's name for device pages, on CPU-only servers too
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def encode_batch(events: Sequence[tuple[Any, ...]], block_size: int, ts: float | None = None,
                 data_parallel_rank: int = 0) -> bytes:
    """One msgpack batch from the pool's events; a chain of pages stored in a row becomes one BlockStored."""
    encoded: list[list[Any]] = []
    for event in events:
        kind = event[0]
        last = encoded[-1] if encoded else None
        if kind == "BlockStored":
            _, block_hash, parent, tokens, *where = event
            medium = where[0] if where else MEDIUM
            if last is not None and last[0] == "BlockStored" and parent == last[1][-1] and last[6] == medium:
                last[1].append(block_hash)
                last[3].extend(tokens)
            else:
                encoded.append(["BlockStored", [block_hash], parent, list(tokens), block_size, None, medium, None])
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
