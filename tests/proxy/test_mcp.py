"""MCP tools from mcp.json, with real servers built on the `mcp` SDK: one over stdio, one over HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from rest_proxy.mcp_config import McpConfigError, load_mcp_config
from tests.proxy.fake_engine import free_port
from tests.waiting import wait_for

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
ADD_CALL = '<tool_call>{"name": "calc__add", "arguments": {"a": 2, "b": 3}}</tool_call>'



@pytest.fixture(scope="module")
def http_mcp():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "mcp_http_server.py"), str(port), "tok3n"], cwd=ROOT)

    def up():
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    wait_for(up, 15, what="the HTTP MCP server")
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


def write_config(tmp_path: Path, servers: dict) -> Path:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def stdio(*extra, **kw) -> dict:
    return {"command": sys.executable, "args": [str(HERE / "mcp_stdio_server.py"), *extra], "env": {"X": "1"}, **kw}


@pytest.fixture(scope="module")
def mcp_proxy(fake_server, http_mcp, tmp_path_factory):
    from rest_proxy.config import ProxyConfig
    from tests.proxy.servers import ProxyServer
    path = write_config(tmp_path_factory.mktemp("mcp"), {
        "calc": stdio(timeout=3), "notes": {"url": http_mcp, "headers": {"Authorization": "Bearer tok3n"}}})
    server = ProxyServer(ProxyConfig(engines=[fake_server.target], mcp_servers=load_mcp_config(path),
                                     mcp_ping_interval=0.5, mcp_max_backoff=1.0)).start()
    yield server
    server.stop()


def sdk(proxy) -> OpenAI:
    return OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=60)


def ask(proxy, content, **kw):
    return sdk(proxy).chat.completions.create(model="fake-model", messages=[{"role": "user", "content": content}], **kw)


def offered(engine) -> str:
    first = engine.requests[-1].chat.messages[0]
    return first.content if first.role == "system" else ""


def test_tools_injected_from_both_servers(mcp_proxy, engine):
    ask(mcp_proxy, "hello")
    system = offered(engine)
    for name in ("calc__add", "calc__learn", "notes__remember", "notes__recall"):
        assert f'"name": "{name}"' in system
    assert "[calc] Add two integers." in system


def test_opt_out_and_own_tools(mcp_proxy, engine):
    ask(mcp_proxy, "hello", tools=[])
    assert offered(engine) == ""
    own = {"type": "function", "function": {"name": "mine", "parameters": {"type": "object", "properties": {}}}}
    ask(mcp_proxy, "hello", tools=[own])
    assert '"name": "mine"' in offered(engine) and "calc__add" not in offered(engine)


def test_executed_calls_continue_the_conversation(mcp_proxy, engine):
    engine.script["add please"] = "Let me add. " + ADD_CALL
    engine.script["<tool_response>\n5\n</tool_response>"] = "The sum is 5."
    resp = ask(mcp_proxy, "add please")
    msg = resp.choices[0].message
    assert msg.content == "Let me add.The sum is 5." and msg.tool_calls is None
    assert resp.choices[0].finish_reason == "stop"
    assert len(engine.requests) == 2
    second = engine.requests[1].chat.messages
    assert [m.role for m in second[-2:]] == ["assistant", "tool"]
    assert "calc__add" in second[-2].content
    assert resp.usage.completion_tokens == engine_tokens(engine)
    chunks = list(ask(mcp_proxy, "add please", stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Let me add.The sum is 5."
    assert all(not c.choices[0].delta.tool_calls for c in chunks if c.choices)
    metrics = httpx.get(mcp_proxy.url + "/metrics").text
    assert 'rest_proxy_mcp_tool_calls_total{outcome="ok",server="calc",tool="add"} 2.0' in metrics


def engine_tokens(engine) -> int:
    from tests.proxy.fake_engine import tokens_of
    return len(tokens_of("Let me add. " + ADD_CALL)) + len(tokens_of("The sum is 5."))


def test_http_server_tool_and_bad_arguments(mcp_proxy, engine):
    engine.script["note"] = '<tool_call>{"name": "notes__remember", "arguments": {"text": "milk"}}</tool_call>'
    engine.script["<tool_response>\nstored note #1\n</tool_response>"] = "Noted."
    assert ask(mcp_proxy, "note").choices[0].message.content == "Noted."
    engine.script["bad"] = '<tool_call>{"name": "calc__add", "arguments": {"a": "x"}}</tool_call>'
    ask(mcp_proxy, "bad")
    tool_msg = engine.requests[-1].chat.messages[-1]
    assert tool_msg.role == "tool" and "Error" in tool_msg.content


def test_rounds_are_bounded(mcp_proxy, engine):
    engine.script["loop"] = ADD_CALL
    engine.script["<tool_response>\n5\n</tool_response>"] = ADD_CALL
    resp = ask(mcp_proxy, "loop")
    assert len(engine.requests) == 5
    assert offered(engine) == ""  # the last round offers no tools
    assert resp.choices[0].finish_reason == "stop"
    # ... but the calls already made stay in the prompt, in the model's tool markup (its template cannot
    # render structured calls).
    last = engine.requests[-1].chat.messages
    assert [m.role for m in last[-2:]] == ["assistant", "tool"] and not last[-2].tool_calls
    assert last[-2].content == '<tool_call>\n{"name": "calc__add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def test_tools_list_changed_refreshes(mcp_proxy, engine):
    engine.script["learn"] = '<tool_call>{"name": "calc__learn", "arguments": {}}</tool_call>'
    ask(mcp_proxy, "learn")

    def has_multiply():
        ask(mcp_proxy, "hello")
        return "calc__multiply" in offered(engine)
    wait_for(has_multiply, timeout=10, what="calc__multiply")


def test_crashing_server_is_respawned(mcp_proxy, engine):
    conn = mcp_proxy.app.state.mcp.connections["calc"]
    before = conn.connects
    engine.script["crash"] = '<tool_call>{"name": "calc__crash", "arguments": {}}</tool_call>'
    engine.script["!ok"] = "fine"
    resp = ask(mcp_proxy, "crash")
    assert "Error" in engine.requests[-1].chat.messages[-1].content
    assert resp.choices[0].finish_reason == "stop"
    assert ask(mcp_proxy, "!ok").choices[0].message.content == "fine"  # still serving
    wait_for(lambda: conn.connects > before and conn.client is not None, 15, "respawn")
    health = httpx.get(mcp_proxy.url + "/health?detail=true").json()
    assert health["mcp_servers"]["calc"]["connected"] is True
    ask(mcp_proxy, "hello")
    assert "calc__add" in offered(engine)


def test_no_execute_returns_calls_to_client(fake_server, http_mcp, engine, tmp_path, start_proxy):
    path = write_config(tmp_path, {"notes": {"url": http_mcp, "headers": {"Authorization": "Bearer tok3n"}}})
    proxy = start_proxy(engines=[fake_server.target], mcp_servers=load_mcp_config(path), mcp_execute=False)
    engine.script["note"] = '<tool_call>{"name": "notes__recall", "arguments": {}}</tool_call>'
    resp = ask(proxy, "note")
    assert resp.choices[0].finish_reason == "tool_calls"
    assert resp.choices[0].message.tool_calls[0].function.name == "notes__recall"
    assert len(engine.requests) == 1


def test_hanging_servers_leave_the_proxy_serving(fake_server, engine, tmp_path, start_proxy):
    path = write_config(tmp_path, {"stuck": stdio("--hang-on-start", startup_timeout=1), "slow": stdio(timeout=1)})
    t0 = time.monotonic()
    proxy = start_proxy(engines=[fake_server.target], mcp_servers=load_mcp_config(path), mcp_startup_wait=8)
    assert time.monotonic() - t0 < 10
    health = httpx.get(proxy.url + "/health?detail=true").json()
    assert health["status"] == "ok" and health["mcp_servers"]["stuck"]["connected"] is False
    wait_for(lambda: proxy.app.state.mcp.connections["slow"].client is not None, 15, "slow server")
    engine.script["hang"] = '<tool_call>{"name": "slow__hang", "arguments": {}}</tool_call>'
    engine.script["!ok"] = "still here"
    ask(proxy, "hang")
    assert "timed out" in engine.requests[-1].chat.messages[-1].content
    assert ask(proxy, "!ok").choices[0].message.content == "still here"
    metrics = httpx.get(proxy.url + "/metrics").text
    assert 'rest_proxy_mcp_tool_calls_total{outcome="timeout",server="slow",tool="hang"} 1.0' in metrics


@pytest.mark.parametrize("content,needle", [
    ("{not json", "invalid JSON"),
    ('{"servers": {}}', "mcpServers"),
    ('{"mcpServers": {"a": {"args": []}}}', "exactly one of"),
    ('{"mcpServers": {"a": {"url": "ftp://x"}}}', "http(s)"),
    ('{"mcpServers": {"a__b": {"command": "x"}}}', "invalid server name"),
])
def test_invalid_config_is_refused(tmp_path, content, needle):
    path = tmp_path / "mcp.json"
    path.write_text(content)
    with pytest.raises(McpConfigError) as exc:
        load_mcp_config(path)
    assert str(path) in str(exc.value) and needle in str(exc.value)


def test_cli_refuses_invalid_config_and_parser(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text('{"mcpServers": {"a": {}}}')
    run = subprocess.run([sys.executable, "-m", "rest_proxy.cli", "serve", "--mcp-config", str(path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and str(path) in run.stderr and "exactly one of" in run.stderr
    run = subprocess.run([sys.executable, "-m", "rest_proxy.cli", "serve", "--mcp-config", str(tmp_path / "no.json")],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and "no.json" in run.stderr
    run = subprocess.run([sys.executable, "-m", "rest_proxy.cli", "serve", "--tool-parser", "nope"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and "nope" in run.stderr
