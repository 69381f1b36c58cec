"""What the proxy discloses and how it presents itself to engines that want a key and (mutual) TLS."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import openai
import pytest
from openai import OpenAI

from inference_service.config import ServerConfig
from inference_service.security import ApiKeyInterceptor, server_credentials
from tests.ops.ops_helpers import Scrape
from tests.proxy.fake_engine import FakeEngine, FakeEngineServer, free_port
from tests.tls_certs import make_tls_files

KEY = "client-key"
ENGINE_KEY = "engine-key"


def get(server, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.url + path, headers=headers, timeout=30)


def test_models_show_names_not_paths(start_proxy):
    engine = FakeEngineServer(FakeEngine(model_name="secret-model")).start()
    try:
        proxy = start_proxy(engines=[engine.target])
        listed = get(proxy, "/v1/models").json()["data"]
        assert [(m["id"], m["root"]) for m in listed] == [("secret-model", "secret-model")]
        one = get(proxy, "/v1/models/secret-model").json()
        assert one["root"] == "secret-model"
        assert "/fake" not in json.dumps(listed) + json.dumps(one)  # the engine's model_path is /fake/secret-model
    finally:
        engine.stop()


def test_health_tells_only_a_status(start_proxy, fake_server):
    proxy = start_proxy(engines=[fake_server.target], api_key=KEY)
    response = get(proxy, "/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    assert fake_server.target not in response.text and str(fake_server.port) not in response.text
    denied = get(proxy, "/health?detail=true")
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert get(proxy, "/health?detail=true", key="wrong").status_code == 401
    detail = get(proxy, "/health?detail=true", key=KEY).json()
    assert detail == {"status": "ok", "engines": [{"target": fake_server.target, "model": "fake-model",
                                                   "serving": True}], "mcp_servers": {}}


def test_health_detail_without_a_key_configured(start_proxy, fake_server):
    proxy = start_proxy(engines=[fake_server.target])
    assert get(proxy, "/health").json() == {"status": "ok"}
    assert get(proxy, "/health?detail=true").json()["engines"][0]["target"] == fake_server.target


def test_unreachable_engine_health_is_503_without_addresses(start_proxy):
    target = f"127.0.0.1:{free_port()}"
    proxy = start_proxy(engines=[target], api_key=KEY)
    response = get(proxy, "/health")
    assert (response.status_code, response.json()) == (503, {"status": "unavailable"})


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_docs_need_the_key(start_proxy, fake_server, path):
    proxy = start_proxy(engines=[fake_server.target], api_key=KEY)
    assert get(proxy, path).status_code == 401
    assert get(proxy, path, key="wrong").status_code == 401
    assert get(proxy, path, key=KEY).status_code == 200
    open_proxy = start_proxy(engines=[fake_server.target])
    assert get(open_proxy, path).status_code == 200


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_no_docs_switches_them_off(start_proxy, fake_server, path):
    proxy = start_proxy(engines=[fake_server.target], api_key=KEY, docs=False)
    assert get(proxy, path, key=KEY).status_code == 404
    assert get(proxy, path).status_code == 401  # no hint whether they exist to callers without the key


def test_401s_are_counted_by_route(start_proxy, fake_server):
    proxy = start_proxy(engines=[fake_server.target], api_key=KEY)
    for _ in range(2):
        assert httpx.post(proxy.url + "/v1/chat/completions", json={}, timeout=30).status_code == 401
    assert get(proxy, "/v1/models").status_code == 401
    assert get(proxy, "/v1/no-such-route-4711").status_code == 401
    scrape = Scrape.parse(get(proxy, "/metrics").text)
    total = "rest_proxy_http_requests_total"
    assert scrape.value(total, route="/v1/chat/completions", method="POST", status="401") == 2
    assert scrape.value(total, route="/v1/models", method="GET", status="401") == 1
    assert scrape.value(total, route="unmatched", status="401") == 1
    assert "/v1/no-such-route-4711" not in get(proxy, "/metrics").text


def test_model_info_polling_is_not_a_grpc_error(start_proxy):
    """An engine that is away is polled every second; only failed requests count as gRPC errors."""
    proxy = start_proxy(engines=[f"127.0.0.1:{free_port()}"], engine_refresh_interval=0.05)
    for _ in range(3):  # each asks the engine again (503 until an engine has described its model)
        assert get(proxy, "/v1/models").status_code == 503
    client = OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}])
    assert info.value.status_code == 503
    scrape = Scrape.parse(get(proxy, "/metrics").text)
    assert scrape.value("rest_proxy_grpc_errors_total") == 0


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def guarded_engine(tls):
    """The fake engine behind the real engine's key check and mutual TLS."""
    config = ServerConfig(api_key=ENGINE_KEY, tls_cert=str(tls.server_cert), tls_key=str(tls.server_key),
                          tls_ca=str(tls.ca))
    server = FakeEngineServer(FakeEngine(), interceptors=[ApiKeyInterceptor(ENGINE_KEY)],
                              credentials=server_credentials(config)).start()
    yield server
    server.stop()


