"""Stored responses for `previous_response_id` and `GET /v1/responses/{id}`: bounded by count and by age.

One interface, `ResponseStore`, chosen at startup (`open_response_store`): a single proxy process keeps
its responses in memory (`MemoryResponseStore`); the workers of one `--workers N` proxy share one SQLite
file (`SqliteResponseStore`) in a private folder their parent makes and removes at exit, so a follow-up
finds its previous response whichever worker the kernel hands the connection to.

NOTE: the store is still per proxy. Behind several replicas a follow-up that names a
`previous_response_id` finds it only on the replica that answered the first request: route a
conversation's requests to one replica (sticky sessions), or send the whole conversation as `input`
with `store: false`.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from rest_proxy.protocol import ChatMessageParam

# NOTE: writers wait for each other at most this long; a transaction here takes microseconds.
_BUSY_TIMEOUT_S = 5.0


@dataclass(slots=True)
class StoredResponse:
    """A finished response and the conversation it ends (without instructions, which do not carry over)."""

    response: dict
    messages: list[ChatMessageParam]
    created: float = 0.0  # the store's clock when it was put


class ResponseStore(Protocol):
    """At most `max_entries` responses (least recently used evicted first), each kept `ttl` seconds of
    `clock` from when it was stored, whether used or not. `max_entries` 0 stores nothing."""

    clock: Callable[[], float]

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Stores `entry` (replacing one of the same id) as the most recently used; sets `entry.created`."""

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None when it was never stored, evicted, expired or deleted."""

    def delete(self, response_id: str) -> bool:
        """Removes the entry; whether there was one (an expired one counts as gone)."""

    def __len__(self) -> int:
        """Entries stored and not expired."""


def open_response_store(max_entries: int, ttl: float, path: str | None = None) -> ResponseStore:
    """In memory when `path` is None; else the SQLite file at `path`, shared with every process opening it."""
    if path is None:
        return MemoryResponseStore(max_entries, ttl)
    return SqliteResponseStore(path, max_entries, ttl)


def _check_bounds(max_entries: int, ttl: float) -> None:
    if max_entries < 0:
        raise ValueError("max_entries must be >= 0")
    if not ttl > 0:
        raise ValueError("ttl must be > 0")


@dataclass
class MemoryResponseStore:
    """`ResponseStore` in this process's memory (the entries themselves, not copies)."""

    max_entries: int = 1000
    ttl: float = 3600.0
    clock: Callable[[], float] = time.monotonic
    _by_use: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)  # least recently used first
    _by_age: dict[str, float] = field(default_factory=dict)  # insertion order is age order: oldest first

    def __post_init__(self) -> None:
        _check_bounds(self.max_entries, self.ttl)

    def __len__(self) -> int:
        self._expire()
        return len(self._by_use)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_entries == 0:
            return
        self._expire()
        self._remove(response_id)
        entry.created = self.clock()
        self._by_use[response_id] = entry
        self._by_age[response_id] = entry.created
        while len(self._by_use) > self.max_entries:
            oldest, _ = self._by_use.popitem(last=False)
            del self._by_age[oldest]

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._by_use.get(response_id)
        if entry is not None:
            self._by_use.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._remove(response_id)

    def _remove(self, response_id: str) -> bool:
        if self._by_use.pop(response_id, None) is None:
            return False
        del self._by_age[response_id]
        return True

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl
        while self._by_age:
            response_id, created = next(iter(self._by_age.items()))
            if created > deadline:
                break
            del self._by_age[response_id]
            del self._by_use[response_id]


_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,   -- clock() at put: the wall clock, which every process shares
    used INTEGER NOT NULL,   -- larger: more recently used
    response TEXT NOT NULL,  -- JSON
    messages TEXT NOT NULL   -- JSON: a list of ChatMessageParam, only the fields that were set
);
CREATE INDEX IF NOT EXISTS responses_by_use ON responses (used);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created);
"""
_NEXT_USE = "COALESCE((SELECT MAX(used) FROM responses), 0) + 1"


@dataclass
class SqliteResponseStore:
    """`ResponseStore` in a SQLite file (WAL mode) that several processes open at once: one table, each
    call one short write transaction. Entries are JSON: `get` returns a copy, equal to what was put.

    NOTE: the calls are synchronous, on the event loop, without a thread hop: the file is local, each call
    touches a few B-tree pages without an fsync (synchronous=OFF: the file lives only as long as the proxy,
    so a power cut loses nothing that would outlive it), and processes wait for each other on flock, which
    hands the lock on at once. Measured, a call costs about what handing it to a thread costs, and the JSON
    encoding, the bulk of a long response's time, holds the GIL in a thread too (docs/proxy.md, "Stored
    responses", has the numbers)."""

    path: str
    max_entries: int = 1000
    ttl: float = 3600.0
    clock: Callable[[], float] = time.time
    _db: sqlite3.Connection = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    _lock_fd: int = field(init=False, repr=False)  # `path`.lock: the processes' write lock

    def __post_init__(self) -> None:
        _check_bounds(self.max_entries, self.ttl)
        self._lock_fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        # isolation_level None: transactions are the explicit BEGIN IMMEDIATE of _transaction.
        # check_same_thread False: _lock serializes the callers (tests read len() from another thread).
        self._db = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                                   check_same_thread=False)
        with self._lock, _flocked(self._lock_fd):  # the first process makes it a WAL file, the others see one
            self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=OFF")
        with self._transaction(expire=False):
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)

    def __len__(self) -> int:
        with self._transaction():
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_entries == 0:
            return
        response = json.dumps(entry.response, separators=(",", ":"))
        messages = json.dumps([m.model_dump(mode="json", exclude_unset=True) for m in entry.messages],
                              separators=(",", ":"))
        with self._transaction() as now:
            entry.created = now
            self._db.execute(f"INSERT OR REPLACE INTO responses VALUES (?, ?, {_NEXT_USE}, ?, ?)",
                       (response_id, entry.created, response, messages))
            self._db.execute("DELETE FROM responses WHERE id IN "
                       "(SELECT id FROM responses ORDER BY used DESC LIMIT -1 OFFSET ?)", (self.max_entries,))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._transaction():
            rows = self._db.execute(f"UPDATE responses SET used = {_NEXT_USE} WHERE id = ? "
                              "RETURNING created, response, messages", (response_id,)).fetchall()
        if not rows:
            return None
        created, response, messages = rows[0]
        return StoredResponse(response=json.loads(response), created=created,
                              messages=[ChatMessageParam.model_validate(m) for m in json.loads(messages)])

    def delete(self, response_id: str) -> bool:
        with self._transaction():
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def close(self) -> None:
        self._db.close()
        os.close(self._lock_fd)

    @contextmanager
    def _transaction(self, expire: bool = True) -> Iterator[float]:
        """One write transaction (IMMEDIATE: it takes the write lock first, so two processes never both
        read and then both try to upgrade), with the expired entries gone at its start; yields clock()."""
        # NOTE: processes queue on flock, which wakes the next one as soon as the lock is released,
        # rather than on SQLite's busy handler, which sleeps 1, 2, 5, ... 100 ms between retries (on the
        # event loop) and can keep missing the lock while other processes write.
        with self._lock, _flocked(self._lock_fd):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                now = self.clock()
                if expire:
                    self._db.execute("DELETE FROM responses WHERE created <= ?", (now - self.ttl,))
                yield now
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")


@contextmanager
def _flocked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
