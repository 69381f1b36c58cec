"""Incremental detokenization: token ids in, UTF-8-safe text deltas out, O(1) per token.

Only `tokenizer.decode(ids, skip_special_tokens=...)` is used, on a small window of the newest
output tokens. The window keeps a few already-emitted tokens in front as context, because
decoding is not a per-token concatenation (SentencePiece drops the leading space of the first
token; byte-level BPE tokens may carry part of a UTF-8 character)::

    output ids:  ... | t5 t6 | t7 t8 t9
                     ^prefix ^last boundary
    decode(window) = "<text of t5 t6, already emitted>" + "<new text>"
                                          num_emitted ^

A delta is the window's text past what was already emitted, minus any trailing U+FFFD run: a
U+FFFD at the very end may be an unfinished multi-byte character that the next token
completes, so it is held back until more tokens arrive or `flush()` is called. When the
window ends on a whole character, the window slides forward.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"
# A window that cannot slide (its text keeps ending in U+FFFD, which only invalid byte
# streams do) is split forcibly once it holds this many tokens, to keep decoding O(1).
_MAX_WINDOW = 8
# An unfinished UTF-8 character has at most 3 bytes, so spans at most 3 tokens.
_MAX_PARTIAL_TOKENS = 3
# Recent token offsets where the text ended on a whole character (window start candidates).
_NUM_BOUNDARIES = 4


class DecodesTokens(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one completion's output tokens into text deltas as they are generated.

    The concatenation of all `append` deltas plus `flush()` equals
    `tokenizer.decode(output_token_ids, skip_special_tokens=skip_special_tokens)`, and no
    delta ends inside a multi-byte character. The text depends only on the output tokens:
    `prompt_token_ids` is not used as decoding context, so a streamed completion reads exactly
    as the same ids decoded at once (for example through the Tokenize RPC).
    """

    def __init__(self, tokenizer: DecodesTokens, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = []  # output token ids so far, less those that decode to nothing
        # NOTE: a run of tokens that add no text (EOS under ignore_eos, other skipped specials,
        # padded vocabulary rows) gives the window no boundary to slide to: kept, they would make
        # every later decode longer (quadratic in the output length). They are dropped instead,
        # which no decode can tell apart.
        self._decodes_to_nothing = getattr(tokenizer, "decodes_to_nothing", None)
        self._prefix_offset = 0  # window start
        # Offsets, newest last, where the text ended on a whole character: decoding does not
        # cross them, so the window may start there.
        self._boundaries = [0]
        self._num_emitted = 0  # characters of the window's text already emitted

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Adds one output token; returns the text that became final (possibly "")."""
        if self._decodes_to_nothing is not None and self._decodes_to_nothing(token_id, self.skip_special_tokens):
            return ""
        self.token_ids.append(token_id)
        num_tokens = len(self.token_ids)
        text = self._decode(self._prefix_offset)
        stable = len(text.rstrip(_REPLACEMENT))
        delta = text[self._num_emitted:stable] if stable > self._num_emitted else ""
        self._num_emitted = max(self._num_emitted, stable)

        if stable == len(text):
            # Ends on a whole character: slide the window start to the newest earlier boundary
            # whose tokens decode to some text, so emitted tokens stay in front as context.
            # NOTE: context that decodes to "" (skipped special tokens, a lone SentencePiece
            # space) would let the next token's leading space be dropped; skip such starts.
            # A window whose text is "" has no such start (its suffixes decode to "" too).
            for start in reversed(self._boundaries if text else ()):
                if start <= self._prefix_offset:
                    break
                context = self._decode(start)
                if context:
                    self._prefix_offset, self._num_emitted = start, len(context)
                    break
            self._boundaries = self._boundaries[1 - _NUM_BOUNDARIES:] + [num_tokens]
        elif num_tokens - self._prefix_offset > _MAX_WINDOW:
            self._split_window(text)
        return delta

    def _split_window(self, text: str) -> None:
        """Moves the window start to a recent token boundary that decoding does not cross.

        NOTE: only reached while the text keeps ending in U+FFFD (invalid byte sequences).
        A boundary k is safe when decode(window[:k]) + decode(window[k:]) == decode(window):
        then nothing after k can change the text before it.
        """
        num_tokens = len(self.token_ids)
        low = max(self._prefix_offset, num_tokens - 1 - _MAX_PARTIAL_TOKENS)
        for k in range(num_tokens - 1, low, -1):
            head = self._decode(self._prefix_offset, k)
            if len(head) <= self._num_emitted and head + self._decode(k) == text:
                self._prefix_offset = k
                self._boundaries = [k]
                self._num_emitted -= len(head)
                return

    def flush(self) -> str:
        """Releases held-back text (trailing U+FFFD of an unfinished character) at the end."""
        text = self._decode(self._prefix_offset)
        delta = text[self._num_emitted:]
        self._num_emitted = max(self._num_emitted, len(text))
        return delta
