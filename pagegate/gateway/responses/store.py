"""Stored responses: bounded in count, bytes and age, oldest out first; optionally kept in a SQLite file.

A stored response's conversation is a chain of turns: each turn holds only what it added (the chat messages of
its input and answer, the input items it was sent, its output items) and links to the turn it continued. A later
turn (`previous_response_id`) walks the links, so a conversation's items are stored once, not once per turn.
A turn lives while a stored response ends on it or a living turn continues it (reference counted): deleting or
evicting a response keeps the turns its continuations still need. Each response belongs to the API key that
made it; to any other it does not exist.

The byte bound counts what the store really holds in memory: each object a record and a turn keep, measured with
sys.getsizeof (the items as their encoded JSON, the chat messages object by object: `deep_size`), plus the
index's entry. Encoding, measuring and SQLite writes run in one writer thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sqlite3
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

Item = dict[str, Any]


@dataclass(eq=False, slots=True)
class Turn:
    """What one response added to its conversation; `parent` is the turn it continued (None: the first).

    NOTE: the items are kept as their JSON (UTF-8), decoded when read: one bytes object instead of a dict, lists and
    strings per item takes ~1/6 of the memory and is nothing the garbage collector walks (a store of a million
    item objects made each full collection stall the event loop for hundreds of milliseconds). The chat messages
    stay objects: every continuation renders them."""

    id: str  # the response that made it
    parent: Turn | None
    messages: list[Item]  # chat messages: this turn's input and its answer
    input_json: bytes  # the input items it was sent, with ids
    output_json: bytes  # its response's output items
    size: int = 0  # bytes it holds
    refs: int = 0  # stored responses that end on it + stored turns that continue it
    stored: bool = False

    def chain(self) -> list[Turn]:
        """The conversation's turns, first to this one."""
        turns: list[Turn] = []
        turn: Turn | None = self
        while turn is not None:
            turns.append(turn)
            turn = turn.parent
        turns.reverse()
        return turns

    def input_items(self) -> list[Item]:
        return json.loads(self.input_json)

    def output(self) -> list[Item]:
        return json.loads(self.output_json)


@dataclass(eq=False, slots=True)
class StoredResponse:
    id: str
    tenant: str | None
    created_at: float  # time.time()
    turn: Turn  # the last turn of its conversation, its own
    response_json: bytes  # the response object without its output (that is the turn's)
    size: int = field(default=0)

    @classmethod
    def new(cls, response_id: str, tenant: str | None, previous: StoredResponse | None, messages: list[Item],
            input_items: list[Item], response: dict[str, Any]) -> StoredResponse:
        """A response continuing `previous` (None: a new conversation) with this turn's messages and items,
        encoded and measured (the slow part: ResponseStore.add runs it on its writer thread)."""
        rest = {key: value for key, value in response.items() if key != "output"}
        turn = Turn(response_id, previous.turn if previous is not None else None, messages, _encode(input_items),
                    _encode(response.get("output", [])))
        _measure_turn(turn)
        record = cls(response_id, tenant, time.time(), turn, _encode(rest))
        _measure_record(record)
        return record

    @property
    def conversation(self) -> list[Item]:
        """Chat messages up to and including this response's answer."""
        return [message for turn in self.turn.chain() for message in turn.messages]

    def response_object(self) -> dict[str, Any]:
        return {**json.loads(self.response_json), "output": self.turn.output()}

    def input_items(self, newest_first: bool = False) -> Iterator[Item]:
        """Every input item of the conversation in order (earlier turns' outputs among them), decoded a turn at
        a time as the iteration reaches it."""
        turns = self.turn.chain()
        groups = [blob for turn in turns[:-1] for blob in (turn.input_json, turn.output_json)]
        groups.append(turns[-1].input_json)
        if not newest_first:
            return (item for blob in groups for item in json.loads(blob))
        return (item for blob in reversed(groups) for item in reversed(json.loads(blob)))


# -- measuring ------------------------------------------------------------------------------------------
def deep_size(*values: object) -> int:
    """Bytes the objects reachable from `values` occupy (dicts, lists, strings, numbers), each object once.

    NOTE: counted per object, shared objects once per call: a dict key like "type" is one string shared by every
    item of a turn (pydantic and json.loads both reuse it), so it costs once, as it does in memory."""
    seen: set[int] = set()
    stack: list[object] = list(values)
    total = 0
    while stack:
        value = stack.pop()
        if value is None or value is True or value is False or id(value) in seen:
            continue
        seen.add(id(value))
        total += sys.getsizeof(value)
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return total


