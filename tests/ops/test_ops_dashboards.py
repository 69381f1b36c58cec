"""The Grafana dashboards: loaded with grafana-foundation-sdk, every PromQL expression names only metrics
the engine and the proxy really exported after live traffic, and the panels the issue asks for exist."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel, VariableType
from grafana_foundation_sdk.models.prometheus import Dataquery

from tests.ops.ops_helpers import CHART, DEPLOY

DASHBOARD_DIR = DEPLOY / "grafana"
NAMES = ["inference-engine.json", "rest-proxy.json"]
PROMQL_FUNCTIONS = {"sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
                    "topk", "bottomk", "clamp_min", "clamp_max", "abs", "vector", "scalar"}
PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset"}
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"


def metric_names(expr: str) -> set[str]:
    """Metric names of a PromQL expression; a function outside PROMQL_FUNCTIONS fails the test."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # strings (label values, regexes)
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers, with Grafana variables inside
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors such as [$__rate_interval]
    e = re.sub(GROUPING, "", e)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word = match.group()
        if e[match.end():].lstrip().startswith("("):
            assert word in PROMQL_FUNCTIONS, f"unexpected function {word} in {expr}"
        elif word not in PROMQL_KEYWORDS:
            names.add(word)
    return names


def test_metric_names_parser():
    expr = ('histogram_quantile(0.9, sum by (le, route) (rate(a_bucket{x=~"$m", y="b c"}[$__rate_interval]))) '
            '/ on (le) sum(b_total) or vector(0)')
    assert metric_names(expr) == {"a_bucket", "b_total"}


@pytest.fixture(scope="module")
def dashboards() -> dict[str, Dashboard]:
    register_default_plugins()  # decodes targets into typed Prometheus queries
    return {name: Dashboard.from_json(json.loads((DASHBOARD_DIR / name).read_text())) for name in NAMES}


def panels(dashboard: Dashboard) -> list[Panel]:
    return [p for p in dashboard.panels if not isinstance(p, RowPanel)]


def expressions(dashboard: Dashboard) -> list[str]:
    exprs = []
    for panel in panels(dashboard):
        assert panel.targets, panel.title
        for target in panel.targets:
            assert isinstance(target, Dataquery), (panel.title, type(target))
            exprs.append(target.expr)
    return exprs


def test_loaded_with_the_sdk(dashboards):
    uids = set()
    for name, dashboard in dashboards.items():
        assert dashboard.title and dashboard.uid not in uids
        uids.add(dashboard.uid)
        for panel in panels(dashboard):
            assert panel.datasource.uid == "${datasource}" and panel.grid_pos.w > 0, panel.title
        variables = {v.name: v for v in dashboard.templating.list_val}
        assert variables["datasource"].query == "prometheus"


def test_promql_refers_only_to_exported_metrics(dashboards, traffic):
    exported = (traffic.engine_after.sample_names() | traffic.proxy_after.sample_names()
                | traffic.mcp_proxy_after.sample_names())
    for name, dashboard in dashboards.items():
        exprs = expressions(dashboard)
        exprs += [v.query.removeprefix("label_values(").split(",")[0] for v in dashboard.templating.list_val
                  if v.type_val == VariableType.QUERY]
        for expr in exprs:
            names = metric_names(expr)
            assert names, expr
            assert names <= exported, (name, expr, names - exported)


def test_the_panels_the_issue_asks_for(dashboards):
    engine = " ".join(expressions(dashboards["inference-engine.json"]))
    proxy = " ".join(expressions(dashboards["rest-proxy.json"]))
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                      "e2e_request_latency_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate(inference_engine_{histogram}_bucket" in engine
    for name in ("generation_tokens_total", "prompt_tokens_total", "kv_cache_usage_ratio", "requests_waiting",
                 "requests_running", "preemptions_total", "prefix_cache_hits_total", "prefix_cache_queries_total"):
        assert f"inference_engine_{name}" in engine, name
    for name in ("rest_proxy_http_requests_total{status=~\"5..\"}", "rest_proxy_grpc_errors_total",
                 "rest_proxy_mcp_tool_calls_total", "rest_proxy_sse_streams_open"):
        assert name in proxy, name


def test_files_match_the_generator_and_the_chart():
    spec = importlib.util.spec_from_file_location("ops_dashboards", DASHBOARD_DIR / "dashboards.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert sorted(generator.DASHBOARDS) == NAMES
    for name, build in generator.DASHBOARDS.items():
        text = generator.render(build)
        assert (DASHBOARD_DIR / name).read_text() == text, "run python deploy/grafana/dashboards.py"
        assert (CHART / "dashboards" / name).read_text() == text, "run python deploy/grafana/dashboards.py"
