"""Reasoning end to end: the real engine (embedded SmolLM2) with a thinking chat template given by
`--chat-template`, the proxy choosing the reasoning parser from it, and the official openai SDK."""

from __future__ import annotations

import pytest
from openai import OpenAI

from rest_proxy.config import ProxyConfig
from tests.proxy.conftest import launch_engine
from tests.proxy.servers import ProxyServer
from tests.proxy.test_reasoning import THINKING_TEMPLATE

QUESTION = "What is the capital of France?"
OPENED = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n<think>\n"
CLOSED = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def thinking_sdk(tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinking")
    template = folder / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    engine = launch_engine(folder, "--chat-template", str(template))
    proxy = ProxyServer(ProxyConfig(engines=[next(engine)])).start()
    yield OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    proxy.stop()
    next(engine, None)


def _model(sdk: OpenAI) -> str:
    return sdk.models.list().data[0].id


def _completion(sdk: OpenAI, prompt: str) -> tuple[str, str]:
    """What the model writes after exactly this prompt, greedily, and why it stopped."""
    choice = sdk.completions.create(model=_model(sdk), prompt=prompt, extra_body={"add_special_tokens": False},
                                    **GREEDY).choices[0]
    return choice.text, choice.finish_reason


def test_the_output_inside_the_opened_thinking_is_reasoning(thinking_sdk):
    sdk, model = thinking_sdk, _model(thinking_sdk)
    expected, reason = _completion(sdk, OPENED)
    assert "</think>" not in expected and expected.strip()
    messages = [{"role": "user", "content": QUESTION}]
    choice = sdk.chat.completions.create(model=model, messages=messages, **GREEDY).choices[0]
    assert choice.finish_reason == reason
    assert (choice.message.reasoning_content, choice.message.content) == (expected.strip(), None)
    reasoning, content = "", ""
    for chunk in sdk.chat.completions.create(model=model, messages=messages, stream=True, **GREEDY):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (expected.strip(), "")


def test_enable_thinking_false_answers_in_content(thinking_sdk):
    sdk = thinking_sdk
    expected, reason = _completion(sdk, CLOSED)
    choice = sdk.chat.completions.create(model=_model(sdk), messages=[{"role": "user", "content": QUESTION}],
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                         **GREEDY).choices[0]
    assert (choice.message.reasoning_content, choice.message.content, choice.finish_reason) == (None, expected, reason)


def test_a_chat_template_that_is_missing_or_does_not_compile_refuses_to_start(tmp_path):
    from inference_service.config import EngineConfig
    from inference_service.model.chat_template import load_chat_template

    with pytest.raises(ValueError, match="--chat-template: no such file"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=f"--chat-template {bad}: the model's chat template does not compile"):
        load_chat_template(str(bad))
