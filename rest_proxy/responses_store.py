"""Stored responses for `previous_response_id` and `GET /v1/responses/{id}`: in memory, bounded.

NOTE: the store lives in one proxy process. Behind several replicas a follow-up that names a
`previous_response_id` finds it only on the replica that answered the first request: route a
conversation's requests to one replica (sticky sessions), or send the whole conversation as `input`
with `store: false`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from rest_proxy.protocol import ChatMessageParam


@dataclass(slots=True)
class StoredResponse:
    """A finished response and the conversation it ends (without instructions, which do not carry over)."""

    response: dict
    messages: list[ChatMessageParam]
    created: float = 0.0  # the store's clock when it was put


@dataclass
class ResponseStore:
    """At most `max_entries` responses (least recently used evicted first), each kept `ttl` seconds from when
    it was stored. `max_entries` 0 stores nothing."""

    max_entries: int = 1000
    ttl: float = 3600.0
    clock: Callable[[], float] = time.monotonic
    _by_use: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)  # least recently used first
    _by_age: dict[str, float] = field(default_factory=dict)  # insertion order is age order: oldest first

    def __post_init__(self) -> None:
        if self.max_entries < 0:
            raise ValueError("max_entries must be >= 0")
        if not self.ttl > 0:
            raise ValueError("ttl must be > 0")

    def __len__(self) -> int:
        self._expire()
        return len(self._by_use)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_entries == 0:
            return
        self._expire()
        self.delete(response_id)
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
