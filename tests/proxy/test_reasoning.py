"""Reasoning output: the `<think>` split under every chunking, its choice per model, and chat through the proxy
(a scripted engine with a thinking chat template) with the official SDK."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from inference_service.api import pb
from rest_proxy.config import ProxyConfig
from rest_proxy.reasoning import (PromptState, ReasoningParser, answer_after_thinking, get_format, prompt_state,
                                  select_format)
from tests.proxy.fake_engine import FakeEngine, FakeEngineServer
from tests.proxy.servers import ProxyServer
from tests.proxy.grammars import accepts

# ChatML whose generation prompt opens the thinking, or closes an empty one with enable_thinking=false (as
# Qwen3's does): the model's continuation starts inside the thinking.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}")
QWEN3_LIKE = THINKING_TEMPLATE.replace("{% else %}{{ '<think>\n' }}", "{% else %}")

# (parser opened by the prompt?, text, reasoning, content)
SAMPLES = [
    (False, " <think>\nLet me think.\n</think>\n\nThe answer is 42. ", "Let me think.", "The answer is 42. "),
    (True, "Hmm, 2+2.  \n</think>\n\nIt is <b>4</b>", "Hmm, 2+2.", "It is <b>4</b>"),
    (True, "<think>x</think>y", "x", "y"),
    (False, "Plain <think> text\n", None, "Plain <think> text\n"),
    (False, "<thinking is fun", None, "<thinking is fun"),
    (True, "still thinking when cut </thi", "still thinking when cut </thi", ""),
    (True, "<think>\n\n</think>\n\nOnly the answer.", "", "Only the answer."),
    (False, "  ", None, "  "),
]


def _run(parser: ReasoningParser, chunks: list[str]) -> tuple[str | None, str]:
    reasoning, content = "", ""
    for chunk in chunks:
        r, c = parser.feed(chunk)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return (reasoning + r if parser.has_reasoning else None), content + c


@pytest.mark.parametrize("case", range(len(SAMPLES)))
def test_every_split_reassembles_to_the_one_shot_result(case):
    is_open, text, reasoning, content = SAMPLES[case]
    parser = ReasoningParser(is_open=is_open)
    assert parser.extract(text) == (reasoning, content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            chunks = [text[:i], text[i:j], text[j:]]
            assert _run(parser.fresh(), chunks) == (reasoning, content), chunks
    assert _run(parser.fresh(), list(text)) == (reasoning, content)


def test_reasoning_streams_before_the_closing_tag():
    parser = ReasoningParser(is_open=True)
    assert parser.feed("Thinking about") == ("Thinking about", "")
    assert parser.feed(" it </th") == (" it", "")  # the space and the partial tag wait
    assert parser.feed("ink>\nDone") == ("", "Done")
    assert parser.feed(" and") == ("", " and")


def test_selection_from_the_template_and_by_name():
    assert select_format("{{ '<|im_start|>' }}") is None
    assert select_format(THINKING_TEMPLATE).name == "qwen3"  # mentions enable_thinking: Qwen3's hybrid kind
    assert select_format("{{'<｜Assistant｜><think>\\n'}}").name == "deepseek_r1"
    assert get_format("none") is None and get_format("qwq").name == "deepseek_r1"
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        get_format("nope")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ProxyConfig(engines=["x:1"], reasoning_parser="nope")


def test_prompt_state_follows_the_generation_prompt_and_enable_thinking():
    tokens = {"bos_token": "", "eos_token": "<|im_end|>"}
    assert prompt_state(THINKING_TEMPLATE, None, tokens) is PromptState.OPENED
    assert prompt_state(THINKING_TEMPLATE, {"enable_thinking": False}, tokens) is PromptState.CLOSED
    assert prompt_state(QWEN3_LIKE, None, tokens) is PromptState.UNKNOWN
    assert prompt_state("{{ raise_exception('no') }}", None, tokens) is PromptState.UNKNOWN
    qwen3, r1 = get_format("qwen3"), get_format("deepseek_r1")
    assert qwen3.parser(PromptState.CLOSED) is None
    assert qwen3.parser(PromptState.OPENED).is_open and not qwen3.parser(PromptState.UNKNOWN).is_open
    assert r1.parser(PromptState.UNKNOWN).is_open  # R1 writes only the closing tag


# -- structured output after the thinking -----------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize("fmt", [pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
                                 pb.StructuredOutput(regex='\\{"a": [0-9]+\\}'),
                                 pb.StructuredOutput(lark_grammar='start: "{\\"a\\": " /[0-9]+/ "}"')])
def test_format_holds_after_the_thinking(fmt, byte_tokenizer):
    opened, unopened = fmt.__deepcopy__(), fmt.__deepcopy__()
    assert answer_after_thinking(opened, ReasoningParser(is_open=True))
    assert answer_after_thinking(unopened, ReasoningParser(is_open=False))
    grammar = opened.lark_grammar
    assert accepts(byte_tokenizer, grammar, 'Say {"a": 1} or so.\n</think>\n\n{"a": 12}')
    assert not accepts(byte_tokenizer, grammar, '{"a": 12}')  # the prompt opened the thinking: it must close
    assert not accepts(byte_tokenizer, grammar, 'Hmm.</think>{"a": "x"}')
    assert not accepts(byte_tokenizer, grammar, 'Hmm.</think>{"a": 1} and more')
    grammar = unopened.lark_grammar
    assert accepts(byte_tokenizer, grammar, '{"a": 3}')
    assert accepts(byte_tokenizer, grammar, '<think>\nok\n</think>\n{"a": 3}')
    assert not accepts(byte_tokenizer, grammar, 'ok</think>{"a": 3}')


def test_a_grammar_whose_start_cannot_be_renamed_is_left_alone():
    fmt = pb.StructuredOutput(lark_grammar='start: x\nx: "start"')
    assert not answer_after_thinking(fmt, ReasoningParser(is_open=True))
    assert fmt.lark_grammar == 'start: x\nx: "start"'


# -- chat through the proxy ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinking_engine():
    server = FakeEngineServer(FakeEngine(model_name="thinker", family="qwen3", chat_template=THINKING_TEMPLATE)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def thinking_proxy(thinking_engine):
    server = ProxyServer(ProxyConfig(engines=[thinking_engine.target])).start()
    yield server
    server.stop()


@pytest.fixture
def sdk(thinking_proxy, thinking_engine) -> OpenAI:
    thinking_engine.engine.reset()
    return OpenAI(base_url=thinking_proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30)


THOUGHT = "The user wants 2+2. Call nothing <tool_call>{\"name\": \"x\"}</tool_call> here."
SCRIPTED = f"{THOUGHT}\n</think>\n\nIt is 4."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def _ask(sdk: OpenAI, prompt: str, **kwargs):
    return sdk.chat.completions.create(model="thinker", messages=[{"role": "user", "content": prompt}], **kwargs)


def _stream(sdk: OpenAI, prompt: str, **kwargs) -> list[dict]:
    chunks = _ask(sdk, prompt, stream=True, **kwargs)
    return [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]


def test_thinking_is_reasoning_content_and_the_answer_content(sdk, thinking_engine):
    thinking_engine.engine.script["q"] = SCRIPTED
    msg = _ask(sdk, "q").choices[0].message
    assert (msg.reasoning_content, msg.reasoning, msg.content) == (THOUGHT, THOUGHT, "It is 4.")
    deltas = _stream(sdk, "q")
    assert deltas[0] == {"role": "assistant", "content": ""}
    kinds = [next(k for k in ("reasoning_content", "content") if d.get(k)) for d in deltas[1:] if d]
    assert kinds == sorted(kinds, reverse=True) and "content" in kinds  # all reasoning, then the answer
    assert all(d.get("reasoning") == d["reasoning_content"] for d in deltas if "reasoning_content" in d)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."


def test_include_reasoning_false_leaves_the_thinking_out(sdk, thinking_engine):
    thinking_engine.engine.script["q"] = SCRIPTED
    msg = _ask(sdk, "q", extra_body={"include_reasoning": False}).choices[0].message
    assert (msg.reasoning_content, msg.content) == (None, "It is 4.")
    deltas = _stream(sdk, "q", extra_body={"include_reasoning": False})
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."


def test_enable_thinking_false_makes_the_whole_output_the_answer(sdk, thinking_engine):
    thinking_engine.engine.script["q"] = "Not </think> a thought."
    msg = _ask(sdk, "q", extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (msg.reasoning_content, msg.content) == (None, "Not </think> a thought.")
    assert json.loads(thinking_engine.engine.requests[-1].chat.chat_template_kwargs_json) == {"enable_thinking": False}


def test_tool_calls_are_parsed_from_the_answer_only(sdk, thinking_engine):
    thinking_engine.engine.script["q"] = f"I will call it.\n</think>\n\n{CALL}"
    choice = _ask(sdk, "q", tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "I will call it."
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    deltas = _stream(sdk, "q", tools=TOOLS)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I will call it."
    args = "".join(t["function"].get("arguments", "") for d in deltas for t in d.get("tool_calls", []))
    assert args == '{"city": "Paris"}'
    thinking_engine.engine.script["q"] = SCRIPTED  # a call inside the thinking is not a call
    choice = _ask(sdk, "q", tools=TOOLS).choices[0]
    assert (choice.finish_reason, choice.message.tool_calls, choice.message.content) == ("stop", None, "It is 4.")


def test_response_format_is_held_after_the_thinking(sdk, thinking_engine):
    thinking_engine.engine.script["q"] = 'Fine.\n</think>\n{"a": 1}'
    msg = _ask(sdk, "q", response_format={"type": "json_schema",
                                          "json_schema": {"name": "a", "schema": SCHEMA}}).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Fine.", '{"a": 1}')
    grammar = thinking_engine.engine.requests[-1].sampling.structured_output.lark_grammar
    assert grammar.startswith("start: THINK answer\n") and f"answer: %json {json.dumps(SCHEMA)}" in grammar


def test_reasoning_parser_none_passes_the_text_through(thinking_engine, start_proxy):
    proxy = start_proxy(engines=[thinking_engine.target], reasoning_parser="none")
    thinking_engine.engine.reset()
    thinking_engine.engine.script["q"] = SCRIPTED
    sdk = OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    msg = _ask(sdk, "q").choices[0].message
    assert msg.content == SCRIPTED and "reasoning_content" not in (msg.model_extra or {})


def test_responses_api_gives_the_thinking_as_a_reasoning_item(sdk, thinking_engine):
    thinking_engine.engine.script["q"] = SCRIPTED
    response = sdk.responses.create(model="thinker", input="q")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == THOUGHT
    assert response.output_text == "It is 4."
    with sdk.responses.stream(model="thinker", input="q") as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert final.output[0].content[0].text == THOUGHT and final.output_text == "It is 4."
