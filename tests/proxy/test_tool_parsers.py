"""Tool parsers: exact non-streaming results, and streaming that reassembles to them under any chunking."""

from __future__ import annotations

import random

import pytest

from rest_proxy.cli import build_parser
from rest_proxy.tool_parsers import (FAMILY_PARSERS, PARSERS, ArgumentsDelta, CallStart, ContentDelta,
                                     ToolCallExtractor, get_parser, parser_for_model, select_parser)
from tests.proxy.grammars import accepts

W = '{"city": "Paris", "unit": "c"}'
CASES = {
    "hermes": [
        ("I'll check. <tool_call>\n" '{"name": "get_weather", "arguments": ' + W + "}\n</tool_call>",
         "I'll check.", [("get_weather", W)]),
        ('<tool_call>{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}</tool_call>\n'
         '<tool_call>{"arguments": {}, "name": "b"}</tool_call>',
         None, [("a", '{"x": [1, {"y": "}"}]}'), ("b", "{}")]),
        ('<tool_call>[{"name": "f", "arguments": {"q": "\\"quoted\\" \\u00e9"}}, {"name": "g"}]</tool_call>',
         None, [("f", '{"q": "\\"quoted\\" \\u00e9"}'), ("g", "{}")]),
        ("Just text, no calls <tool", "Just text, no calls <tool", []),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "f", "arguments": ' + W + '}, {"name": "g", "arguments": {}}]',
         None, [("f", W), ("g", "{}")]),
        ("Sure [TOOL_CALLS]f[ARGS]" + W + "[TOOL_CALLS]g[ARGS]{}", "Sure", [("f", W), ("g", "{}")]),
    ],
    "llama3_json": [
        ('{"name": "f", "parameters": ' + W + "}", None, [("f", W)]),
        ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": 1}}',
         None, [("f", "{}"), ("g", '{"a": 1}')]),
        ("The answer is {not a call}", "The answer is {not a call}", []),
        ("  Plain answer.", "Plain answer.", []),
    ],
    "function_tag": [
        ("Let me see.<function=get_weather>" + W + "</function>", "Let me see.", [("get_weather", W)]),
        ("<function=a>{}</function><function=b>{\"k\": true}</function>", None, [("a", "{}"), ("b", '{"k": true}')]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="c"), noop()]', None,
         [("get_weather", '{"city": "Paris", "unit": "c"}'), ("noop", "{}")]),
        ("<|python_start|>[f(x=[1, 2], y={'a': None})]<|python_end|>", None, [("f", '{"x": [1, 2], "y": {"a": null}}')]),
        ("[not a call", "[not a call", []),
    ],
    "json": [
        ('{"name": "f", "arguments": ' + W + "}", None, [("f", W)]),
        ('[{"name": "f", "arguments": {}}, {"name": "g", "parameters": {"z": 0}}]', None,
         [("f", "{}"), ("g", '{"z": 0}')]),
        ('{"name": "f", "arguments": "{\\"a\\": 1}"}', None, [("f", '{"a": 1}')]),
    ],
}


def run(parser_name: str, chunks: list[str]):
    """Feed chunks; check the delta protocol; return (content or None, [(name, arguments)])."""
    ex = ToolCallExtractor(get_parser(parser_name))
    deltas = []
    for chunk in chunks:
        deltas += ex.feed(chunk)
    deltas += ex.finish()
    content, calls, ids = "", [], set()
    for d in deltas:
        if isinstance(d, ContentDelta):
            assert d.text
            content += d.text
        elif isinstance(d, CallStart):
            assert d.index == len(calls), "indices are consecutive, each started once"
            assert d.id.startswith("call_") and d.id not in ids
            ids.add(d.id)
            calls.append([d.name, ""])
        else:
            assert isinstance(d, ArgumentsDelta) and d.text
            assert d.index == len(calls) - 1, "arguments only for the latest call"
            calls[d.index][1] += d.text
    return content or None, [tuple(c) for c in calls]


def chunkings(text: str, seed: int):
    rng = random.Random(seed)
    yield [text]
    yield list(text)
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("parser_name,case", [(p, i) for p, cases in CASES.items() for i in range(len(cases))])
def test_non_streaming_and_every_chunking_agree(parser_name, case):
    text, content, calls = CASES[parser_name][case]
    assert run(parser_name, [text]) == (content, calls)
    for chunks in chunkings(text, seed=case):
        assert run(parser_name, chunks) == (content, calls), chunks


