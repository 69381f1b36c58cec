"""Every metric of the engine and the proxy, scraped after real traffic, moves as the API says it should."""

from __future__ import annotations

import pytest

from tests.ops.ops_helpers import delta

# Every family the issue lists, with its Prometheus type (the text format drops `_total` from counter names).
ENGINE_FAMILIES = {
    "inference_engine_requests_running": "gauge",
    "inference_engine_requests_waiting": "gauge",
    "inference_engine_kv_cache_usage_ratio": "gauge",
    "inference_engine_prefix_cache_queries": "counter",
    "inference_engine_prefix_cache_hits": "counter",
    "inference_engine_preemptions": "counter",
    "inference_engine_prompt_tokens": "counter",
    "inference_engine_generation_tokens": "counter",
    "inference_engine_tokens_per_step": "histogram",
    "inference_engine_step_duration_seconds": "histogram",
    "inference_engine_time_to_first_token_seconds": "histogram",
    "inference_engine_time_per_output_token_seconds": "histogram",
    "inference_engine_e2e_request_latency_seconds": "histogram",
    "inference_engine_request_queue_time_seconds": "histogram",
    "inference_engine_request_prefill_time_seconds": "histogram",
    "inference_engine_request_decode_time_seconds": "histogram",
    "inference_engine_request_success": "counter",
    "inference_engine_model_info": "gauge",  # an Info: one sample, value 1, the model in its labels
}
PROXY_FAMILIES = {
    "rest_proxy_http_requests": "counter",
    "rest_proxy_http_request_duration_seconds": "histogram",
    "rest_proxy_time_to_first_token_seconds": "histogram",
    "rest_proxy_sse_streams_open": "gauge",
    "rest_proxy_grpc_errors": "counter",
    "rest_proxy_mcp_tool_calls": "counter",
    "rest_proxy_mcp_tools": "gauge",
}


def engine_delta(traffic, name, **labels):
    return delta(traffic.engine_after, traffic.engine_before, name, **labels)


def test_every_metric_is_exported_with_its_type(traffic):
    for name, kind in ENGINE_FAMILIES.items():
        assert traffic.engine_after.families.get(name) == kind, name
    for name, kind in PROXY_FAMILIES.items():
        assert traffic.mcp_proxy_after.families.get(name) == kind, name
        assert traffic.proxy_after.families.get(name) == kind, name


def test_token_counters_equal_the_usage_the_api_returned(traffic):
    assert traffic.prompt_tokens > 0 and traffic.completion_tokens > 0
    assert engine_delta(traffic, "inference_engine_prompt_tokens_total") == traffic.prompt_tokens
    assert engine_delta(traffic, "inference_engine_generation_tokens_total") == traffic.completion_tokens


def test_finished_requests_by_reason(traffic):
    assert traffic.reasons["length"] >= 8 and traffic.reasons["abort"] == 1
    for reason, count in traffic.reasons.items():
        assert engine_delta(traffic, "inference_engine_request_success_total", finished_reason=reason) == count
    # A request the engine refuses (here a prompt larger than its KV cache) counts under `error`.
    assert traffic.num_rejected == 1 and "error" not in traffic.reasons
    assert engine_delta(traffic, "inference_engine_request_success_total", finished_reason="error") == 1
    assert engine_delta(traffic, "inference_engine_request_success_total") == (traffic.num_requests
                                                                               + traffic.num_rejected)


def test_latency_histograms_count_every_request(traffic):
    n = traffic.num_requests
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "time_to_first_token_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert engine_delta(traffic, f"inference_engine_{name}_count") == n, name
        assert engine_delta(traffic, f"inference_engine_{name}_sum") >= 0, name
    # Time per output token: requests with more than one token per completion (all but none here).
    assert 0 < engine_delta(traffic, "inference_engine_time_per_output_token_seconds_count") <= n
    assert engine_delta(traffic, "inference_engine_e2e_request_latency_seconds_sum") > 0


def test_steps_and_tokens_per_step(traffic):
    steps = engine_delta(traffic, "inference_engine_tokens_per_step_count")
    assert steps == engine_delta(traffic, "inference_engine_step_duration_seconds_count") > 0
    computed = engine_delta(traffic, "inference_engine_tokens_per_step_sum")
    # Every generated token is one decode position; preempted sequences compute their tokens again.
    assert computed >= traffic.completion_tokens + traffic.prompt_tokens - traffic.cached_tokens - traffic.num_requests
    assert steps >= traffic.completion_tokens / 3  # at most 3 sequences decode in one step on this engine


def test_queue_kv_cache_and_preemption(traffic):
    peak = traffic.peak
    assert 2 <= peak["inference_engine_requests_running"] <= 3
    assert peak["inference_engine_requests_waiting"] >= 1
    assert 0.5 < peak["inference_engine_kv_cache_usage_ratio"] <= 1.0
    assert engine_delta(traffic, "inference_engine_preemptions_total") >= 1
    for gauge in ("requests_running", "requests_waiting"):  # back to idle
        assert traffic.engine_after.value(f"inference_engine_{gauge}") == 0


def test_prefix_cache_counters(traffic):
    hits = engine_delta(traffic, "inference_engine_prefix_cache_hits_total")
    queries = engine_delta(traffic, "inference_engine_prefix_cache_queries_total")
    # Whole 16-token blocks of the shared prompt are reused (at least one; never the whole prompt).
    assert traffic.cached_tokens % 16 == 0 and 16 <= traffic.cached_tokens < traffic.shared_prompt_tokens
    assert traffic.cached_tokens <= hits <= queries


def test_model_info(traffic):
    assert traffic.engine_after.value("inference_engine_model_info", model_name=traffic.model_name) == 1


def proxy_delta(traffic, name, **labels):
    return delta(traffic.proxy_after, traffic.proxy_before, name, **labels)


def test_proxy_requests_by_route_and_status(traffic):
    for (route, status), count in traffic.statuses.items():
        assert proxy_delta(traffic, "rest_proxy_http_requests_total", route=route, status=status) == count
    for route in {r for r, _ in traffic.statuses}:
        count = sum(c for (r, _), c in traffic.statuses.items() if r == route)
        assert proxy_delta(traffic, "rest_proxy_http_request_duration_seconds_count", route=route) == count
    assert proxy_delta(traffic, "rest_proxy_time_to_first_token_seconds_count", endpoint="chat") == 1


def test_proxy_sse_streams_and_grpc_errors(traffic):
    assert traffic.sse_open_during_stream == 1
    assert traffic.proxy_after.value("rest_proxy_sse_streams_open") == 0
    for code, count in traffic.grpc_error_codes.items():
        assert proxy_delta(traffic, "rest_proxy_grpc_errors_total", code=code) == count


@pytest.mark.parametrize("outcome", ["ok", "error"])
def test_mcp_tool_calls_by_server_tool_and_outcome(traffic, outcome):
    value = traffic.mcp_proxy_after.value("rest_proxy_mcp_tool_calls_total", server="calc", tool="add",
                                          outcome=outcome)
    assert value == traffic.mcp_outcomes[outcome]
    assert traffic.mcp_proxy_after.value("rest_proxy_mcp_tools", server="calc") >= 1
