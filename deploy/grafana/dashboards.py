"""Builds the Grafana dashboards with grafana-foundation-sdk and writes them as plain JSON files.

    python deploy/grafana/dashboards.py   # writes deploy/grafana/*.json and helm/inference-service/dashboards/

The JSON files are committed (Grafana and the chart's ConfigMap read them as they are); tests check that
they match this script and that every PromQL expression names only metrics the services export.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions, VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
)
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef, VariableRefresh

ROOT = Path(__file__).resolve().parents[2]
OUTPUT_DIRS = (ROOT / "deploy" / "grafana", ROOT / "helm" / "inference-service" / "dashboards")
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
ENGINE = 'model_name=~"$model_name"'
RATE = "[$__rate_interval]"
QUANTILES = (0.5, 0.9, 0.99)


def query(expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).range()


def panel(title: str, unit: str, targets: list[prometheus.Dataquery], *, description: str = "",
          width: int = 8, stacked: bool = False) -> timeseries.Panel:
    p = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
         .height(8).span(width).line_width(1).fill_opacity(10 if not stacked else 40)
         .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
                 .show_legend(True)))
    for t in targets:
        p = p.with_target(t)
    return p


def quantiles(histogram: str, selector: str, by: str = "") -> list[prometheus.Dataquery]:
    """p50/p90/p99 of a Prometheus histogram over all replicas (per `by` label when given)."""
    group = f"le{', ' + by if by else ''}"
    legend_by = f" {{{{{by}}}}}" if by else ""
    return [query(f"histogram_quantile({q}, sum by ({group}) (rate({histogram}_bucket{{{selector}}}{RATE})))",
                  f"p{int(q * 100)}{legend_by}") for q in QUANTILES]


def big_number(title: str, unit: str, expr: str) -> stat.Panel:
    # Options set explicitly: the SDK writes unset options as null, which its own loader refuses.
    return (stat.Panel().title(title).unit(unit).datasource(DATASOURCE).height(4).span(6)
            .graph_mode(BigValueGraphMode.AREA).color_mode(BigValueColorMode.VALUE)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]))
            .with_target(query(expr, title)))


def base(uid: str, title: str, tags: list[str]) -> dashboard.Dashboard:
    return (dashboard.Dashboard(title).uid(uid).tags(tags).refresh("30s").time("now-1h", "now")
            .timezone("browser").tooltip(DashboardCursorSync.CROSSHAIR).editable()
            .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")))


def engine_dashboard() -> dashboard.Dashboard:
    model_var = (dashboard.QueryVariable("model_name").label("Model").datasource(DATASOURCE)
                 .query("label_values(inference_engine_model_info, model_name)")
                 .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).include_all(True).multi(True).all_value(".*"))
    d = base("inference-engine", "Inference engine", ["inference-service", "llm"]).with_variable(model_var)
    d = (d.with_row(dashboard.Row("Overview"))
         .with_panel(big_number("Requests/s", "reqps",
                                f"sum(rate(inference_engine_request_success_total{{{ENGINE}}}{RATE}))"))
         .with_panel(big_number("Generated tokens/s", "short",
                                f"sum(rate(inference_engine_generation_tokens_total{{{ENGINE}}}{RATE}))"))
         .with_panel(big_number("KV cache used", "percentunit",
                                f"max(inference_engine_kv_cache_usage_ratio{{{ENGINE}}})"))
         .with_panel(big_number("Waiting requests", "short",
                                f"sum(inference_engine_requests_waiting{{{ENGINE}}})")))
    d = (d.with_row(dashboard.Row("Throughput"))
         .with_panel(panel("Token throughput", "short", [
             query(f"sum(rate(inference_engine_prompt_tokens_total{{{ENGINE}}}{RATE}))", "prompt tokens/s"),
             query(f"sum(rate(inference_engine_generation_tokens_total{{{ENGINE}}}{RATE}))", "generated tokens/s"),
         ], description="Tokens of finished requests per second, all replicas."))
         .with_panel(panel("Finished requests by reason", "reqps", [
             query(f"sum by (finished_reason) (rate(inference_engine_request_success_total{{{ENGINE}}}{RATE}))",
                   "{{finished_reason}}"),
         ], stacked=True))
         .with_panel(panel("Tokens per engine step", "short",
                           quantiles("inference_engine_tokens_per_step", ENGINE),
                           description="Batch size in tokens (prefill chunks plus one per decoding sequence).")))
    d = (d.with_row(dashboard.Row("Latency"))
         .with_panel(panel("Time to first token", "s", quantiles("inference_engine_time_to_first_token_seconds",
                                                                  ENGINE)))
         .with_panel(panel("Time per output token", "s",
                           quantiles("inference_engine_time_per_output_token_seconds", ENGINE)))
         .with_panel(panel("End-to-end request latency", "s",
                           quantiles("inference_engine_e2e_request_latency_seconds", ENGINE)))
         .with_panel(panel("Queue time", "s", quantiles("inference_engine_request_queue_time_seconds", ENGINE)))
         .with_panel(panel("Prefill and decode time (p90)", "s", [
             query("histogram_quantile(0.9, sum by (le) (rate("
                   f"inference_engine_request_prefill_time_seconds_bucket{{{ENGINE}}}{RATE})))", "prefill p90"),
             query("histogram_quantile(0.9, sum by (le) (rate("
                   f"inference_engine_request_decode_time_seconds_bucket{{{ENGINE}}}{RATE})))", "decode p90"),
         ]))
         .with_panel(panel("Engine step duration", "s", quantiles("inference_engine_step_duration_seconds",
                                                                   ENGINE))))
    d = (d.with_row(dashboard.Row("Capacity"))
         .with_panel(panel("KV cache usage", "percentunit", [
             query(f"inference_engine_kv_cache_usage_ratio{{{ENGINE}}}", "{{instance}}"),
         ]).min(0).max(1))
         .with_panel(panel("Queue depth", "short", [
             query(f"sum(inference_engine_requests_running{{{ENGINE}}})", "running"),
             query(f"sum(inference_engine_requests_waiting{{{ENGINE}}})", "waiting"),
         ]))
         .with_panel(panel("Preemptions", "short", [
             query(f"sum(rate(inference_engine_preemptions_total{{{ENGINE}}}{RATE}))", "preemptions/s"),
         ], description="Sequences evicted for lack of KV blocks and recomputed later: the cache is too small "
                        "for the load."))
         .with_panel(panel("Prefix cache hit rate", "percentunit", [
             query(f"sum(rate(inference_engine_prefix_cache_hits_total{{{ENGINE}}}{RATE})) / "
                   f"sum(rate(inference_engine_prefix_cache_queries_total{{{ENGINE}}}{RATE}))", "hit rate"),
         ], description="Share of prompt tokens whose KV blocks were reused.").min(0).max(1)))
    return d


def proxy_dashboard() -> dashboard.Dashboard:
    d = base("rest-proxy", "OpenAI REST proxy", ["inference-service", "openai"])
    d = (d.with_row(dashboard.Row("Traffic"))
         .with_panel(panel("Requests by route and status", "reqps", [
             query(f"sum by (route, status) (rate(rest_proxy_http_requests_total{RATE}))", "{{route}} {{status}}"),
         ], stacked=True))
         .with_panel(panel("Error ratio", "percentunit", [
             query(f'sum(rate(rest_proxy_http_requests_total{{status=~"5.."}}{RATE})) / '
                   f"sum(rate(rest_proxy_http_requests_total{RATE}))", "5xx"),
             query(f'sum(rate(rest_proxy_http_requests_total{{status=~"4.."}}{RATE})) / '
                   f"sum(rate(rest_proxy_http_requests_total{RATE}))", "4xx"),
         ]).min(0))
         .with_panel(panel("Open SSE streams", "short", [
             query("sum(rest_proxy_sse_streams_open)", "streams"),
         ])))
    d = (d.with_row(dashboard.Row("Latency"))
         .with_panel(panel("Request duration by route", "s",
                           quantiles("rest_proxy_http_request_duration_seconds", "", by="route"), width=12))
         .with_panel(panel("Time to first token at the proxy", "s",
                           quantiles("rest_proxy_time_to_first_token_seconds", "", by="endpoint"), width=12)))
    d = (d.with_row(dashboard.Row("Errors and tools"))
         .with_panel(panel("Engine (gRPC) errors by code", "short", [
             query(f"sum by (code) (rate(rest_proxy_grpc_errors_total{RATE}))", "{{code}}"),
         ]))
         .with_panel(panel("MCP tool calls", "short", [
             query(f"sum by (server, tool, outcome) (rate(rest_proxy_mcp_tool_calls_total{RATE}))",
                   "{{server}}/{{tool}} {{outcome}}"),
         ], stacked=True))
         .with_panel(panel("MCP tools offered", "short", [
             query("max by (server) (rest_proxy_mcp_tools)", "{{server}}"),
         ])))
    return d


DASHBOARDS = {"inference-engine.json": engine_dashboard, "rest-proxy.json": proxy_dashboard}


def render(build) -> str:
    """The dashboard as Grafana JSON (stable key order, so regenerating gives the same file)."""
    model = build().build()
    return json.dumps(json.loads(json.dumps(model, cls=JSONEncoder)), indent=2, sort_keys=True) + "\n"


def main() -> None:
    for name, build in DASHBOARDS.items():
        text = render(build)
        for out in OUTPUT_DIRS:
            out.mkdir(parents=True, exist_ok=True)
            (out / name).write_text(text)
            print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
