"""The chart's exposure settings (NetworkPolicy, engine key and TLS wiring, gRPC-Web off), validated for
Kubernetes; and the chart's Envoy presenting a client certificate to an engine with mutual TLS and a key."""

from __future__ import annotations

import base64

import grpc
import helm_python
import kubernetes_validate
import pytest
import yaml

from inference_service.api import pb, pb_grpc
from inference_service.config import ServerConfig
from inference_service.security import ApiKeyInterceptor, server_credentials
from tests.ops.ops_helpers import CHART, envoy_config_for, free_ports, start_envoy
from tests.ops.test_ops_chart import KUBE_VERSION, container, envoy_config, envoy_validate, find
from tests.proxy.fake_engine import FakeEngine, FakeEngineServer
from tests.tls_certs import make_tls_files

SECURE = {"engine": {"apiKey": {"value": "k3y"},
                     "tls": {"enabled": True, "secretName": "engine-tls", "requireClientCert": True,
                             "clientSecretName": "engine-client-tls"}},
          "proxy": {"docs": False}}
ENGINE_LABELS = {"app.kubernetes.io/name": "inference-service", "app.kubernetes.io/instance": "llm",
                 "app.kubernetes.io/component": "engine"}


def render(values: dict) -> list[dict]:
    chart = helm_python.Chart.load(str(CHART))
    try:
        manifests = chart.render(values, name="llm", namespace="serving")
    finally:
        chart.close()
    return [doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def http_filters(config: dict) -> list[str]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return [f["name"] for f in hcm["http_filters"]]


def test_network_policy_admits_only_proxy_and_envoy_to_the_engine_port():
    objects = render({})
    policy = find(objects, "NetworkPolicy", "-engine")
    kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == ENGINE_LABELS
    assert spec["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule = spec["ingress"]
    assert grpc_rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    assert [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in grpc_rule["from"]] == [
        "proxy", "envoy"]
    for peer in grpc_rule["from"]:  # exactly the labels of this release's pods
        component = peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        pod_labels = find(objects, "Deployment", f"-{component}")["spec"]["template"]["metadata"]["labels"]
        assert peer["podSelector"]["matchLabels"].items() <= pod_labels.items()
    engine_pod = find(objects, "Deployment", "-engine")["spec"]["template"]["metadata"]["labels"]
    assert ENGINE_LABELS.items() <= engine_pod.items()
    assert metrics_rule == {"ports": [{"port": 9090, "protocol": "TCP"}]}  # Prometheus, from anywhere
    # Envoy off: only the proxy; extra peers appended.
    extra = {"ipBlock": {"cidr": "10.0.0.0/24"}}
    policy = find(render({"envoy": {"enabled": False}, "engine": {"networkPolicy": {"extraFrom": [extra]}}}),
                  "NetworkPolicy", "-engine")
    kubernetes_validate.validate(policy, KUBE_VERSION, strict=True)
    peers = policy["spec"]["ingress"][0]["from"]
    assert peers[1:] == [extra] and peers[0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "proxy"
    assert not [o for o in render({"engine": {"networkPolicy": {"enabled": False}}}) if o["kind"] == "NetworkPolicy"]


def test_engine_key_and_mutual_tls_are_wired(tmp_path):
    objects = render(SECURE)
    for obj in objects:
        if obj["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    engine = find(objects, "Deployment", "-engine")
    c = container(engine)
    assert "--host=0.0.0.0" in c["args"]
    assert {"--tls-cert=/etc/inference-service/tls/tls.crt", "--tls-key=/etc/inference-service/tls/tls.key",
            "--tls-ca=/etc/inference-service/tls/ca.crt"} <= set(c["args"])
    assert not any(a.startswith("--api-key") for a in c["args"])  # the key stays out of the pod spec's args
    key_ref = next(e for e in c["env"] if e["name"] == "INFERENCE_SERVICE_API_KEY")["valueFrom"]["secretKeyRef"]
    assert key_ref == {"name": "llm-inference-service-engine", "key": "engine-api-key"}
    assert find(objects, "Secret", "-engine")["data"] == {"engine-api-key": base64.b64encode(b"k3y").decode()}
    volumes = {v["name"]: v for v in engine["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"] == {"secretName": "engine-tls"}
    # kubelet's gRPC probes speak no TLS: with TLS they check the port; without, grpc.health.v1 (no key needed).
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["tcpSocket"] == {"port": 50051} and "grpc" not in c[probe]
    keyed = container(find(render({"engine": {"apiKey": {"existingSecret": "mine"}}}), "Deployment", "-engine"))
    assert keyed["readinessProbe"]["grpc"] == {"port": 50051, "service": "inference.v1.InferenceService"}
    assert next(e for e in keyed["env"] if e["name"] == "INFERENCE_SERVICE_API_KEY")["valueFrom"] == {
        "secretKeyRef": {"name": "mine", "key": "engine-api-key"}}

    proxy = container(find(objects, "Deployment", "-proxy"))
    assert "--no-docs" in proxy["args"]
    assert not any(a.startswith("--engine-tls") for a in proxy["args"])  # it talks to Envoy, Envoy does TLS
    engine_key = next(e for e in proxy["env"] if e["name"] == "REST_PROXY_ENGINE_API_KEY")
    assert engine_key["valueFrom"]["secretKeyRef"] == key_ref

    envoy = find(objects, "Deployment", "-envoy")
    mounts = {m["name"]: m["mountPath"] for m in container(envoy)["volumeMounts"]}
    assert mounts["engine-tls"] == "/etc/envoy/engine-tls"
    volumes = {v["name"]: v for v in envoy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["engine-tls"]["secret"] == {"secretName": "engine-client-tls"}

    direct = render({**SECURE, "envoy": {"enabled": False}})
    proxy = find(direct, "Deployment", "-proxy")
    assert {"--engine=llm-inference-service-engine:50051", "--engine-tls-ca=/etc/rest-proxy/engine-tls/ca.crt",
            "--engine-tls-cert=/etc/rest-proxy/engine-tls/tls.crt",
            "--engine-tls-key=/etc/rest-proxy/engine-tls/tls.key"} <= set(container(proxy)["args"])
    volumes = {v["name"]: v for v in proxy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["engine-tls"]["secret"] == {"secretName": "engine-client-tls"}


def test_tls_needs_its_secrets():
    chart = helm_python.Chart.load(str(CHART))
    try:
        with pytest.raises(helm_python.HelmValuesError, match="/engine/tls"):
            chart.render({"engine": {"tls": {"enabled": True}}}, name="llm", namespace="serving")
    finally:
        chart.close()


def test_grpc_web_is_off_unless_asked():
    assert "envoy.filters.http.grpc_web" not in http_filters(envoy_config(render({})))
    assert "envoy.filters.http.grpc_web" in http_filters(envoy_config(render({"envoy": {"grpcWeb": {"enabled": True}}})))


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def chart_envoy_with_tls(tls, upstream_port: int, ports: list[int]) -> dict:
    """The chart's Envoy config for mutual TLS to the engines, with the test's certificate files."""
    config = envoy_config(render(SECURE))
    config = envoy_config_for(config, ports[0], ports[1], [upstream_port])
    config["static_resources"]["listeners"] = [l for l in config["static_resources"]["listeners"]
                                               if l["name"] == "grpc"]
    config["static_resources"]["clusters"] = [c for c in config["static_resources"]["clusters"]
                                              if c["name"] == "engines"]
    cluster = config["static_resources"]["clusters"][0]
    cluster["cluster_type"]["typed_config"]["dns_refresh_rate"] = "5s"
    tls_context = cluster["transport_socket"]["typed_config"]["common_tls_context"]
    paths = {"/etc/envoy/engine-tls/ca.crt": tls.ca, "/etc/envoy/engine-tls/tls.crt": tls.client_cert,
             "/etc/envoy/engine-tls/tls.key": tls.client_key}
    tls_context["validation_context"]["trusted_ca"]["filename"] = str(paths[
        tls_context["validation_context"]["trusted_ca"]["filename"]])
    for pair in tls_context["tls_certificates"]:
        pair["certificate_chain"]["filename"] = str(paths[pair["certificate_chain"]["filename"]])
        pair["private_key"]["filename"] = str(paths[pair["private_key"]["filename"]])
    return config


def test_chart_envoy_tls_config_is_valid(tls, tmp_path):
    config = chart_envoy_with_tls(tls, 50051, free_ports(2))
    assert "Deprecated field" not in envoy_validate(config, tmp_path)


def test_envoy_presents_the_client_certificate_and_passes_the_key(tls, tmp_path):
    engine_config = ServerConfig(api_key="k3y", tls_cert=str(tls.server_cert), tls_key=str(tls.server_key),
                                 tls_ca=str(tls.ca))
    engine = FakeEngineServer(FakeEngine(), interceptors=[ApiKeyInterceptor("k3y")],
                              credentials=server_credentials(engine_config)).start()
    envoy = start_envoy(chart_envoy_with_tls(tls, engine.port, free_ports(2)), tmp_path)
    try:
        with grpc.insecure_channel(envoy.target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            # Through Envoy's mutual TLS the engine answers the caller holding the key...
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("authorization", "Bearer k3y"),),
                                     timeout=15, wait_for_ready=True)
            assert info.model_name == "fake-model"
            # ... and refuses one without it: Envoy is no way around the engine's key.
            with pytest.raises(grpc.RpcError) as err:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=15)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        envoy.stop()
        engine.stop()


def test_operations_docs_state_the_threat_model():
    from tests.ops.ops_helpers import ROOT

    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("## Threat model: what is exposed where"):]
    for needle in ("--api-key", "--tls-cert", "--tls-ca", "--engine-api-key", "--no-docs", "?detail=true",
                   "grpc.health.v1", "grpc.reflection.v1", "NetworkPolicy", "grpcWeb", "so_reuseport",
                   "127.0.0.1", 'finished_reason="error"', "rest_proxy_grpc_errors_total"):
        assert needle in section, needle
    # Every chart value of the engine's guards is documented there.
    values = yaml.safe_load((CHART / "values.yaml").read_text())["engine"]
    for group in ("apiKey", "tls", "networkPolicy"):
        for key in values[group]:
            assert f"engine.{group}" in section and (f".{key}" in section or f"`{key}" in section), (group, key)
