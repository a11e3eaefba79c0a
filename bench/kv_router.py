"""A tiny prefix-aware router for the fleet benchmark (a reference, not part of the package): it subscribes to
each server's KV-cache events, keeps which pages each one holds, and sends a prompt to the server holding
the longest prefix of it (ties: the one with fewer requests in flight)."""

from __future__ import annotations

import threading

import zmq

from pagegate.testing.kv_index import PageIndex


class KVRouter:
    """Binds one SUB socket per server on 127.0.0.1 (the servers connect to it) and routes by prefix."""

    def __init__(self, ports: list[int], topic: bytes = b"") -> None:
        self.indexes = [PageIndex() for _ in ports]
        self.in_flight = [0] * len(ports)
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._sockets = []
        for port in ports:
            socket = self._context.socket(zmq.SUB)
            socket.bind(f"tcp://127.0.0.1:{port}")
            socket.setsockopt(zmq.SUBSCRIBE, topic)
            self._sockets.append(socket)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        poller = zmq.Poller()
        for socket in self._sockets:
            poller.register(socket, zmq.POLLIN)
        while not self._stop.is_set():
            for socket, _ in poller.poll(100):
                _, _, payload = socket.recv_multipart()
                with self._lock:
                    self.indexes[self._sockets.index(socket)].apply(payload)

    def choose(self, prompt: list[int]) -> int:
        with self._lock:
            scores = [(-index.cached_tokens(prompt), self.in_flight[i], i) for i, index in enumerate(self.indexes)]
        return min(scores)[2]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._context.destroy(linger=0)
