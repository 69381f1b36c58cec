"""Stop strings found in streamed text, across any split of the text into deltas.

Text that could still be the start of a stop string is held back::

    emitted so far      | held back (a prefix of some stop) | new delta
    "The answer is 4.\n" | "\n"                               | "User:"   stops=["\n\nUser:"]

The match found is the one that completes first in the character stream (ties: the longest,
which started first), so every chunking of the same text gives the same result.
"""

from __future__ import annotations


class StopStringMatcher:
    """Filters one completion's text deltas for stop strings.

    `feed(delta)` returns `(text safe to emit now, matched stop or None)`. Once a stop
    matched, the text before it has been emitted, the stop string and everything after it are
    dropped (with `include_stop`: the stop string is emitted too, what follows it dropped), and further
    calls return ("", None). `flush()` returns the held-back text when the completion ends for another
    reason. With no stops, text passes straight through.
    """

    def __init__(self, stops: list[str], include_stop: bool = False):
        self.include_stop = include_stop
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stops!r}")
        self.stops = list(dict.fromkeys(stops))  # deduplicated, order kept
        # Longest text that can be held back: one character short of the longest stop.
        self._max_holdback = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.matched: str | None = None

    @property
    def is_finished(self) -> bool:
        """Whether a stop string has matched."""
        return self.matched is not None

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Adds a text delta; returns the text to emit now and the stop string if one completed."""
        if self.matched is not None:
            return "", None
        if not self.stops:
            return delta, None
        text = self._pending + delta
        best_end, best_start, best_stop = -1, -1, None
        for stop in self.stops:
            start = text.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best_stop is None or end < best_end or (end == best_end and start < best_start):
                best_end, best_start, best_stop = end, start, stop
        if best_stop is not None:
            self._pending = ""
            self.matched = best_stop
            return text[:best_end if self.include_stop else best_start], best_stop
        hold = self._holdback_length(text)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], None

    def _holdback_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop."""
        for length in range(min(len(text), self._max_holdback), 0, -1):
            suffix = text[-length:]
            if any(stop.startswith(suffix) for stop in self.stops):
                return length
        return 0

    def flush(self) -> str:
        """Returns the held-back text (the completion ended without matching a stop)."""
        text, self._pending = self._pending, ""
        return text if self.matched is None else ""
