"""The logits processors: each a small named type built for one step, applied in a fixed order.

Each builder returns None when no row of the step needs its processor, so a batch without
penalties, biases or formats costs nothing here. `apply_processors` runs them in `ORDER`::

    FormatMask -> AllowedTokens -> BadWords -> LogitBias -> MinTokensMask -> Penalties (repetition, then
    frequency/presence)

Every `apply` takes logits [N, V] float32 that the caller owns (it may modify them in place) and
returns the processed logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inference_service.engine.structured_output import token_bitmask, unpack_bitmask
from inference_service.engine.transfer import to_device


@dataclass(slots=True)
class FormatMask:
    """Structured output: tokens outside each constrained row's format are set to -inf."""

    rows: torch.Tensor  # [R] int64 batch rows
    allowed: torch.Tensor  # [R, V] bool

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[self.rows] = logits[self.rows].masked_fill(~self.allowed, float("-inf"))
        return logits


@dataclass(slots=True)
class AllowedTokens:
    """`allowed_token_ids`: every other token of each such row set to -inf."""

    rows: torch.Tensor | None  # [A] int64 batch rows; None = every row
    allowed: torch.Tensor  # [A, V] bool

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return logits.masked_fill_(~self.allowed, float("-inf"))
        logits[self.rows] = logits[self.rows].masked_fill(~self.allowed, float("-inf"))
        return logits


@dataclass(slots=True)
class BadWords:
    """`bad_words`: the last token of each bad word whose other tokens end the output so far, set to -inf
    (a one-token word always)."""

    rows: torch.Tensor  # [M] int64 batch rows
    token_ids: torch.Tensor  # [M] int64

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[self.rows, self.token_ids] = float("-inf")
        return logits


@dataclass(slots=True)
class LogitBias:
    """Each row's bias added to its logits (0 for tokens and rows without one)."""

    rows: torch.Tensor | None  # [B] int64 batch rows; None = every row
    bias: torch.Tensor  # [B, V] float32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            logits += self.bias
        else:
            logits[self.rows] += self.bias
        return logits


@dataclass(slots=True)
class MinTokensMask:
    """Stop and EOS ids of rows short of `min_tokens`, set to -inf."""

    rows: torch.Tensor  # [M] int64 batch rows
    token_ids: torch.Tensor  # [M] int64

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[self.rows, self.token_ids] = float("-inf")
        return logits


@dataclass(slots=True)
class Penalties:
    """Repetition penalty over prompt and output tokens, then frequency and presence penalties over
    output counts, for the K rows that have any (rows without one are left exactly as they were)."""

    rows: torch.Tensor | None  # [K] int64 batch rows; None = every row
    repetition: torch.Tensor | None  # [K, 1] float32 (1 = off); None when no row has one
    seen: torch.Tensor | None  # [K, V] bool, prompt or output token; with `repetition`
    frequency: torch.Tensor | None  # [K, 1] float32; None when no row has frequency/presence
    presence: torch.Tensor | None  # [K, 1] float32; with `frequency`
    counts: torch.Tensor | None  # [K, V] float32 output token counts; with `frequency`

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        x = logits if self.rows is None else logits[self.rows]  # [K, V]
        if self.repetition is not None:
            penalized = torch.where(x > 0, x / self.repetition, x * self.repetition)  # [K, V]
            x = torch.where(self.seen, penalized, x)
        if self.frequency is not None:
            x = x - (self.frequency * self.counts + self.presence * (self.counts > 0).float())
        if self.rows is None:
            return x
        logits[self.rows] = x
        return logits


LogitsProcessor = FormatMask | AllowedTokens | BadWords | LogitBias | MinTokensMask | Penalties
ORDER = (FormatMask, AllowedTokens, BadWords, LogitBias, MinTokensMask, Penalties)


def apply_processors(logits: torch.Tensor, processors: Sequence[LogitsProcessor]) -> torch.Tensor:
    """Runs `processors` (at most one of each type, in `ORDER`) over logits [N, V] float32 that the
    caller owns; returns the processed logits."""
    assert [type(p) for p in processors] == [t for t in ORDER if any(type(p) is t for p in processors)], processors
    for processor in processors:
        logits = processor.apply(logits)
    return logits


def build_format_mask(grammars: Sequence[Any] | None, vocab_size: int, device) -> FormatMask | None:
    """`grammars[i]`: row i's structured-output matcher or None. Computes the masks on the host from
    each matcher's state, so the matchers must have consumed every earlier token."""
    rows = [i for i, g in enumerate(grammars or ()) if g is not None]
    if not rows:
        return None
    bitmask = token_bitmask([grammars[i] for i in rows], vocab_size).to(device)  # [R, W]
    return FormatMask(to_device(rows, torch.long, device), unpack_bitmask(bitmask, vocab_size))


def banned_last_tokens(bad_words_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens a row's bad words ban next (vLLM's rule): a word's last token when its other tokens are
    the last tokens of the output (a one-token word: always)."""
    banned = set()
    for word in bad_words_token_ids:
        prefix = len(word) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or list(output_token_ids[-prefix:]) == list(word[:prefix]):
            banned.add(word[-1])
    return sorted(banned)


def build_bad_words(rows: Sequence[int], banned: Sequence[Sequence[int]], device) -> BadWords | None:
    """`banned[j]`: the token ids banned in batch row `rows[j]` this step."""
    row_ids = [row for row, ids in zip(rows, banned) for _ in range(len(ids))]
    if not row_ids:
        return None
    token_ids = [t for ids in banned for t in ids]
    return BadWords(to_device(row_ids, torch.long, device), to_device(token_ids, torch.long, device))


def build_min_tokens_mask(rows: Sequence[int], banned: Sequence[Sequence[int]], device) -> MinTokensMask | None:
    """`banned[j]`: the token ids masked in batch row `rows[j]` (rows with none are skipped)."""
    row_ids = [row for row, ids in zip(rows, banned) for _ in range(len(ids))]
    if not row_ids:
        return None
    token_ids = [t for ids in banned for t in ids]
    return MinTokensMask(to_device(row_ids, torch.long, device), to_device(token_ids, torch.long, device))
