"""`rest-proxy serve --workers N` as its own process group in front of the scripted engine: streams spread
over the workers, /metrics sums them exactly, MCP tools run from every worker, SIGTERM drains them all,
a dead worker is replaced, and the metrics folder is made and removed by the proxy."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from rest_proxy.config import ProxyConfig
from rest_proxy.workers import listening_sockets, usable_cpus
from tests.proxy.fake_engine import DEFAULT_TEXT, free_port
from tests.proxy.test_mcp import ADD_CALL, stdio, write_config
from tests.waiting import wait_for

ROOT = Path(__file__).parent.parent.parent
_WORKER_SERIES = re.compile(r'^rest_proxy_worker_requests\{pid="(\d+)"\} ([0-9.e+]+)$', re.M)



class WorkersProxy:
    """`rest-proxy serve --workers N` in a subprocess, with its own TMPDIR (to see the metrics folder)."""

    def __init__(self, engine_target: str, num_workers: int, tmp_path: Path, *args: str):
        self.port = free_port()
        self.num_workers = num_workers
        self.tmpdir = tmp_path / "proxy-tmp"
        self.tmpdir.mkdir(parents=True)
        self.log_path = tmp_path / "proxy.log"
        env = {**os.environ, "TMPDIR": str(self.tmpdir)}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rest_proxy.cli", "serve", "--engine", engine_target, "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", str(num_workers), "--log-level", "info", *args],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        # Started = every worker has finished its startup (engine list, MCP) and is listed on /metrics.
        wait_for(lambda: len(self.worker_requests()) == num_workers, 120, f"{num_workers} workers:\n{self.log()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def metrics(self) -> str:
        if self.process.poll() is not None:
            raise AssertionError(f"the proxy exited with {self.process.returncode}:\n{self.log()}")
        return httpx.get(self.url + "/metrics", timeout=10).text

    def worker_requests(self) -> dict[int, float]:
        """Requests answered by each live worker, by pid (empty while the proxy is not answering)."""
        try:
            text = self.metrics()
        except httpx.HTTPError:
            return {}
        return {int(pid): float(value) for pid, value in _WORKER_SERIES.findall(text)}

    def metrics_dirs(self) -> list[str]:
        return [p.name for p in self.tmpdir.iterdir() if p.name.startswith("rest-proxy-metrics-")]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def workers_proxy(fake_server, tmp_path):
    started: list[WorkersProxy] = []

    def start(num_workers: int, *args: str) -> WorkersProxy:
        started.append(WorkersProxy(fake_server.target, num_workers, tmp_path / f"p{len(started)}", *args))
        return started[-1]

    yield start
    for proxy in started:
        proxy.stop()


def sdk(proxy: WorkersProxy) -> OpenAI:
    return OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _metric(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} ([0-9.e+]+)$", text, re.M)
    assert match, f"{series} not in /metrics:\n{text}"
    return float(match.group(1))


def _stream_chat(proxy: WorkersProxy, content: str) -> str:
    # A client of its own: its own connection, which the kernel may hand to any worker.
    with sdk(proxy) as client:
        chunks = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": content}],
                                                stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_streams_spread_over_workers_and_metrics_are_summed(workers_proxy, engine):
    proxy = workers_proxy(2)
    assert len(proxy.metrics_dirs()) == 1  # made by the proxy, in its TMPDIR
    before = proxy.worker_requests()
    num_streams = 24
    with ThreadPoolExecutor(num_streams) as pool:
        texts = list(pool.map(lambda i: _stream_chat(proxy, f"hello {i}"), range(num_streams)))
    assert texts == [DEFAULT_TEXT] * num_streams
    after = proxy.worker_requests()
    assert sorted(after) == sorted(before) and len(after) == 2
    served = {pid: after[pid] - before[pid] for pid in after}
    # SO_REUSEPORT hashes each connection to a worker: all 24 on one of two has probability 2**-23.
    assert sum(served.values()) == num_streams and all(n > 0 for n in served.values()), served
    text = proxy.metrics()
    # Counters and histograms from both workers, summed exactly
    assert _metric(text, 'rest_proxy_http_requests_total{method="POST",route="/v1/chat/completions",'
                         'status="200"}') == num_streams
    assert _metric(text, 'rest_proxy_time_to_first_token_seconds_count{endpoint="chat"}') == num_streams
    assert _metric(text, "rest_proxy_sse_streams_open") == 0  # live sum: every stream closed


def test_mcp_tools_run_from_every_worker(workers_proxy, engine, tmp_path):
    engine.script["add please"] = "Let me add. " + ADD_CALL
    engine.script["<tool_response>\n5\n</tool_response>"] = "The sum is 5."
    config = write_config(tmp_path, {"calc": stdio(timeout=5)})
    proxy = workers_proxy(2, "--mcp-config", str(config))
    before = proxy.worker_requests()
    num_requests = 16

    def ask(_):
        with sdk(proxy) as client:
            resp = client.chat.completions.create(model="fake-model",
                                                  messages=[{"role": "user", "content": "add please"}])
            return resp.choices[0].message.content

    with ThreadPoolExecutor(num_requests) as pool:
        assert list(pool.map(ask, range(num_requests))) == ["Let me add.The sum is 5."] * num_requests
    after = proxy.worker_requests()
    served = {pid: after[pid] - before[pid] for pid in after}
    assert sum(served.values()) == num_requests and all(n > 0 for n in served.values()), served
    text = proxy.metrics()
    assert _metric(text, 'rest_proxy_mcp_tool_calls_total{outcome="ok",server="calc",tool="add"}') == num_requests
    # Each worker keeps its own MCP session: both offer calc's tools (live max, not a sum over workers).
    assert _metric(text, 'rest_proxy_mcp_tools{server="calc"}') >= 2


def test_sigterm_drains_every_worker_then_removes_the_metrics_folder(workers_proxy, engine):
    proxy = workers_proxy(2, "--shutdown-timeout", "30")
    engine.token_delay = 0.3  # DEFAULT_TEXT is 10 pieces: each stream lasts ~3 s
    num_streams = 8
    with ThreadPoolExecutor(num_streams) as pool:
        futures = [pool.submit(_stream_chat, proxy, f"drain {i}") for i in range(num_streams)]
        wait_for(lambda: _metric(proxy.metrics(), "rest_proxy_sse_streams_open") == num_streams, 30,
                 "every stream open")
        proxy.process.send_signal(signal.SIGTERM)
        # Whichever worker answers: 503, and /health says it is going away
        wait_for(lambda: httpx.get(proxy.url + "/health", timeout=5).status_code == 503, 10, "/health 503")
        late = httpx.post(proxy.url + "/v1/completions", json={"model": "fake-model", "prompt": "hi"}, timeout=5)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert [f.result(60) for f in futures] == [DEFAULT_TEXT] * num_streams  # in-flight streams finish
    assert proxy.process.wait(30) == 0
    assert proxy.metrics_dirs() == []


def test_connections_after_a_worker_has_drained_reach_one_still_draining(workers_proxy, engine):
    # One stream keeps one worker draining for ~10 s; the idle one stops at once. Its socket must go with it:
    # a connection the kernel hashed to it would otherwise wait in a backlog nobody accepts from.
    proxy = workers_proxy(2, "--shutdown-timeout", "30")
    pids = set(proxy.worker_requests())
    engine.token_delay = 1.0
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream_chat, proxy, "long drain")
        wait_for(lambda: _metric(proxy.metrics(), "rest_proxy_sse_streams_open") == 1, 30, "the stream open")
        proxy.process.send_signal(signal.SIGTERM)
        wait_for(lambda: any(not _is_alive(pid) for pid in pids), 10, "the idle worker to exit")
        for _ in range(16):  # each new connection is hashed anew: 16 on one socket of two has odds 2**-15
            late = httpx.post(proxy.url + "/v1/completions", json={"model": "fake-model", "prompt": "hi"}, timeout=3)
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert stream.result(60) == DEFAULT_TEXT
    assert proxy.process.wait(30) == 0


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_dead_worker_is_replaced_and_totals_keep_its_counts(workers_proxy, engine):
    proxy = workers_proxy(2)
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda i: _stream_chat(proxy, f"x {i}"), range(8))) == [DEFAULT_TEXT] * 8
    victim = max(proxy.worker_requests())
    os.kill(victim, signal.SIGKILL)
    workers = wait_for(lambda: (w := proxy.worker_requests()) and len(w) == 2 and victim not in w and w, 60,
                       "a replacement worker")
    assert proxy.process.poll() is None and victim not in workers
    text = proxy.metrics()
    # The killed worker's counts stay in the totals (counters never go back); its live gauge is gone.
    assert _metric(text, 'rest_proxy_http_requests_total{method="POST",route="/v1/chat/completions",'
                         'status="200"}') == 8
    assert f'pid="{victim}"' not in text


def test_workers_flag_and_default():
    with pytest.raises(ValueError, match="--workers must be >= 1, got 0"):
        ProxyConfig(engines=["x:1"], workers=0)
    result = subprocess.run([sys.executable, "-m", "rest_proxy.cli", "serve", "--workers", "0"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--workers must be >= 1, got 0" in result.stderr


def test_usable_cpus_honours_a_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # 1.5 CPUs: two event loops
    assert usable_cpus(str(quota)) == min(affinity, 2)
    quota.write_text("max 100000\n")
    assert usable_cpus(str(quota)) == affinity
    assert usable_cpus(str(tmp_path / "missing")) == affinity


def test_listening_sockets_share_one_port():
    sockets = listening_sockets("127.0.0.1", 0, 3)
    try:
        assert len({s.getsockname() for s in sockets}) == 1
    finally:
        for s in sockets:
            s.close()


def test_workers_share_stored_responses_and_remove_their_folder(workers_proxy, engine):
    """Follow-ups, GET and DELETE of stored responses work whichever worker each request lands on."""
    proxy = workers_proxy(2)
    state_dirs = [p for p in proxy.tmpdir.iterdir() if p.name.startswith("rest-proxy-state-")]
    assert len(state_dirs) == 1 and (state_dirs[0] / "responses.sqlite").is_file()
    num_conversations, num_turns = 8, 3
    for c in range(num_conversations):
        for t in range(num_turns):
            engine.script[f"turn {t} of {c}"] = f"answer {t} of {c}"
    before = proxy.worker_requests()

    def converse(c: int) -> list[str]:
        ids: list[str] = []
        for t in range(num_turns):  # each request on a connection of its own: any worker may get it
            with sdk(proxy) as client:
                resp = client.responses.create(model="fake-model", input=f"turn {t} of {c}",
                                               previous_response_id=ids[-1] if ids else None)
            assert resp.output_text == f"answer {t} of {c}" and resp.previous_response_id == (ids or [None])[-1]
            ids.append(resp.id)
        for t, response_id in enumerate(ids):
            got = httpx.get(f"{proxy.url}/v1/responses/{response_id}", timeout=30)
            assert got.status_code == 200 and got.json()["output"][0]["content"][0]["text"] == f"answer {t} of {c}"
        return ids

    with ThreadPoolExecutor(num_conversations) as pool:
        conversations = list(pool.map(converse, range(num_conversations)))
    for c in range(num_conversations):
        # The last turn's prompt is the whole conversation, from the store whichever worker wrote it.
        history = "".join(f"<|im_start|>user\nturn {t} of {c}<|im_end|>\n<|im_start|>assistant\n"
                          f"answer {t} of {c}<|im_end|>\n" for t in range(num_turns - 1))
        last = f"{history}<|im_start|>user\nturn {num_turns - 1} of {c}<|im_end|>\n<|im_start|>assistant\n"
        assert engine.prompts.count(last) == 1, (last, engine.prompts)
    for ids in conversations:  # DELETE on one connection, the checks on others
        deleted = httpx.delete(f"{proxy.url}/v1/responses/{ids[-1]}", timeout=30)
        assert deleted.json() == {"id": ids[-1], "object": "response.deleted", "deleted": True}
        assert httpx.get(f"{proxy.url}/v1/responses/{ids[-1]}", timeout=30).status_code == 404
        assert httpx.delete(f"{proxy.url}/v1/responses/{ids[-1]}", timeout=30).status_code == 404
        follow = httpx.post(proxy.url + "/v1/responses", timeout=30, json={
            "model": "fake-model", "input": "more", "previous_response_id": ids[-1]})
        assert follow.status_code == 404 and follow.json()["error"]["code"] == "previous_response_not_found"
        assert httpx.get(f"{proxy.url}/v1/responses/{ids[0]}", timeout=30).status_code == 200
    after = proxy.worker_requests()
    served = {pid: after[pid] - before[pid] for pid in after}
    # 8 * (3 + 3 + 5) requests, each connection hashed to one of 2 workers: all on one has probability 2**-87.
    assert sorted(after) == sorted(before) and sum(served.values()) == 88 and all(served.values()), served
    proxy.stop()
    assert proxy.process.returncode == 0
    assert [p for p in proxy.tmpdir.iterdir() if p.name.startswith("rest-proxy-state-")] == []
