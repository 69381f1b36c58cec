"""SIGTERM to the proxy under load: /health and new requests answer 503 at once, streams in flight
finish completely, the process exits 0. Streams that outlast --shutdown-timeout are visibly cut."""

from __future__ import annotations

import signal
import threading

import httpx

from tests.reliability.rel_helpers import engine_metrics, random_specs, send_all, start_proxy, wait_for


def _load_in_background(proxy, specs):
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("records", send_all(proxy.url, specs, http=True)))
    thread.start()
    return thread, out


def _running(engine) -> float:
    return engine_metrics(engine)["inference_engine_requests_running"]


def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(small_engine, tmp_path):
    proxy = start_proxy(small_engine.target, "--shutdown-timeout", "30", log_path=str(tmp_path / "proxy.log"))
    try:
        # Two streams of 60 tokens fit the small engine's cache (~176 tokens) and outlast the checks below.
        specs = random_specs(2, max_tokens=60, seed=4)
        thread, out = _load_in_background(proxy, specs)
        wait_for(lambda: _running(small_engine) == 2, timeout=20)
        proxy.process.send_signal(signal.SIGTERM)
        # uvicorn notices signals on its 0.1 s tick
        wait_for(lambda: httpx.get(proxy.url + "/health", timeout=5).status_code == 503, timeout=5)
        late = httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=5)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert proxy.process.poll() is None, "the proxy must wait for its streams"
        thread.join(60)
        for rec in out["records"]:
            assert rec.ok, (rec.error_kind, rec.error)
            assert rec.output_tokens == 60 and rec.finish_reason == "length"
        assert proxy.process.wait(10) == 0
    finally:
        proxy.stop()
    wait_for(lambda: _running(small_engine) == 0, timeout=5)


def test_streams_past_the_shutdown_timeout_end_visibly_cut(small_engine, tmp_path):
    # NOTE: the small engine's cache caps a sequence near 176 tokens, which a fast CPU decodes in under two
    # seconds: the timeout must end well before the request could finish by itself.
    proxy = start_proxy(small_engine.target, "--shutdown-timeout", "0.2", log_path=str(tmp_path / "proxy.log"))
    try:
        (spec,) = random_specs(1, max_tokens=400, seed=5)
        thread, out = _load_in_background(proxy, [spec])
        wait_for(lambda: _running(small_engine) == 1, timeout=20)
        proxy.process.send_signal(signal.SIGTERM)
        thread.join(30)
        (rec,) = out["records"]
        # No `data: [DONE]`: the client can tell the answer is incomplete; it is never a short success.
        assert rec.error_kind == "truncated" and rec.output_tokens < 400, (rec.error_kind, rec.output_tokens, len(rec.chunk_times), rec.end - rec.start)
        proxy.process.wait(10)
    finally:
        proxy.stop()
    wait_for(lambda: _running(small_engine) == 0, timeout=5)  # and the engine dropped the request
