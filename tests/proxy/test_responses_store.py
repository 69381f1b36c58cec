"""The Responses API's parts without a model: the bounded store (by count and by age, exact eviction order;
in memory and in a SQLite file, the latter shared by processes and round-tripping entries exactly), the
store behind the proxy (scripted engine, either store), and the event builder checked by the `openai` SDK's own stream
accumulator, including output the chat path cannot produce yet (reasoning, text after a call, a refusal)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI, omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from rest_proxy.errors import ProxyError
from rest_proxy.protocol import ChatMessageParam
from rest_proxy.responses_output import ResponseBuilder
from rest_proxy.responses import _output_messages
from rest_proxy.responses_store import (
    MemoryResponseStore,
    SqliteResponseStore,
    StoredResponse,
)

EVENTS = TypeAdapter(ResponseStreamEvent)
ROOT = Path(__file__).parent.parent.parent


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(n: int) -> StoredResponse:
    return StoredResponse(response={"id": f"r{n}"}, messages=[])


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request, tmp_path):
    """Builds the store under test: `MemoryResponseStore`, or `SqliteResponseStore` on a fresh file."""
    if request.param == "memory":
        yield MemoryResponseStore
        return
    opened: list[SqliteResponseStore] = []

    def make(**kwargs) -> SqliteResponseStore:
        opened.append(SqliteResponseStore(str(tmp_path / f"store{len(opened)}.sqlite"), **kwargs))
        return opened[-1]

    yield make
    for store in opened:
        store.close()


def test_store_evicts_least_recently_used_beyond_max_entries(make_store):
    store = make_store(max_entries=3, ttl=60, clock=Clock())
    for n in range(3):
        store.put(f"r{n}", entry(n))
    assert store.get("r0").response == {"id": "r0"}  # r0 is now the most recently used
    store.put("r3", entry(3))
    assert store.get("r1") is None and [k for k in ("r0", "r2", "r3") if store.get(k)] == ["r0", "r2", "r3"]
    store.put("r4", entry(4))  # the gets above used r0, r2, r3 in that order: r0 goes
    assert store.get("r0") is None and len(store) == 3
    assert store.delete("r4") and not store.delete("r4") and len(store) == 2


def test_store_expires_by_age_whatever_the_use(make_store):
    clock = Clock()
    store = make_store(max_entries=10, ttl=60, clock=clock)
    store.put("old", entry(0))
    clock.now += 30
    store.put("young", entry(1))
    clock.now += 29.5
    assert store.get("old") is not None  # 59.5 s old, and used: use does not extend its life
    clock.now += 0.5
    assert store.get("old") is None and store.get("young") is not None and len(store) == 1
    clock.now += 30
    assert store.get("young") is None and len(store) == 0
    store.put("dying", entry(2))
    clock.now += 59.5
    assert store.delete("dying") is True
    store.put("dying", entry(2))
    clock.now += 60
    assert store.delete("dying") is False and len(store) == 0  # expired: nothing left to delete


def test_store_of_size_zero_keeps_nothing_and_bad_bounds_are_refused(make_store):
    store = make_store(max_entries=0, ttl=60)
    store.put("r", entry(0))
    assert store.get("r") is None and len(store) == 0
    with pytest.raises(ValueError, match="max_entries"):
        make_store(max_entries=-1)
    with pytest.raises(ValueError, match="ttl"):
        make_store(ttl=0)


def test_sqlite_store_round_trips_entries_exactly(tmp_path):
    store = SqliteResponseStore(str(tmp_path / "s.sqlite"), clock=Clock())
    messages = [
        ChatMessageParam(role="system", content="Be brief."),
        ChatMessageParam.model_validate({"role": "user", "name": "ada", "content": [
            {"type": "text", "text": "héllo \u2603 \"quoted\""}, {"type": "input_image"}]}),
        ChatMessageParam.model_validate({"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "function": {"name": "add", "arguments": '{"a": 1.5e-7, "b": [1, 2]}'}}]}),
        ChatMessageParam(role="tool", tool_call_id="call_1", content="5"),
    ]
    response = {"id": "resp_1", "created_at": 1764057600, "temperature": 0.7, "output": [
        {"type": "message", "content": [{"type": "output_text", "text": "ünïcode\n", "annotations": []}]}],
        "metadata": {}, "usage": None, "store": True}
    store.put("resp_1", StoredResponse(response=response, messages=messages))
    got = store.get("resp_1")
    assert got.response == response and got.created == 1000.0
    assert got.messages == messages  # pydantic equality ignores which fields were set: compare those too
    assert [m.model_fields_set for m in got.messages] == [m.model_fields_set for m in messages]
    assert [type(m.content) for m in got.messages] == [str, list, type(None), str]
    store.close()


_CHILD = """
import sys
from rest_proxy.responses_store import SqliteResponseStore, StoredResponse
store = SqliteResponseStore(sys.argv[1], max_entries=int(sys.argv[2]), ttl=60)
for response_id in sys.argv[3:]:
    store.put(response_id, StoredResponse(response={"id": response_id}, messages=[]))
