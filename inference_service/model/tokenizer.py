"""`Tokenizer`: a `tokenizers` backend plus the special-token facts and chat template around it.

Built either from a Hugging Face folder (`tokenizer.json`, `tokenizer_config.json`, ...) or from a
GGUF file's `tokenizer.ggml.*` metadata, in which case the tokenizer — byte-level BPE (`gpt2`) or
SentencePiece BPE with byte fallback (`llama`) — is reconstructed the way transformers does it for the
same file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from inference_service.errors import UnsupportedModelError
from inference_service.model.chat_template import render_chat_template

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp `tokenizer.ggml.pre` -> the split regex its merges were learned with. Anything else gets
# GPT-2's byte-level regex, as transformers does.
_GGUF_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "tekken"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


_BYTE_ENCODER = bytes_to_unicode()
_BYTE_DECODER = {char: byte for byte, char in _BYTE_ENCODER.items()}


class Tokenizer:
    """Text <-> token ids for one model, its special tokens, and its chat template.

    `encode(text, add_special_tokens=None)` adds the model's BOS when the model asks for it (None
    means yes); pass False for text rendered by `apply_chat_template`, which already carries it."""

    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None, eos_token: str | None,
                 pad_token: str | None = None, unk_token: str | None = None, add_bos_token: bool = False,
                 add_eos_token: bool = False, chat_template: str | None = None,
                 extra_eos_token_ids: tuple[int, ...] = (), byte_level: bool = True):
        self._backend = backend
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.pad_token_id = self._id_of(pad_token)
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.chat_template = chat_template
        eos_ids = ([self.eos_token_id] if self.eos_token_id is not None else []) + list(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._byte_level = byte_level
        special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        special |= {i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id, self._id_of(unk_token))
                    if i is not None}
        self.all_special_ids: list[int] = sorted(special)
        # What `decode(..., skip_special_tokens=True)` drops: the backend's special tokens.
        self._skipped_special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._max_token_id = max(backend.get_vocab(with_added_tokens=True).values())
        self._token_bytes: dict[int, bytes] = {}

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool | None = None, max_length: int | None = None) -> list[int]:
        """Token ids of `text`; special-token text such as `<|im_start|>` maps to its single id.

        With `max_length`, the text is cut from the right so that it fits together with its special
        tokens (HF `truncation=True`: `[CLS] a b [SEP]`, never `[CLS] a b c`)."""
        add = True if add_special_tokens is None else add_special_tokens
        encoding = self._backend.encode(text, add_special_tokens=add)
        if max_length is not None and len(encoding.ids) > max_length:
            num_special = len(self.encode("", add_special_tokens=add))
            encoding = self._backend.encode(text, add_special_tokens=False)
            encoding.truncate(max(max_length - num_special, 0))
            encoding = self._backend.post_process(encoding, add_special_tokens=add)
        ids = encoding.ids
        if add and self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        if add and self.add_eos_token and self.eos_token_id is not None and ids[-1:] != [self.eos_token_id]:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The whole tokenizer as `tokenizer.json` text (what grammar engines read the vocabulary from)."""
        return self._backend.to_str()

    def decodes_to_nothing(self, token_id: int, skip_special_tokens: bool) -> bool:
        """Whether `token_id` adds no text to any `decode` it is part of: an id past the vocabulary
        (a model's padded embedding rows) or, when they are skipped, a special token."""
        return (token_id > self._max_token_id or token_id < 0
                or (skip_special_tokens and token_id in self._skipped_special_ids))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._backend.id_to_token(i) for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for (a piece of UTF-8, possibly not a whole character)."""
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary")
        if self._byte_level and all(char in _BYTE_DECODER for char in token):
            raw = bytes(_BYTE_DECODER[char] for char in token)
        elif not self._byte_level and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            raw = bytes([int(token[3:5], 16)])  # sentencepiece byte-fallback piece
        elif not self._byte_level:
            raw = token.replace("\u2581", " ").encode("utf-8")
        else:
            raw = token.encode("utf-8")  # an added token spelled outside the byte alphabet
        self._token_bytes[token_id] = raw
        return raw

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            **template_kwargs: Any) -> str:
        """The prompt text for a conversation (HF `apply_chat_template(..., tokenize=False)`).

        Raises `InvalidRequestError` for malformed messages (naming e.g. `chat.messages[1].role`), for a
        model without a chat template, and for errors the template raises."""
        from inference_service.errors import InvalidRequestError

        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template", field="chat")
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # continuing a message and opening a new turn are exclusive
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                   "pad_token": self.pad_token, "unk_token": self.unk_token}
        return render_chat_template(self.chat_template, messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    special_tokens=special, **template_kwargs)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer described by `tokenizer.ggml.*` metadata."""
        kind = meta.get("tokenizer.ggml.model")
        if kind == "llama":
            return cls._from_gguf_sentencepiece(meta)
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE), "
                f"'llama' (SentencePiece)")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        alphabet = set(_BYTE_ENCODER.values())
        # Tokens written in plain text (outside the byte alphabet) are respelled byte by byte.
        vocab = {token if set(token) <= alphabet else "".join(_BYTE_ENCODER[b] for b in token.encode("utf-8")): i
                 for i, token in enumerate(tokens)}
        merges = [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges") or []]
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = meta.get("tokenizer.ggml.pre")
        if pre in _GGUF_PRE_SPLITS:
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_GGUF_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        # A "control" token spelled outside the byte alphabet is a converter mislabel and is left alone
        # (as transformers does).
        return cls._from_gguf_backend(meta, backend, tokens, token_types, lambda tok: set(tok) <= alphabet,
                                      add_bos_default=False, byte_level=True)

    @classmethod
    def _from_gguf_sentencepiece(cls, meta: dict[str, Any]) -> Tokenizer:
        """SentencePiece as a BPE with byte fallback (`<0x41>` pieces for bytes outside the
        vocabulary), "▁" for spaces and one prepended to the text, as transformers' LlamaTokenizer
        builds it from a GGUF: merges from the file, or derived from the vocabulary and its scores."""
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        vocab = {token: i for i, token in enumerate(tokens)}
        if meta.get("tokenizer.ggml.merges"):
            merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
        else:
            scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
            merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(content=" ", left=1)])
        # NOTE: llama.cpp (and transformers) add BOS to a SentencePiece vocabulary unless told not to.
        return cls._from_gguf_backend(meta, backend, tokens, token_types, lambda tok: True,
                                      add_bos_default=True, byte_level=False)

    @classmethod
    def _from_gguf_backend(cls, meta: dict[str, Any], backend: BackendTokenizer, tokens: list[str],
                           token_types: list[int], is_spelled: Callable[[str], bool], *, add_bos_default: bool,
                           byte_level: bool) -> Tokenizer:
        """The parts of a GGUF tokenizer both vocabularies share: named tokens, control tokens as specials,
        user-defined tokens kept whole (those `is_spelled` in the vocabulary's alphabet), extra EOS ids."""

        def token_at(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        named = {name: token_at(key) for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                                                        ("unk", "unknown_token_id"), ("pad", "padding_token_id"))}
        specials = [tok for tok, kind in zip(tokens, token_types) if kind == _CONTROL and is_spelled(tok)]
        specials += [tok for tok in named.values() if tok is not None and tok not in specials]
        backend.add_special_tokens([AddedToken(tok, normalized=False, special=True) for tok in specials])
        user_defined = [tok for tok, kind in zip(tokens, token_types) if kind == _USER_DEFINED and is_spelled(tok)]
        if user_defined:
            backend.add_tokens([AddedToken(tok, normalized=False, special=False) for tok in user_defined])
        # llama.cpp also ends generation at EOT / EOM tokens.
        extra_eos = tuple(meta[f"tokenizer.ggml.{key}"] for key in ("eot_token_id", "eom_token_id")
                          if meta.get(f"tokenizer.ggml.{key}") is not None)
        return cls(backend, bos_token=named["bos"], eos_token=named["eos"], pad_token=named["pad"],
                   unk_token=named["unk"], add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                   add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                   chat_template=meta.get("tokenizer.chat_template"), extra_eos_token_ids=extra_eos,
                   byte_level=byte_level)

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """Load `tokenizer.json` with `tokenizer_config.json`, chat template files, and the eos ids of
        `generation_config.json` / `config.json`."""
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise UnsupportedModelError(f"{path!r} has no tokenizer.json")
        backend = BackendTokenizer.from_file(tokenizer_file)
        # NOTE: tokenizer.json may carry padding/truncation settings (sentence-transformers exports pad
        # to 128); transformers ignores them unless asked, and so do we.
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(os.path.join(path, "tokenizer_config.json"))

        def special(name: str) -> str | None:
            value = config.get(name)
            return value.get("content") if isinstance(value, dict) else value

        extra_eos: list[int] = []
        for file in ("generation_config.json", "config.json"):
            eos = _read_json(os.path.join(path, file)).get("eos_token_id")
            extra_eos += eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
        spec = json.loads(backend.to_str())
        decoder = json.dumps(spec.get("decoder") or {})
        byte_level = '"ByteLevel"' in decoder
        return cls(backend, bos_token=special("bos_token"), eos_token=special("eos_token"),
                   pad_token=special("pad_token"), unk_token=special("unk_token"),
                   # The backend's post-processor already adds what tokenizer.json says; these add
                   # only what it lacks.
                   add_bos_token=bool(config.get("add_bos_token", False)),
                   add_eos_token=bool(config.get("add_eos_token", False)),
                   chat_template=_hf_chat_template(path, config), extra_eos_token_ids=tuple(extra_eos),
                   byte_level=byte_level)


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces, best
    score first (transformers' `generate_merges` with scores)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _hf_chat_template(path: str, config: dict) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template") or _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template
