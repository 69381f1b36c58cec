"""Several engines behind one proxy, routed by `model`; engines that come up after the proxy."""

from __future__ import annotations

import time

import openai
import pytest
from openai import OpenAI

from tests.proxy.fake_engine import FakeEngine, FakeEngineServer, free_port


@pytest.fixture
def second_engine():
    server = FakeEngineServer(FakeEngine(model_name="other-model")).start()
    yield server
    server.stop()


def test_requests_are_routed_by_model(start_proxy, fake_server, engine, second_engine):
    proxy = start_proxy(engines=[fake_server.target, second_engine.target])
    c = OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    assert sorted(m.id for m in c.models.list().data) == ["fake-model", "other-model"]
    engine.script["who"] = "the first"
    second_engine.engine.script["who"] = "the second"
    ask = lambda model: c.chat.completions.create(  # noqa: E731
        model=model, messages=[{"role": "user", "content": "who"}]).choices[0].message.content
    assert ask("other-model") == "the second"
    assert ask("fake-model") == "the first"
    assert len(engine.requests) == 1 and len(second_engine.engine.requests) == 1


def test_engine_that_starts_after_the_proxy(start_proxy):
    port = free_port()
    proxy = start_proxy(engines=[f"127.0.0.1:{port}"], engine_refresh_interval=60)
    c = OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:  # 503 before any engine is up, not an empty list
        c.models.list()
    assert e.value.status_code == 503
    late = FakeEngineServer(FakeEngine(model_name="late-model"), port=port).start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                c.models.list()
                break
            except openai.InternalServerError:
                time.sleep(0.1)
        assert [m.id for m in c.models.list().data] == ["late-model"]
        reply = c.chat.completions.create(model="late-model", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "Hello from the fake engine."
    finally:
        late.stop()