"""


def put_in_child(path: str, max_entries: int, *ids: str) -> subprocess.Popen:
    """Another process (as another worker is) putting `ids` into the store file."""
    return subprocess.Popen([sys.executable, "-c", _CHILD, path, str(max_entries), *ids], cwd=ROOT)


def test_sqlite_store_is_shared_by_processes(tmp_path):
    path = str(tmp_path / "shared.sqlite")
    # Several processes open the same new file at once and write concurrently: none is refused.
    children = [put_in_child(path, 1000, *(f"c{c}-{n}" for n in range(50))) for c in range(4)]
    assert [child.wait(60) for child in children] == [0] * 4
    store = SqliteResponseStore(path, max_entries=1000, ttl=60)
    assert len(store) == 200 and store.get("c3-49").response == {"id": "c3-49"}
    # Use in this process orders eviction in the others: the LRU order is the file's.
    path = str(tmp_path / "lru.sqlite")
    assert put_in_child(path, 3, "r0", "r1", "r2").wait(60) == 0
    store = SqliteResponseStore(path, max_entries=3, ttl=60)
    assert store.get("r0").response == {"id": "r0"}
    assert put_in_child(path, 3, "r3").wait(60) == 0
    assert store.get("r1") is None and [k for k in ("r0", "r2", "r3") if store.get(k)] == ["r0", "r2", "r3"]
    assert store.delete("r3") and put_in_child(path, 3, "r4", "r5").wait(60) == 0
    assert [k for k in ("r0", "r2", "r4", "r5") if store.get(k)] == ["r2", "r4", "r5"]


@pytest.mark.parametrize("store_file", [False, True], ids=["memory", "sqlite"])
def test_proxy_store_bounds(fake_server, engine, start_proxy, tmp_path, store_file):
    path = str(tmp_path / "responses.sqlite") if store_file else None
    proxy = start_proxy(engines=[fake_server.target], responses_store_size=2, responses_store_ttl=60,
                        responses_store_path=path)
    assert type(proxy.app.state.responses_store) is (SqliteResponseStore if store_file else MemoryResponseStore)
    client = OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=30)
    clock = Clock()
    proxy.app.state.responses_store.clock = clock
    ids = [client.responses.create(model="fake-model", input=f"turn {n}").id for n in range(3)]
    missing = httpx.get(f"{proxy.url}/v1/responses/{ids[0]}")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"
    follow = httpx.post(proxy.url + "/v1/responses", json={"model": "fake-model", "input": "more",
                                                           "previous_response_id": ids[0]})
    assert follow.status_code == 404
    assert follow.json()["error"] == {"message": f"Previous response with id {ids[0]!r} not found.",
                                      "type": "invalid_request_error", "param": "previous_response_id",
                                      "code": "previous_response_not_found"}
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    clock.now += 30
    newest = client.responses.create(model="fake-model", input="turn 3").id  # evicts ids[1]
    clock.now += 30
    assert httpx.get(f"{proxy.url}/v1/responses/{ids[2]}").status_code == 404  # 60 s old
    assert client.responses.retrieve(newest).id == newest
    clock.now += 30
    assert httpx.get(f"{proxy.url}/v1/responses/{newest}").status_code == 404
    assert len(proxy.app.state.responses_store) == 0
    # DELETE answers the deleted id, and a second DELETE finds nothing.
    kept = client.responses.create(model="fake-model", input="turn 4").id
    deleted = httpx.delete(f"{proxy.url}/v1/responses/{kept}")
    assert deleted.json() == {"id": kept, "object": "response.deleted", "deleted": True}
    assert httpx.delete(f"{proxy.url}/v1/responses/{kept}").status_code == 404


def skeleton() -> dict:
    return {"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress", "model": "m",
            "output": [], "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
            "incomplete_details": None, "usage": None}


def replay(events: list[dict]) -> ResponseStreamState:
    """Feed the events to the SDK's stream accumulator, as `client.responses.stream` does."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for i, event in enumerate(events):
        assert event["sequence_number"] == i
        state.handle_event(EVENTS.validate_python(event))
    return state


