"""The GGUF-built tokenizer against transformers' tokenizer for the same file; chat templates vs HF."""

from __future__ import annotations

import pytest

from inference_service.errors import InvalidRequestError
from inference_service.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\r\n\n\nmany",
    "naïve café – “quotes” — 日本語のテキスト, 中文, 한국어",
    "emoji 🤖🚀👩‍👩‍👧‍👦 and flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n\n\tif x >= 10: pass",
    "numbers 1234567890 3.14159 -42 1e-9",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "special inside<|im_end|>text and <repo_name>x",
    "don't won't it's we'll I'M",
    "",
    " ",
    "\u00a0non-breaking\u2009thin space",
    "a" * 50 + " " + "xyz" * 20,
]


@pytest.fixture(scope="module")
def tok(smollm) -> Tokenizer:
    return smollm.tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_hf_gguf_tokenizer(tok, hf_gguf_tokenizer, text):
    expected = hf_gguf_tokenizer(text)["input_ids"]
    assert tok.encode(text) == expected
    assert tok.encode(text, add_special_tokens=False) == hf_gguf_tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip_and_token_bytes(tok, hf_gguf_tokenizer, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.convert_ids_to_tokens(ids) == hf_gguf_tokenizer.convert_ids_to_tokens(ids)


def test_special_tokens(tok):
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_ids) == ("<|im_end|>", (2,))
    assert tok.pad_token_id == 2
    assert tok.vocab_size == 49152
    assert {0, 1, 2} <= set(tok.all_special_ids)
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # SmolLM2 adds no BOS
    assert tok.decode([1, 9690, 198, 2]) == "system\n"
    # A multi-byte character split across tokens: each token's bytes are a piece of it.
    ids = tok.encode("🤖")
    assert len(ids) > 1 and b"".join(tok.token_bytes(i) for i in ids) == "🤖".encode()


def test_hf_folder_tokenizer_matches(tmp_path, hf_gguf_tokenizer, tok):
    """The same tokenizer saved as a HF folder and loaded through `from_hf_dir`."""
    hf_gguf_tokenizer.save_pretrained(str(tmp_path))
    folder = Tokenizer.from_hf_dir(str(tmp_path))
    for text in TEXTS:
        assert folder.encode(text) == tok.encode(text)
        assert folder.decode(folder.encode(text)) == tok.decode(tok.encode(text))
    assert folder.eos_token_ids[0] == 2 and folder.bos_token_id == 1
    assert folder.chat_template == tok.chat_template


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "unicode: 日本 🤖 \"quotes\" {braces} {{ not jinja }}"}],
    [{"role": "user", "content": [{"type": "text", "text": "parts"}]}, {"role": "assistant", "content": "ok"}],
]


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_hf(tok, hf_gguf_tokenizer, index, add_generation_prompt):
    messages = CONVERSATIONS[index]
    if isinstance(messages[0]["content"], list):
        pytest.skip("the SmolLM2 template concatenates content as a string")
    expected = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{% set text = message.content %}"
    "{%- elif message.content %}{% set text = message.content | map(attribute='text') | join('') %}"
    "{%- else %}{% set text = '' %}{%- endif %}"
    "<|im_start|>{{ message.role }}\n{{ text }}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}\n<tool_call>\n"
    "{{ call.function | tojson }}\n</tool_call>{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    "{{ bos_token if false }}{% if messages | length > 9 %}{{ raise_exception('too long') }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city — °C",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_tool_template_equals_hf(tok, hf_gguf_tokenizer, index):
    messages = CONVERSATIONS[index] + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "22"}]
    expected = hf_gguf_tokenizer.apply_chat_template(messages, tools=TOOLS, chat_template=TOOL_TEMPLATE,
                                                     tokenize=False, add_generation_prompt=True)
    ours = Tokenizer.__new__(Tokenizer)
    ours.__dict__.update(tok.__dict__)
    ours.chat_template = TOOL_TEMPLATE
    assert ours.apply_chat_template(messages, tools=TOOLS) == expected


def test_continue_final_message_equals_hf(tok, hf_gguf_tokenizer):
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there, I am"}]
    expected = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True) == expected
    assert expected.endswith("Hi there, I am")


@pytest.mark.parametrize("messages,field", [
    ("not a list", "chat.messages"),
    ([{"role": "user", "content": "a"}, "oops"], "chat.messages[1]"),
    ([{"role": "user", "content": "a"}, {"content": "no role"}], "chat.messages[1].role"),
    ([{"role": 3, "content": "a"}], "chat.messages[0].role"),
    ([{"role": "user", "content": 12}], "chat.messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "chat.messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "chat.messages[0].content[0]"),
])
def test_malformed_messages(tok, messages, field):
    with pytest.raises(InvalidRequestError) as info:
        tok.apply_chat_template(messages)
    assert info.value.field == field
    assert field.split(".")[-1].split("[")[0] in info.value.message or field in info.value.message


def test_template_errors_become_invalid_request(tok):
    ours = Tokenizer.__new__(Tokenizer)
    ours.__dict__.update(tok.__dict__)
    ours.chat_template = TOOL_TEMPLATE
    with pytest.raises(InvalidRequestError, match="too long"):
        ours.apply_chat_template([{"role": "user", "content": str(i)} for i in range(10)])
    ours.chat_template = "{% for %}"
    with pytest.raises(InvalidRequestError, match="chat template"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])
    # SmolLM2's template concatenates content: a None content is a template error, not a crash.
    with pytest.raises(InvalidRequestError, match="chat template error"):
        tok.apply_chat_template([{"role": "user", "content": None}])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_ids_that_decode_to_nothing_change_no_decode(tok, skip_special_tokens):
    """What `decodes_to_nothing` flags (ids past the vocabulary; special tokens when skipped) can be
    left out of any decode, which is what lets the streaming detokenizer drop them."""
    import random

    from inference_service.engine.detokenizer import IncrementalDetokenizer

    rng = random.Random()
    specials = tok.all_special_ids
    outside = [tok.vocab_size, tok.vocab_size + 7, 10**6]
    flagged = [i for i in specials + outside if tok.decodes_to_nothing(i, skip_special_tokens)]
    assert set(outside) <= set(flagged)
    assert (tok.eos_token_id in flagged) == skip_special_tokens
    assert not any(tok.decodes_to_nothing(i, skip_special_tokens) for i in tok.encode("Hello world 🤖 日本"))
    for _ in range(20):
        ids = tok.encode(rng.choice(TEXTS) + " " + rng.choice(TEXTS), add_special_tokens=False)
        for _ in range(rng.randrange(1, 30)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials + outside))
        kept = [i for i in ids if not tok.decodes_to_nothing(i, skip_special_tokens)]
        assert tok.decode(kept, skip_special_tokens) == tok.decode(ids, skip_special_tokens)
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens)
        streamed = "".join(detok.append(i) for i in ids) + detok.flush()
        assert streamed == tok.decode(ids, skip_special_tokens), ids