def test_arguments_stream_incrementally():
    ex = ToolCallExtractor(get_parser("hermes"))
    text = '<tool_call>{"name": "f", "arguments": {"text": "a long argument value"}}</tool_call>'
    fragments = [d.text for c in text for d in ex.feed(c) if isinstance(d, ArgumentsDelta)]
    assert len(fragments) > 10 and "".join(fragments) == '{"text": "a long argument value"}'


def test_markup_never_leaks_into_content():
    for parser_name, cases in CASES.items():
        for text, content, calls in cases:
            if calls:
                for chunks in chunkings(text, 1):
                    got, _ = run(parser_name, chunks)
                    for marker in ("<tool_call>", "[TOOL_CALLS]", "<function=", '"name"'):
                        assert marker not in (got or "")


def test_truncated_call_keeps_partial_arguments():
    assert run("hermes", ['<tool_call>{"name": "f", "arguments": {"a": "tru']) == (None, [("f", '{"a": "tru')])


def test_forced_prefix_is_markup():
    parser = get_parser("hermes")
    ex = ToolCallExtractor(parser, prefix=parser.call_prefix("get_weather"))
    deltas = ex.feed('{"city": "Paris"}}\n</tool_call>') + ex.finish()
    assert [type(d) for d in deltas] == [CallStart, ArgumentsDelta]
    assert deltas[0].name == "get_weather" and deltas[1].text == '{"city": "Paris"}'


def test_render_then_parse_roundtrip():
    for name in ("hermes", "mistral", "llama3_json", "function_tag", "pythonic", "json"):
        parser = get_parser(name)
        calls = [("f", '{"a": 1}'), ("g", '{"b": "x"}')]
        assert run(name, [parser.render_calls(calls)]) == (None, calls)


def test_selection():
    # The embedded SmolLM2's own template is checked against the real engine in test_e2e_real_engine.py.
    assert select_parser("llama", "{{'<|im_start|>' + message['role'] + '\\n'}}").name == "hermes"
    assert select_parser("llama", "{{ '<|start_header_id|>' }}").name == "llama3_json"
    assert select_parser("qwen2", "").name == "hermes"
    assert select_parser("mistral", "").name == "mistral"
    assert select_parser("bert", "").name == "json"
    assert get_parser("qwen3").name == "hermes"
    with pytest.raises(ValueError, match="unknown tool parser"):
        get_parser("nope")


# Every decoder family the engine serves (inference_service/model/config.py) -> the parser it gets
# when its chat template says nothing about tool calls.
EXPECTED_FAMILY_PARSERS = {
    "llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral", "qwen2": "hermes", "qwen3": "hermes",
    "qwen3_moe": "hermes", "gemma2": "pythonic", "gemma3_text": "pythonic", "phi3": "json", "stablelm": "json",
    "glm4": "json",
}


def test_family_table_covers_every_served_family():
    from inference_service.model.config import SUPPORTED_ARCHITECTURES

    assert set(SUPPORTED_ARCHITECTURES.values()) <= set(FAMILY_PARSERS)
    assert set(FAMILY_PARSERS.values()) <= set(PARSERS)
    for family, name in EXPECTED_FAMILY_PARSERS.items():
        assert select_parser(family, "{{ messages[0]['content'] }}").name == name, family
    assert select_parser("some_new_family", "").name == "json"


def test_template_wins_over_family_and_override_wins_over_both():
    chatml = "{{'<|im_start|>' + message['role'] + '\\n'}}"
    assert select_parser("mixtral", chatml).name == "hermes"  # a ChatML fine-tune of Mixtral
    assert select_parser("gemma3_text", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for_model(None, "mixtral", chatml).name == "hermes"
    assert parser_for_model("auto", "qwen3_moe", "").name == "hermes"
    assert parser_for_model("mistral", "qwen3_moe", chatml).name == "mistral"
    assert parser_for_model("qwen", "gemma2", "").name == "hermes"  # aliases too
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        parser_for_model("nope", "llama", "")


def test_tool_call_parser_flag():
    parse = build_parser().parse_args
    assert parse(["serve"]).tool_parser == "auto"
    assert parse(["serve", "--tool-call-parser", "pythonic"]).tool_parser == "pythonic"
    assert parse(["serve", "--tool-parser", "hermes"]).tool_parser == "hermes"  # the older spelling
    with pytest.raises(SystemExit) as exit_info:
        parse(["serve", "--tool-call-parser", "nope"])
    assert exit_info.value.code == 2


WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                "additionalProperties": False}
TIME_ARGS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
JSON_FORMATS = ["hermes", "mistral", "llama3_json", "function_tag", "json"]


