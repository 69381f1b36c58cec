"""Real traffic for the metrics tests: a live engine over gRPC and through the proxy, and MCP tool calls.

`run_traffic` scrapes before and after and keeps what the clients saw (usage, finish reasons, statuses), so
tests compare the exported metrics with the API's own numbers.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import openai
from openai import OpenAI

from inference_service.api import pb, pb_grpc
from rest_proxy.config import ProxyConfig
from rest_proxy.mcp_config import load_mcp_config
from tests.grpc_client import EngineProcess, GenerateStream, greedy
from tests.ops.ops_helpers import Scrape
from tests.proxy.fake_engine import FakeEngineServer
from tests.proxy.servers import ProxyServer

REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort",
           pb.FINISH_REASON_ERROR: "error"}
# 40-odd tokens: two full KV blocks of 16, so the second identical prompt finds them in the prefix cache.
SHARED_PROMPT = ("Operations checklist: watch the queue depth, the KV cache usage, the preemptions and the time "
                 "to first token of every replica before scaling out.")
MCP_SERVER = Path(__file__).resolve().parents[1] / "proxy" / "mcp_stdio_server.py"


@dataclass
class Traffic:
    engine_before: Scrape
    engine_after: Scrape
    proxy_before: Scrape
    proxy_after: Scrape
    mcp_proxy_after: Scrape
    model_name: str
    prompt_tokens: int = 0  # as reported by the APIs (gRPC usage and OpenAI usage)
    completion_tokens: int = 0
    num_requests: int = 0  # requests the engine finished
    num_rejected: int = 0  # requests the engine refused before running them (finish reason `error`)
    num_first_tokens: int = 0
    reasons: Counter = field(default_factory=Counter)
    cached_tokens: int = 0  # prefix-cache reuse of the second identical prompt
    shared_prompt_tokens: int = 0
    peak: dict[str, float] = field(default_factory=dict)  # highest engine gauges seen while busy
    sse_open_during_stream: float = 0.0
    statuses: Counter = field(default_factory=Counter)  # (route, status) of proxy requests
    grpc_error_codes: Counter = field(default_factory=Counter)
    mcp_outcomes: Counter = field(default_factory=Counter)

    def __repr__(self) -> str:  # the scrapes are long: failures show what the clients saw
        return (f"Traffic(prompt_tokens={self.prompt_tokens}, completion_tokens={self.completion_tokens}, "
                f"requests={self.num_requests}, reasons={dict(self.reasons)}, peak={self.peak})")

    def count(self, usage, reason: str, first_token: bool = True) -> None:
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.num_requests += 1
        self.num_first_tokens += first_token
        self.reasons[reason] += 1


class GaugePoller:
    """Scrapes the engine every 20 ms from a thread and keeps the largest value of each gauge."""

    GAUGES = ("inference_engine_requests_running", "inference_engine_requests_waiting",
              "inference_engine_kv_cache_usage_ratio")

    def __init__(self, url: str):
        self.url, self.peak = url, dict.fromkeys(self.GAUGES, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            scrape = Scrape.get(self.url)
            for name in self.GAUGES:
                self.peak[name] = max(self.peak[name], scrape.value(name))
            time.sleep(0.02)

    def __enter__(self) -> GaugePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def grpc_traffic(engine: EngineProcess, t: Traffic) -> None:
    """Prefix-cache reuse, an abort, and a burst larger than the engine's 3 sequences and 5 KV blocks."""
    with grpc.insecure_channel(engine.target) as channel:
        stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
        for i in range(2):  # the same prompt twice: the second one reuses its full blocks
            stream.start(f"shared{i}", text=SHARED_PROMPT, **greedy(2, ignore_eos=True))
            stream.wait_done({f"shared{i}"})
        t.cached_tokens = stream.results["shared1"].usage.cached_tokens
        t.shared_prompt_tokens = stream.results["shared1"].usage.prompt_tokens
        stream.start("cancelled", text="Write a very long essay:", **greedy(60, ignore_eos=True))
        while not stream.results["cancelled"].tokens:
            stream.next()
        stream.cancel("cancelled")
        stream.wait_done({"cancelled"})
        burst = {f"burst{i}" for i in range(4)}
        with GaugePoller(f"http://127.0.0.1:{engine.metrics_port}/metrics") as poller:
            for request_id in sorted(burst):
                stream.start(request_id, text=f"{request_id}: list the planets of the solar system, one per line.",
                             **greedy(24, ignore_eos=True))
            stream.wait_done(burst)
        t.peak = poller.peak
        stream.drain()
    for result in stream.results.values():
        assert result.error is None, result.error
        t.count(result.usage, REASONS[result.completions[0].finish_reason])