def test_proxy_presents_key_and_client_certificate(start_proxy, guarded_engine, tls):
    guarded_engine.engine.reset()
    proxy = start_proxy(engines=[guarded_engine.target], engine_api_key=ENGINE_KEY, engine_tls_ca=str(tls.ca),
                        engine_tls_cert=str(tls.client_cert), engine_tls_key=str(tls.client_key))
    client = OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    reply = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].message.content == "Hello from the fake engine."
    chunks = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}],
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello from the fake engine."
    tokens = httpx.post(proxy.url + "/tokenize", json={"model": "fake-model", "prompt": "abcdef"}, timeout=30)
    assert tokens.status_code == 200, tokens.text
    assert [m.id for m in client.models.list().data] == ["fake-model"]


def test_wrong_engine_key_is_a_502_not_the_clients_401(start_proxy, guarded_engine, tls):
    proxy = start_proxy(engines=[guarded_engine.target], engine_api_key="wrong", engine_tls_ca=str(tls.ca),
                        engine_tls_cert=str(tls.client_cert), engine_tls_key=str(tls.client_key))
    models = get(proxy, "/v1/models")  # GetModelInfo is refused too
    assert models.status_code == 502 and models.json()["error"]["code"] == "engine_auth_failed"
    # The health check needs no key: the engine is up, the proxy's key is what is wrong.
    assert get(proxy, "/health").status_code == 200
    client = OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}])
    assert info.value.status_code == 502
    assert info.value.body["code"] == "engine_auth_failed"
    assert "refused the proxy's credentials (check --engine-api-key)" in info.value.body["message"]


@pytest.mark.parametrize("how", ["plaintext", "no-client-cert", "no-key"])
def test_engine_refuses_a_proxy_without_its_credentials(start_proxy, guarded_engine, tls, how):
    settings = {"engine_api_key": ENGINE_KEY, "engine_tls_ca": str(tls.ca), "engine_tls_cert": str(tls.client_cert),
                "engine_tls_key": str(tls.client_key)}
    if how == "plaintext":
        settings = {"engine_api_key": ENGINE_KEY}
    elif how == "no-client-cert":
        settings = {"engine_api_key": ENGINE_KEY, "engine_tls_ca": str(tls.ca)}
    else:
        settings.pop("engine_api_key")
    proxy = start_proxy(engines=[guarded_engine.target], **settings)
    # Without TLS or a client certificate no connection is made (503); without the key the engine answers
    # UNAUTHENTICATED, which is the proxy's fault (502), not the client's (401).
    expected = 502 if how == "no-key" else 503
    assert get(proxy, "/v1/models").status_code == expected
    client = OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "Hi"}])
    assert info.value.status_code == expected


def test_proxy_on_a_taken_port_exits_with_a_clear_message(fake_server):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "rest_proxy.cli", "serve", "--engine", fake_server.target,
                                 "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"rest-proxy: cannot listen on 127.0.0.1:{port}: the address is already in use" in result.stderr
