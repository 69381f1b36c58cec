"""The Helm chart: lint, render (helm-python-sdk), validate every manifest for Kubernetes 1.30
(kubernetes-validate, offline, strict), check the wiring between objects, and the values schema."""

from __future__ import annotations

import json
import subprocess

import helm_python
import kubernetes_validate
import pytest
import yaml

from rest_proxy.mcp_config import load_mcp_config
from tests.ops.ops_helpers import CHART, DEPLOY, ENVOY_CONFIG, build_descriptor, envoy_binary, load_envoy_config

KUBE_VERSION = "1.30.0"
VALUE_FILES = {"default": None, "gpu": CHART / "ci" / "gpu-values.yaml", "cpu": CHART / "ci" / "cpu-values.yaml"}


def values_of(name: str) -> dict:
    path = VALUE_FILES[name]
    return yaml.safe_load(path.read_text()) if path else {}


@pytest.fixture(scope="module")
def chart():
    chart = helm_python.Chart.load(str(CHART))
    yield chart
    chart.close()


@pytest.fixture(scope="module")
def rendered(chart) -> dict[str, list[dict]]:
    """Objects of each values file, rendered as release `llm` in namespace `serving`."""
    out = {}
    for name in VALUE_FILES:
        manifests = chart.render(values_of(name), name="llm", namespace="serving")
        out[name] = [doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
                     for doc in yaml.safe_load_all(text) if doc]
    return out


def find(objects: list[dict], kind: str, suffix: str = "") -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(matches) == 1, (kind, suffix, [o["metadata"]["name"] for o in matches])
    return matches[0]


def container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def envoy_config(objects: list[dict]) -> dict:
    return yaml.safe_load(find(objects, "ConfigMap", "-envoy")["data"]["envoy.yaml"])