def test_builder_events_satisfy_the_sdk_accumulator():
    b = ResponseBuilder(skeleton())
    events = b.start() + b.reasoning("Think") + b.reasoning("ing.") + b.text("Hel") + b.text("lo")
    events += b.call_start("call_1", "f") + b.call_arguments('{"a":') + b.call_arguments(" 1}")
    events += b.text("After.") + b.refusal("No.") + b.finish("stop", {"prompt_tokens": 5, "completion_tokens": 7})
    final = replay(events)._completed_response
    response = Response.model_validate(final.to_dict())
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call", "message"]
    reasoning, hello, call, after = response.output
    assert reasoning.content[0].text == "Thinking." and reasoning.status == "completed"
    assert hello.content[0].text == "Hello" and call.arguments == '{"a": 1}' and call.call_id == "call_1"
    assert [p.type for p in after.content] == ["output_text", "refusal"] and after.content[1].refusal == "No."
    assert response.output_text == "HelloAfter."
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (5, 7, 12)


def test_builder_length_and_failure():
    b = ResponseBuilder(skeleton())
    events = b.start() + b.text("cut") + b.finish("length", None)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"
    replay(events)
    b = ResponseBuilder(skeleton())
    events = b.start() + b.text("half") + b.fail(ProxyError(503, "engine gone", param=None))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "engine gone", "param": None,
                                               "type": "service_unavailable"}
    assert replay(events)._completed_response is None


def test_builder_mcp_calls_and_the_turns_a_follow_up_reads():
    b = ResponseBuilder(skeleton())
    events = b.start() + b.mcp_call("calc", "add", '{"a": 2, "b": 3}', "5", is_error=False)
    events += b.mcp_call("calc", "div", '{"a": 1, "b": 0}', "Error: division by zero", is_error=True)
    events += b.text("It is 5.") + b.finish("stop", None)
    response = Response.model_validate(replay(events)._completed_response.to_dict())
    assert [item.type for item in response.output] == ["mcp_call", "mcp_call", "message"]
    ok, failed, _ = response.output
    assert (ok.server_label, ok.name, ok.arguments, ok.output, ok.error, ok.status) == (
        "calc", "add", '{"a": 2, "b": 3}', "5", None, "completed")
    assert (failed.output, failed.status, failed.error.type) == (None, "failed", "mcp_tool_execution_error")
    assert [e["type"] for e in events if "mcp_call." in e["type"]] == [
        "response.mcp_call.in_progress", "response.mcp_call.completed",
        "response.mcp_call.in_progress", "response.mcp_call.failed"]
    # Stored, the calls come back as the model's own tool names and results, ahead of the answer.
    turns = _output_messages(b.response["output"])
    assert [(t.role, t.content) for t in turns] == [
        ("assistant", None), ("tool", "5"), ("assistant", None), ("tool", "Error: division by zero"),
        ("assistant", "It is 5.")]
    assert [t.tool_calls[0].function.name for t in turns if t.tool_calls] == ["calc__add", "calc__div"]
    assert turns[1].tool_call_id == turns[0].tool_calls[0].id == ok.id
