"""Shared inputs for the embedding tests: 50 varied sentences and the MiniLM folder."""

from __future__ import annotations

from inference_service.model.loader import resolve_model_alias

MINILM = "all-minilm-l6-v2"
MINILM_LIMIT = 256  # sentence_bert_config.json max_seq_length


def minilm_path() -> str:
    return resolve_model_alias(MINILM)


_BASE = [
    "",
    " ",
    "?",
    "a",
    "OK",
    "\n\t  \n",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "Two dogs play fetch in the park while children watch.",
    "Quantum entanglement links the states of two particles regardless of distance.",
    "How do I reset my password if I no longer have access to my email?",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "SELECT name, COUNT(*) FROM users GROUP BY name HAVING COUNT(*) > 1;",
    "https://example.com/path?query=embedding&lang=en#section-2",
    "3.14159 2.71828 1.41421 6.02214076e23",
    "THIS SENTENCE IS WRITTEN ENTIRELY IN CAPITAL LETTERS!!!",
    "mIxEd CaSe TeXt ShOuLd LoWeRcAsE",
    "Café naïve façade coöperate résumé",
    "Die Straße ist übermäßig groß und schön.",
    "El niño comió paella en la playa de Valencia.",
    "Москва — столица России.",
    "東京は日本の首都です。",
    "我喜欢在周末读书和喝茶。",
    "서울은 대한민국의 수도입니다.",
    "القاهرة هي عاصمة مصر.",
    "नमस्ते, आप कैसे हैं?",
    "Γειά σου Κόσμε",
    "I love pizza 🍕🍕 and rockets 🚀!",
    "👍",
    "emoji only: 😀😃😄😁😆😅😂🤣",
    "Zero\u200bwidth\u200bspaces and non\u00a0breaking spaces",
    "tabs\tand\nnewlines\r\nmixed",
    "<html><body><p>Hello, <b>world</b>!</p></body></html>",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
    "The the the the the the the the the the",
    "I can't believe it's not butter — it's margarine, isn't it?",
    "[CLS] [SEP] [MASK] [PAD] special token look-alikes",
    "Is this the real life? Is this just fantasy?",
    "Retrieval-augmented generation combines search with language models.",
    "The Eiffel Tower is located in Paris, France.",
    "Paris is the capital city of France.",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "ʇxǝʇ uʍop ǝpısdn",
]
_LONG = [
    "The history of the world is long. " * 60,  # ~420 tokens: truncated at 256
    " ".join(f"word{i}" for i in range(400)),
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 40,
    "日本語の長い文章です。" * 120,
    "x" * 5000,
]
SENTENCES = _BASE + _LONG
assert len(SENTENCES) == 50