# What a record costs beyond its objects: the index's entry (an ordered dict's slot and link).
_RECORD_OVERHEAD = 104


def _measure_record(record: StoredResponse) -> None:
    record.size = (sys.getsizeof(record) + deep_size(record.id, record.tenant) + sys.getsizeof(record.response_json)
                   + _RECORD_OVERHEAD)


def _measure_turn(turn: Turn) -> None:
    turn.size = (sys.getsizeof(turn) + deep_size(turn.messages) + sys.getsizeof(turn.input_json)
                 + sys.getsizeof(turn.output_json))


def _encode(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


# -- the store ------------------------------------------------------------------------------------------
class ResponseStore:
    """In memory, in insertion (= creation) order; written through to `path` when given.

    The index (records, turns' counts, the byte total) is only touched on the caller's thread (the event
    loop); the writer thread encodes and measures records and runs every SQLite statement, in the order they
    were asked."""

    def __init__(self, max_items: int, max_bytes: int, ttl_s: float, path: str | None = None,
                 on_evict: Callable[[str], None] | None = None) -> None:
        self.max_items, self.max_bytes, self.ttl_s = max_items, max_bytes, ttl_s
        self.on_evict = on_evict
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="pagegate-responses")
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()  # orders the writer's jobs with `flush`
        self._db = _open(path) if path else None
        if self._db is not None:
            self._load(self._db)

    def __len__(self) -> int:
        return len(self._records)

    # -- adding ---------------------------------------------------------------------------------------
    async def add(self, response_id: str, tenant: str | None, previous: StoredResponse | None,
                  messages: list[Item], input_items: list[Item], response: dict[str, Any]) -> StoredResponse:
        """Store a new response (StoredResponse.new's arguments): encoded and measured on the writer thread, then
        indexed here, written there."""
        make = functools.partial(StoredResponse.new, response_id, tenant, previous, messages, input_items, response)
        record = await asyncio.get_running_loop().run_in_executor(self._writer, make)
        self._insert(record)
        return record

    def put(self, record: StoredResponse) -> None:
        """Store a response made already (tests, tools)."""
        self._insert(record)

    def _insert(self, record: StoredResponse, loading: bool = False) -> None:
        self._drop(record.id)
        self._records[record.id] = record
        self.num_bytes += record.size
        revived = self._hold(record.turn)
        if loading:
            return  # in the file already; trimmed once all are in
        if self._db is not None:
            self._write(_write_rows, record, revived)
        self._trim(time.time())

    def _hold(self, turn: Turn) -> list[Turn]:
        """One more reference to `turn`; a turn not stored (new, or freed while a continuation of it ran) is
        stored again with the turns it continues. Returns the turns newly stored."""
        revived: list[Turn] = []
        current: Turn | None = turn
        while current is not None:
            current.refs += 1
            if current.stored:
                break
            current.stored = True
            self.num_bytes += current.size
            revived.append(current)
            current = current.parent
        return revived

    def _release(self, turn: Turn) -> None:
        """One reference less; a turn nobody needs is freed, and with it its hold on the turn it continued."""
        current: Turn | None = turn
        freed: list[str] = []
        while current is not None and current.stored:
            current.refs -= 1
            if current.refs > 0:
                break
            current.stored = False
            self.num_bytes -= current.size
            freed.append(current.id)
            current = current.parent
        if freed and self._db is not None:
            self._write(_delete_turns, freed)

    # -- reading --------------------------------------------------------------------------------------
    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        self._trim(time.time())
        found = self._records.get(response_id)
        return found if found is not None and found.tenant == tenant else None

    def delete(self, response_id: str, tenant: str | None) -> bool:
        if self.get(response_id, tenant) is None:
            return False
        self._evict(response_id)
        return True

    # -- bounds ---------------------------------------------------------------------------------------
    def _trim(self, now: float) -> None:
        """Oldest first: past their age, then while over the count or byte bound."""
        while self._records:
            oldest_id, oldest = next(iter(self._records.items()))
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
        self.num_bytes -= found.size
        if self._db is not None:
            self._write(_delete_record, response_id)
        self._release(found.turn)
        return True

    # -- the SQLite file ------------------------------------------------------------------------------
    def _write(self, job: Callable[..., None], *args: Any) -> None:
        db = self._db
        assert db is not None
        with self._lock:
            self._pending = self._writer.submit(job, db, *args)

    def flush(self) -> None:
        """Wait until every write asked for so far is in the file."""
        with self._lock:
            pending = self._pending
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)

    def _load(self, db: sqlite3.Connection) -> None:
        """Records oldest first, each on its chain of turns; turns and records nobody needs any more are deleted."""
        _migrate(db)
        turns: dict[str, Turn] = {}
        rows = {row[0]: row[1:] for row in db.execute(
            "SELECT id, parent, messages, input_items, output FROM response_turns")}
        for response_id, tenant, created_at, body in db.execute(
                "SELECT id, tenant, created_at, response FROM response_records ORDER BY created_at").fetchall():
            turn = _turn_of(response_id, rows, turns)
            if turn is None:
                continue  # its chain is broken: nothing to continue from
            record = StoredResponse(response_id, tenant, created_at, turn, bytes(body))
            _measure_record(record)
            self._insert(record, loading=True)
        unused = [turn_id for turn_id in rows if turn_id not in turns or not turns[turn_id].stored]
        orphans = [record_id for record_id, in db.execute("SELECT id FROM response_records")
                   if record_id not in self._records]
        with db:
            db.executemany("DELETE FROM response_turns WHERE id = ?", [(turn_id,) for turn_id in unused])
            db.executemany("DELETE FROM response_records WHERE id = ?", [(rid,) for rid in orphans])
        self._trim(time.time())


