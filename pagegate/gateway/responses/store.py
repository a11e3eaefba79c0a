"""Stored responses: bounded in count, bytes and age, oldest out first; optionally kept in a SQLite file.

A record holds what a later turn needs (`previous_response_id`): the conversation as chat messages, the input
items as the client sent them (GET .../input_items), and the response object (GET /v1/responses/{id}). Each
belongs to the API key that made it; to any other it does not exist.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class StoredResponse:
    id: str
    tenant: str | None
    created_at: float  # time.time()
    conversation: list[dict[str, Any]]  # chat messages up to and including this response's answer
    input_items: list[dict[str, Any]]  # every input item of the conversation, in order
    response: dict[str, Any]

    def encode(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> StoredResponse:
        return cls(**json.loads(text))


class ResponseStore:
    """In memory, in insertion (= creation) order; written through to `path` when given."""

    def __init__(self, max_items: int, max_bytes: int, ttl_s: float, path: str | None = None,
                 on_evict: Callable[[str], None] | None = None) -> None:
        self.max_items, self.max_bytes, self.ttl_s = max_items, max_bytes, ttl_s
        self.on_evict = on_evict
        self._records: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()  # id -> (record, bytes)
        self.num_bytes = 0
        self._db = _open(path) if path else None
        if self._db is not None:
            for (text,) in self._db.execute("SELECT body FROM responses ORDER BY created_at"):
                record = StoredResponse.decode(text)
                self._records[record.id] = (record, len(text.encode()))
                self.num_bytes += len(text.encode())
            self._trim(time.time())

    def __len__(self) -> int:
        return len(self._records)

    def put(self, record: StoredResponse) -> None:
        text = record.encode()
        size = len(text.encode())
        self._drop(record.id)
        self._records[record.id] = (record, size)
        self.num_bytes += size
        if self._db is not None:
            with self._db:
                self._db.execute("INSERT INTO responses VALUES (?, ?, ?)", (record.id, record.created_at, text))
        self._trim(time.time())

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        self._trim(time.time())
        found = self._records.get(response_id)
        return found[0] if found is not None and found[0].tenant == tenant else None

    def delete(self, response_id: str, tenant: str | None) -> bool:
        if self.get(response_id, tenant) is None:
            return False
        self._evict(response_id)
        return True

    def _trim(self, now: float) -> None:
        """Oldest first: past their age, then while over the count or byte bound."""
        while self._records:
            oldest_id, (oldest, _) = next(iter(self._records.items()))
            over = len(self._records) > self.max_items or self.num_bytes > self.max_bytes
            if not over and now - oldest.created_at <= self.ttl_s:
                return
            self._evict(oldest_id)

    def _evict(self, response_id: str) -> None:
        if self._drop(response_id) and self.on_evict is not None:
            self.on_evict(response_id)

    def _drop(self, response_id: str) -> bool:
        found = self._records.pop(response_id, None)
        if found is None:
            return False
        self.num_bytes -= found[1]
        if self._db is not None:
            with self._db:
                self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        return True


def _open(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False)
    db.execute("CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created_at REAL, body TEXT)")
    return db
