"""Checking grammars the proxy builds with llguidance over a byte-level vocabulary (any text tokenizes)."""

from __future__ import annotations


def byte_tokenizer_in(path: str):
    """llguidance's tokenizer over a byte-level vocabulary written to `path`."""
    from llguidance import LLTokenizer

    from tests.model.tiny_models import write_byte_tokenizer

    write_byte_tokenizer(path)
    with open(f"{path}/tokenizer.json", encoding="utf-8") as f:
        return LLTokenizer(f.read())


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether `grammar` (a llguidance grammar) accepts exactly `text`."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()