def proxy_traffic(proxy: ProxyServer, t: Traffic) -> None:
    """Chat (plain and streamed), completions, and a prompt the engine rejects, through the real proxy."""
    client = OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=t.model_name, messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=4, temperature=0)
    t.count(chat.usage, chat.choices[0].finish_reason)
    t.statuses["/v1/chat/completions", "200"] += 1
    # 32 tokens (about 60 with the prompt, inside the 80 the KV cache holds): the stream stays open for 31 decode
    # steps after its first chunk, long enough to scrape; 4 tokens could all be sent before the scrape arrived.
    stream = client.chat.completions.create(model=t.model_name, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    t.sse_open_during_stream = Scrape.get(proxy.url + "/metrics").value("rest_proxy_sse_streams_open")
    chunks += list(stream)
    reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    t.count(chunks[-1].usage, reason)
    t.statuses["/v1/chat/completions", "200"] += 1
    completion = client.completions.create(model=t.model_name, prompt="One, two, three,", max_tokens=3,
                                           temperature=0)
    t.count(completion.usage, completion.choices[0].finish_reason)
    t.statuses["/v1/completions", "200"] += 1
    try:  # longer than the 80 tokens the engine's KV cache holds: INVALID_ARGUMENT from the engine -> 400
        client.completions.create(model=t.model_name, prompt="word " * 200, max_tokens=2)
        raise AssertionError("the engine accepted a prompt larger than its KV cache")
    except openai.BadRequestError:
        t.statuses["/v1/completions", "400"] += 1
        t.grpc_error_codes["INVALID_ARGUMENT"] += 1
        t.num_rejected += 1


def mcp_traffic(tmp: Path, t: Traffic) -> Scrape:
    """MCP tool calls (one good, one with bad arguments) by a proxy in front of the scripted fake engine.

    NOTE: a 135M model cannot be relied on to call a tool, so the model side is scripted; the proxy, the MCP
    stdio server and the metrics are real."""
    (tmp / "mcp.json").write_text(json.dumps({"mcpServers": {
        "calc": {"command": sys.executable, "args": [str(MCP_SERVER)], "timeout": 10}}}))
    fake = FakeEngineServer().start()
    proxy = ProxyServer(ProxyConfig(engines=[fake.target], mcp_servers=load_mcp_config(tmp / "mcp.json"))).start()
    try:
        fake.engine.script["add please"] = '<tool_call>{"name": "calc__add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        fake.engine.script["add badly"] = '<tool_call>{"name": "calc__add", "arguments": {"a": "x"}}</tool_call>'
        fake.engine.script["<tool_response>\n5\n</tool_response>"] = "The sum is 5."
        client = OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for content in ("add please", "add badly"):
            client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": content}])
        t.mcp_outcomes.update({"ok": 1, "error": 1})  # "error": the MCP server rejected the argument types
        return Scrape.get(proxy.url + "/metrics")
    finally:
        proxy.stop()
        fake.stop()


def run_traffic(engine: EngineProcess, tmp: Path) -> Traffic:
    engine_url = f"http://127.0.0.1:{engine.metrics_port}/metrics"
    with grpc.insecure_channel(engine.target) as channel:
        model_name = pb_grpc.InferenceServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    proxy = ProxyServer(ProxyConfig(engines=[engine.target])).start()
    try:
        engine_before, proxy_before = Scrape.get(engine_url), Scrape.get(proxy.url + "/metrics")
        t = Traffic(engine_before, engine_before, proxy_before, proxy_before, proxy_before,
                    model_name=model_name.model_name)
        grpc_traffic(engine, t)
        proxy_traffic(proxy, t)
        t.mcp_proxy_after = mcp_traffic(tmp, t)
        t.engine_after, t.proxy_after = Scrape.get(engine_url), Scrape.get(proxy.url + "/metrics")
    finally:
        proxy.stop()
    return t