@pytest.mark.parametrize("name", JSON_FORMATS)
def test_named_call_grammar_takes_valid_arguments_and_the_closing_markup(name, byte_tokenizer):
    parser = get_parser(name)
    grammar = parser.calls_grammar([("get_weather", WEATHER_ARGS)], named=True, parallel=True)
    prefix = parser.call_prefix("get_weather")

    def rest(args: str) -> str:
        return parser.render_calls([("get_weather", args)])[len(prefix):]

    assert accepts(byte_tokenizer, grammar, rest('{"city": "Paris"}'))
    assert not accepts(byte_tokenizer, grammar, rest('{"city": 3}'))
    assert not accepts(byte_tokenizer, grammar, rest('{"city": "Paris", "days": 2}'))
    assert not accepts(byte_tokenizer, grammar, rest('{"city": "Paris"}') + rest('{"city": "Rome"}'))


@pytest.mark.parametrize("name", ["hermes", "mistral", "llama3_json", "function_tag"])
def test_required_call_grammar_takes_any_tool_and_parallel_calls(name, byte_tokenizer):
    parser = get_parser(name)
    tools = [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    prefix = parser.call_prefix(None)
    one = parser.render_calls([("get_time", '{"zone": "CET"}')])[len(prefix):]
    two = parser.render_calls([("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "UTC"}')])[len(prefix):]
    parallel = parser.calls_grammar(tools, named=False, parallel=True)
    single = parser.calls_grammar(tools, named=False, parallel=False)
    assert accepts(byte_tokenizer, parallel, one) and accepts(byte_tokenizer, parallel, two)
    assert accepts(byte_tokenizer, single, one) and not accepts(byte_tokenizer, single, two)
    bad = parser.render_calls([("get_time", '{"zone": "PST"}')])[len(prefix):]
    assert not accepts(byte_tokenizer, parallel, bad)


def test_formats_without_json_arguments_get_no_grammar():
    assert get_parser("pythonic").calls_grammar([("get_weather", None)], named=True, parallel=False) is None
    # A lone JSON object, a list of several: several calls do not extend one call's markup.
    assert get_parser("json").calls_grammar([("get_weather", None)], named=False, parallel=True) is None


@pytest.mark.parametrize("name", JSON_FORMATS)
def test_text_or_calls_grammar_takes_any_text_or_valid_calls(name, byte_tokenizer):
    parser = get_parser(name)
    tools = [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    grammar = parser.text_or_calls_grammar(tools, parallel=True)
    leading = name in ("llama3_json", "json")  # formats whose calls are the whole answer
    call = parser.render_calls([("get_weather", '{"city": "Paris"}')])
    for text in ("", "Hello there.", "Use <tool or [TOOL or {x}", "Line one.\nLine two."):
        if not (leading and text.lstrip().startswith("{")):
            assert accepts(byte_tokenizer, grammar, text), text
    assert accepts(byte_tokenizer, grammar, ("  " if leading else "Let me check. ") + call)
    assert not accepts(byte_tokenizer, grammar, parser.render_calls([("get_weather", '{"city": "Paris", "x": 1}')]))
    assert not accepts(byte_tokenizer, grammar, parser.render_calls([("get_weather", '{"city":"Paris"}')]))
    assert not accepts(byte_tokenizer, grammar, parser.render_calls([("invented", '{"city": "Paris"}')]))
    assert not accepts(byte_tokenizer, grammar, call + " and more text")
    two = parser.render_calls([("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "UTC"}')])
    assert accepts(byte_tokenizer, grammar, two) == (name != "json")  # a list of calls is not one call repeated
    single = parser.text_or_calls_grammar(tools, parallel=False)
    assert accepts(byte_tokenizer, single, call) and not accepts(byte_tokenizer, single, two)


def test_pythonic_has_no_text_or_calls_grammar():
    assert get_parser("pythonic").text_or_calls_grammar([("get_weather", None)], parallel=True) is None


# -- Qwen3-Coder: values typed from the tool's schema ---------------------------------------------------------------
CODER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "scale": {"type": "number"}, "metric": {"type": "boolean"},
                                     "opts": {"type": "object"}, "tags": {"type": "array"},
                                     "note": {"type": ["string", "null"]}},
    "required": ["city"]}}}]


def _coder(params: str, name: str = "get_weather") -> str:
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _param(key: str, value: str) -> str:
    return f"<parameter={key}>\n{value}\n</parameter>\n"


CODER_CASES = [
    ("Let me check.\n" + _coder(_param("city", "Paris") + _param("days", "3")), "Let me check.",
     [("get_weather", '{"city": "Paris", "days": 3}')]),
    (_coder(_param("city", 'New "York"\n  </para> <b>') + _param("scale", "1.5") + _param("metric", "True")
            + _param("opts", '{"a": [1, null]}') + _param("tags", "['x', 'y']") + _param("note", "null")),
     None, [("get_weather", ('{"city": "New \\"York\\"\\n  </para> <b>", "scale": 1.5, "metric": true, '
                              '"opts": {"a": [1, null]}, "tags": ["x", "y"], "note": "null"}'))]),
    (_coder(_param("days", "three")) + "\n" + _coder("", name="noop"), None,
     [("get_weather", '{"days": "three"}'), ("noop", "{}")]),
    (_coder(_param("unknown", "42")), None, [("get_weather", '{"unknown": "42"}')]),  # untyped: raw text
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRo", None, [("get_weather", '{"city": "Ro"}')]),
    ("Use <function is not a call", "Use <function is not a call", []),
]


def run_coder(chunks: list[str]):
    parser = get_parser("qwen3_coder")
    parser.set_tools(CODER_TOOLS)
    ex = ToolCallExtractor(parser)
    deltas = [d for chunk in chunks for d in ex.feed(chunk)] + ex.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta)) or None
    calls = [[d.name, ""] for d in deltas if isinstance(d, CallStart)]
    for d in deltas:
        if isinstance(d, ArgumentsDelta):
            assert d.text
            calls[d.index][1] += d.text
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("case", range(len(CODER_CASES)))
def test_qwen3_coder_typed_arguments_under_every_chunking(case):
    text, content, calls = CODER_CASES[case]
    assert run_coder([text]) == (content, calls)
    for chunks in chunkings(text, seed=case):
        assert run_coder(chunks) == (content, calls), chunks
    for i in range(len(text) + 1):
        assert run_coder([text[:i], text[i:]]) == (content, calls)


def test_qwen3_coder_streams_string_values_and_typed_values_whole():
    parser = get_parser("qwen3_coder")
    parser.set_tools(CODER_TOOLS)
    ex = ToolCallExtractor(parser)
    text = _coder(_param("city", "Rio de Janeiro") + _param("days", "12"))
    fragments = [d.text for c in text for d in ex.feed(c) if isinstance(d, ArgumentsDelta)]
    assert fragments[:3] == ["{", '"city": "', "R"] and ', "days": 12' in fragments and fragments[-1] == "}"
    assert "".join(fragments) == '{"city": "Rio de Janeiro", "days": 12}'


def test_qwen3_coder_renders_history_that_parses_back():
    parser = get_parser("qwen3_coder")
    calls = [("get_weather", '{"city": "Paris", "days": 2, "opts": {"a": 1}}'), ("noop", "{}")]
    text = parser.render_calls(calls)
    assert text.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n")
    assert run_coder([text]) == (None, calls)
    assert select_parser("qwen3", "{{ '<tool_call>\\n<function=' }}{{ '<parameter=' }}").name == "qwen3_coder"
    assert get_parser("qwen_coder").name == "qwen3_coder"


def test_qwen3_coder_grammars(byte_tokenizer):
    parser = get_parser("qwen3_coder")
    weather = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
               "required": ["city"]}
    tools = [("get_weather", weather), ("get_time", TIME_ARGS)]
    named = parser.calls_grammar([("get_weather", weather)], named=True, parallel=True)
    prefix = parser.call_prefix("get_weather")
    ok = parser.render_calls([("get_weather", '{"city": "Paris </para>", "days": 3}')])
    assert accepts(byte_tokenizer, named, ok[len(prefix):])
    assert accepts(byte_tokenizer, named, parser.render_calls([("get_weather", '{"city": "Oslo"}')])[len(prefix):])
    for bad in ('{"days": 3}', '{"city": "Paris", "days": "x"}', '{"city": "a </parameter> b"}'):
        assert not accepts(byte_tokenizer, named, parser.render_calls([("get_weather", bad)])[len(prefix):]), bad
    two = parser.render_calls([("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "UTC"}')])
    required = parser.calls_grammar(tools, named=False, parallel=True)
    assert accepts(byte_tokenizer, required, two[len(parser.call_prefix(None)):])
    single = parser.calls_grammar(tools, named=False, parallel=False)
    assert not accepts(byte_tokenizer, single, two[len(parser.call_prefix(None)):])
    auto = parser.text_or_calls_grammar(tools, parallel=True)
    assert accepts(byte_tokenizer, auto, "Plain text, no call.")
    assert accepts(byte_tokenizer, auto, "Checking.\n" + two)
    assert not accepts(byte_tokenizer, auto, parser.render_calls([("get_time", '{"zone": "PST"}')]))
