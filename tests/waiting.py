"""Polling for a condition that another process or thread makes true, for tests of live servers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str = "condition", interval: float = 0.05) -> T:
    """Polls `predicate()` until it returns something truthy and returns that; fails the test after `timeout` s.

    A metric or state that a server updates after it answered (a gauge, a freed KV block) is read this way: read
    once, it races the server's own bookkeeping."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