@pytest.mark.parametrize("values", list(VALUE_FILES))
def test_lint_is_clean(values):
    report = helm_python.lint(str(CHART), values_of(values), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", list(VALUE_FILES))
def test_every_manifest_is_valid_for_kubernetes(rendered, values):
    kinds = set()
    for obj in rendered[values]:
        kinds.add(obj["kind"])
        if obj["kind"] == "ServiceMonitor":  # a CRD: no schema offline, checked in test_gpu_values_wiring
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    assert {"Deployment", "Service", "ConfigMap"} <= kinds


def test_gpu_values_wiring(rendered):
    objects = rendered["gpu"]
    engine = find(objects, "Deployment", "-engine")
    pod, c = engine["spec"]["template"]["spec"], container(engine)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu" and "podAntiAffinity" in pod["affinity"]
    assert "--model=/models/Qwen3-8B" in c["args"] and "--device=cuda" in c["args"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models-ro", "readOnly": True}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm" and mounts["model"] == "/models"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == 50051  # native gRPC probes on grpc.health.v1
    assert c["readinessProbe"]["grpc"]["service"] == "inference.v1.InferenceService"

    proxy = container(find(objects, "Deployment", "-proxy"))
    key_ref = next(e for e in proxy["env"] if e["name"] == "REST_PROXY_API_KEY")["valueFrom"]["secretKeyRef"]
    assert key_ref == {"name": "inference-api-key", "key": "api-key"}
    assert find(objects, "ConfigMap", "-mcp")["data"]["mcp.json"]
    assert "--mcp-config=/etc/rest-proxy/mcp.json" in proxy["args"]
    assert find(objects, "HorizontalPodAutoscaler")["spec"]["maxReplicas"] == 20
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "PodDisruptionBudget"} == {
        "llm-inference-service-engine", "llm-inference-service-proxy", "llm-inference-service-envoy"}

    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == 3
    services = [o for o in objects if o["kind"] == "Service"]
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        selected = [s for s in services
                    if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert len(selected) == 1, monitor["metadata"]["name"]
        port_names = {p["name"] for p in selected[0]["spec"]["ports"]}
        assert monitor["spec"]["endpoints"][0]["port"] in port_names


def test_mcp_config_map_is_what_the_proxy_reads(rendered, tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text(find(rendered["gpu"], "ConfigMap", "-mcp")["data"]["mcp.json"])
    servers = load_mcp_config(path)
    assert servers["search"].url == "http://mcp-search.tools.svc:8080/mcp"
    assert servers["calc"].command == "python" and servers["calc"].args == ["-m", "calc_server"]


@pytest.mark.parametrize("values", list(VALUE_FILES))
def test_services_select_their_pods_and_names_resolve(rendered, values):
    objects = rendered[values]
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for service in services.values():
        selector = service["spec"]["selector"].items()
        targets = [d for d in deployments.values() if selector <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(targets) == 1, service["metadata"]["name"]
        container_ports = {p["name"] for p in container(targets[0])["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports
    # The proxy reaches Envoy's Service; Envoy resolves the engines' headless Service.
    proxy = container(deployments["llm-inference-service-proxy"])
    engine_arg = next(a for a in proxy["args"] if a.startswith("--engine="))
    assert engine_arg == "--engine=llm-inference-service-envoy:8080"
    assert any(p["port"] == 8080 for p in services["llm-inference-service-envoy"]["spec"]["ports"])
    cluster = next(c for c in envoy_config(objects)["static_resources"]["clusters"] if c["name"] == "engines")
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert address["address"] == "llm-inference-service-engine-headless.serving.svc.cluster.local"
    assert services["llm-inference-service-engine-headless"]["spec"]["clusterIP"] == "None"


def test_dashboards_config_map_ships_the_plain_files(rendered):
    data = find(rendered["default"], "ConfigMap", "-dashboards")["data"]
    assert data.keys() == {"inference-engine.json", "rest-proxy.json"}
    for name, text in data.items():
        assert json.loads(text) == json.loads((DEPLOY / "grafana" / name).read_text())
    assert find(rendered["default"], "ConfigMap", "-dashboards")["metadata"]["labels"]["grafana_dashboard"] == "1"


def envoy_validate(config: dict, tmp_path) -> str:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.mark.parametrize("values", list(VALUE_FILES))
def test_chart_envoy_config_is_valid_for_envoy(rendered, values, tmp_path):
    config = envoy_config(rendered[values])
    filters = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for f in filters["http_filters"]:
        if f["name"] == "envoy.filters.http.grpc_json_transcoder":  # the descriptor a ConfigMap would mount
            f["typed_config"]["proto_descriptor"] = str(build_descriptor(tmp_path / "descriptor.pb"))
    output = envoy_validate(config, tmp_path)
    assert "Deprecated field" not in output


def test_standalone_envoy_config_is_valid_and_matches_the_chart(rendered, tmp_path):
    standalone = load_envoy_config()
    assert "Deprecated field" not in envoy_validate(standalone, tmp_path)
    chart = envoy_config(rendered["default"])

    def engines_cluster(config):
        cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "engines")
        return {k: v for k, v in cluster.items() if k != "load_assignment"}

    def grpc_listener(config):
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        return {k: v for k, v in hcm.items()}

    assert engines_cluster(chart) == engines_cluster(standalone), f"keep {ENVOY_CONFIG.name} and the chart in step"
    assert grpc_listener(chart) == grpc_listener(standalone)
    route = grpc_listener(standalone)["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["timeout"] == "0s" and "per_try_timeout" not in route["retry_policy"]
    assert set(route["retry_policy"]["retry_on"].split(",")) == {
        "connect-failure", "refused-stream", "reset-before-request", "unavailable"}
    assert engines_cluster(standalone)["health_checks"][0]["no_traffic_interval"] == "2s"


def test_tensor_parallel_size_sets_the_gpu_request(chart):
    values = {**values_of("gpu"), "engine": {**values_of("gpu")["engine"], "tensorParallelSize": 4}}
    objects = [doc for path, text in sorted(chart.render(values, name="llm", namespace="serving").items())
               if not path.endswith("NOTES.txt") for doc in yaml.safe_load_all(text) if doc]
    c = container(find(objects, "Deployment", "-engine"))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert "--tensor-parallel-size=4" in c["args"] and "--device=cuda" in c["args"]
    notes = chart.render(values, name="llm", namespace="serving")["inference-service/templates/NOTES.txt"]
    assert "4 x nvidia.com/gpu each" in notes


@pytest.mark.parametrize("bad, where", [
    ({"engine": {"gpu": {"count": -1}}}, "/engine/gpu/count"),
    ({"engine": {"model": {"volume": {"type": "nfs"}}}}, "/engine/model/volume/type"),
    ({"engine": {"model": {"volume": {"type": "pvc"}}}}, "/engine/model/volume"),
    ({"envoy": {"healthCheck": {"noTrafficInterval": "2 seconds"}}}, "/envoy/healthCheck/noTrafficInterval"),
    ({"proxy": {"autoscaling": {"targetCPUUtilizationPercentage": 150}}}, "/proxy/autoscaling"),
    ({"engine": {"gpus": 1}}, "/engine"),
    ({"proxy": {"workers": 0}}, "/proxy/workers"),
    ({"engine": {"tensorParallelSize": 0}}, "/engine/tensorParallelSize"),
])
def test_schema_rejects_bad_values(chart, bad, where):
    with pytest.raises(helm_python.HelmValuesError, match=where):
        chart.render(bad, name="llm", namespace="serving")
    report = helm_python.lint(str(CHART), bad, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"])


def test_notes_tell_how_to_connect(chart):
    notes = chart.render(values_of("cpu"), name="llm", namespace="serving")["inference-service/templates/NOTES.txt"]
    assert "port-forward svc/llm-inference-service-proxy 8000:8000" in notes
    assert "get secret llm-inference-service-proxy" in notes
    assert "1 x nvidia.com/gpu" not in notes and "on CPU" in notes


def test_proxy_workers_reach_the_command(rendered, chart):
    """`proxy.workers` is `rest-proxy serve --workers`; null leaves the proxy's own default."""
    def workers_args(objects):
        return [a for a in container(find(objects, "Deployment", "-proxy"))["args"] if a.startswith("--workers")]
    assert workers_args(rendered["default"]) == ["--workers=2"]
    assert workers_args(rendered["cpu"]) == ["--workers=1"]
    auto = chart.render({"proxy": {"workers": None}}, name="llm", namespace="serving")
    objects = [doc for path, text in auto.items() if not path.endswith("NOTES.txt")
               for doc in yaml.safe_load_all(text) if doc]
    assert workers_args(objects) == []
