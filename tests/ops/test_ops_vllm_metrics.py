"""vLLM's metric names, scraped from the real engine after real traffic: every one present with vLLM's type
and label `model_name`, and every sample equal to the same sample of ours."""

from __future__ import annotations

from tests.ops.ops_helpers import delta

# vLLM family -> (our family, Prometheus type). The text format drops `_total` from counter family names.
VLLM_FAMILIES = {
    "vllm:num_requests_running": ("inference_engine_requests_running", "gauge"),
    "vllm:num_requests_waiting": ("inference_engine_requests_waiting", "gauge"),
    "vllm:kv_cache_usage_perc": ("inference_engine_kv_cache_usage_ratio", "gauge"),
    "vllm:prefix_cache_queries": ("inference_engine_prefix_cache_queries", "counter"),
    "vllm:prefix_cache_hits": ("inference_engine_prefix_cache_hits", "counter"),
    "vllm:num_preemptions": ("inference_engine_preemptions", "counter"),
    "vllm:prompt_tokens": ("inference_engine_prompt_tokens", "counter"),
    "vllm:generation_tokens": ("inference_engine_generation_tokens", "counter"),
    "vllm:iteration_tokens_total": ("inference_engine_tokens_per_step", "histogram"),
    "vllm:time_to_first_token_seconds": ("inference_engine_time_to_first_token_seconds", "histogram"),
    "vllm:time_per_output_token_seconds": ("inference_engine_time_per_output_token_seconds", "histogram"),
    "vllm:e2e_request_latency_seconds": ("inference_engine_e2e_request_latency_seconds", "histogram"),
    "vllm:request_queue_time_seconds": ("inference_engine_request_queue_time_seconds", "histogram"),
    "vllm:request_prefill_time_seconds": ("inference_engine_request_prefill_time_seconds", "histogram"),
    "vllm:request_decode_time_seconds": ("inference_engine_request_decode_time_seconds", "histogram"),
    "vllm:request_success": ("inference_engine_request_success", "counter"),
}


def _samples_of(scrape, family: str, kind: str) -> dict[tuple, float]:
    """Samples of `family` keyed by (suffix, labels); counters' `_created` timestamps left out."""
    suffixes = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}[kind]
    out = {}
    for (name, labels), value in scrape.samples.items():
        for suffix in suffixes:
            if name == family + suffix:
                out[(suffix, labels)] = value
    return out


def test_vllm_families_exist_with_their_types_and_model_name(traffic):
    scrape = traffic.engine_after
    for vllm_name, (_, kind) in VLLM_FAMILIES.items():
        assert scrape.families.get(vllm_name) == kind, vllm_name
        samples = _samples_of(scrape, vllm_name, kind)
        assert samples, vllm_name
        for _, labels in samples:
            assert dict(labels)["model_name"] == traffic.model_name, (vllm_name, labels)


def test_every_vllm_sample_equals_ours(traffic):
    scrape = traffic.engine_after
    for vllm_name, (ours, kind) in VLLM_FAMILIES.items():
        assert _samples_of(scrape, vllm_name, kind) == _samples_of(scrape, ours, kind), vllm_name


def test_vllm_counters_match_what_the_api_returned(traffic):
    assert traffic.prompt_tokens > 0 and traffic.completion_tokens > 0
    assert delta(traffic.engine_after, traffic.engine_before, "vllm:prompt_tokens_total") == traffic.prompt_tokens
    assert (delta(traffic.engine_after, traffic.engine_before, "vllm:generation_tokens_total")
            == traffic.completion_tokens)
    assert traffic.reasons["length"] >= 8 and traffic.reasons["abort"] == 1
    for reason, count in traffic.reasons.items():
        assert delta(traffic.engine_after, traffic.engine_before, "vllm:request_success_total",
                     finished_reason=reason) == count, reason
    assert delta(traffic.engine_after, traffic.engine_before, "vllm:request_success_total",
                 finished_reason="error") == traffic.num_rejected == 1
    n = traffic.num_requests
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count"):
        assert delta(traffic.engine_after, traffic.engine_before, name) == n, name