TurnRow = tuple[str | None, str, bytes, bytes]  # parent, messages, input items, output


def _turn_of(turn_id: str, rows: dict[str, TurnRow], turns: dict[str, Turn]) -> Turn | None:
    """The turn `turn_id` with its parents, made once each (None if one is missing from the file)."""
    missing: list[str] = []
    current: str | None = turn_id
    while current is not None and current not in turns:
        if current not in rows:
            return None
        missing.append(current)
        current = rows[current][0]
    parent = turns[current] if current is not None else None
    for made in reversed(missing):
        _, messages, input_json, output_json = rows[made]
        turn = Turn(made, parent, json.loads(messages), bytes(input_json), bytes(output_json))
        _measure_turn(turn)
        turns[made] = parent = turn
    return parent


def _write_rows(db: sqlite3.Connection, record: StoredResponse, turns: list[Turn]) -> None:
    with db:
        db.executemany("INSERT OR REPLACE INTO response_turns VALUES (?, ?, ?, ?, ?)",
                       [(turn.id, turn.parent.id if turn.parent else None, _encode(turn.messages).decode(),
                         turn.input_json, turn.output_json) for turn in turns])
        db.execute("INSERT OR REPLACE INTO response_records VALUES (?, ?, ?, ?)",
                   (record.id, record.tenant, record.created_at, record.response_json))


def _delete_turns(db: sqlite3.Connection, turn_ids: list[str]) -> None:
    with db:
        db.executemany("DELETE FROM response_turns WHERE id = ?", [(turn_id,) for turn_id in turn_ids])


def _delete_record(db: sqlite3.Connection, response_id: str) -> None:
    with db:
        db.execute("DELETE FROM response_records WHERE id = ?", (response_id,))


def _open(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False)
    with db:
        db.execute("CREATE TABLE IF NOT EXISTS response_turns "
                   "(id TEXT PRIMARY KEY, parent TEXT, messages TEXT, input_items BLOB, output BLOB)")
        db.execute("CREATE TABLE IF NOT EXISTS response_records "
                   "(id TEXT PRIMARY KEY, tenant TEXT, created_at REAL, response BLOB)")
    return db


def _migrate(db: sqlite3.Connection) -> None:
    """A file of the earlier layout (one row per response, its whole conversation in it): each response
    becomes a record on a turn of its own."""
    if db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'responses'").fetchone() is None:
        return
    with db:
        for (text,) in db.execute("SELECT body FROM responses").fetchall():
            old = json.loads(text)
            response = dict(old["response"])
            output = response.pop("output", [])
            db.execute("INSERT OR REPLACE INTO response_turns VALUES (?, ?, ?, ?, ?)",
                       (old["id"], None, _encode(old["conversation"]).decode(), _encode(old["input_items"]),
                        _encode(output)))
            db.execute("INSERT OR REPLACE INTO response_records VALUES (?, ?, ?, ?)",
                       (old["id"], old["tenant"], old["created_at"], _encode(response)))
        db.execute("DROP TABLE responses")
