"""The engine port's guards, on a real engine process over loopback: the API key on gRPC metadata, TLS
and mutual TLS, reflection v1 behind the key, health checks without it, and a taken port refused."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from inference_service.api import pb, pb_grpc
from inference_service.reflection import V1_SERVICE_NAME
from tests.grpc_client import REPO_ROOT, GenerateStream, free_port, greedy, start_engine
from tests.tls_certs import make_tls_files

KEY = "engine-secret-\N{GREEK SMALL LETTER ALPHA}".encode().hex()  # any printable key
AUTH = (("authorization", f"Bearer {KEY}"),)
SERVICES = {"inference.v1.InferenceService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"}


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def mtls_credentials(tls, cert=None, key=None, ca=None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=(ca or tls.ca).read_bytes(),
                                        private_key=(key or tls.client_key).read_bytes(),
                                        certificate_chain=(cert or tls.client_cert).read_bytes())


@pytest.fixture(scope="module")
def engine(tls, tmp_path_factory):
    """Mutual TLS and an API key: the settings of an engine listening beyond loopback."""
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    proc = start_engine("--max-model-len", "256", "--kv-cache-memory", "16", "--api-key", KEY,
                        "--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key), "--tls-ca", str(tls.ca),
                        log_path=str(log), credentials=mtls_credentials(tls))
    yield proc
    proc.stop()


@pytest.fixture
def channel(engine, tls):
    with grpc.secure_channel(engine.target, mtls_credentials(tls)) as channel:
        yield channel


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", KEY),),
                                      (("authorization", f"Basic {KEY}"),),
                                      (("authorization", f"Bearer {KEY}x"),)],
                         ids=["none", "wrong", "no-scheme", "basic", "longer"])
def test_calls_without_the_key_are_unauthenticated(channel, metadata):
    stub = pb_grpc.InferenceServiceStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer <key>" in info.value.details()
    responses = stub.Generate(iter([pb.GenerateRequest(start=pb.StartGeneration(request_id="x", text="Hi"))]),
                              metadata=metadata, timeout=10)
    assert code_of(lambda: list(responses)) == grpc.StatusCode.UNAUTHENTICATED
    tokenize = stub.Tokenize(iter([pb.TokenizeRequest(request_id="t", tokenize=pb.TokenizeText(text="Hi"))]),
                             metadata=metadata, timeout=10)
    assert code_of(lambda: list(tokenize)) == grpc.StatusCode.UNAUTHENTICATED


def test_the_key_and_a_client_certificate_get_answers(channel):
    stub = pb_grpc.InferenceServiceStub(channel)
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=10).max_context_length == 256
    # gRPC metadata keys are lower case; the scheme is case-insensitive as in HTTP.
    lower = (("authorization", f"bearer {KEY}"),)
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=lower, timeout=10).model_name
    stream = GenerateStream(stub, timeout=60, metadata=AUTH)
    stream.start("q", text="The capital of France is", **greedy(3, ignore_eos=True))
    stream.wait_done({"q"})
    stream.drain()
    assert stream.results["q"].usage.completion_tokens == 3 and stream.results["q"].error is None


def test_health_answers_without_the_key(channel):
    """Kubernetes' gRPC probes and Envoy's health checks send no metadata."""
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "inference.v1.InferenceService"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def v1_reflection_classes():
    """Message classes of grpc.reflection.v1, built here from the v1alpha file with the package renamed (a
    client's own copy, independent of the server's), in a pool of their own."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = "client/grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = field.type_name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    proto.ClearField("service")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    get = lambda name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.v1.{name}"))
    return get("ServerReflectionRequest"), get("ServerReflectionResponse")


def reflect_v1(channel, request, metadata=AUTH):
    request_class, response_class = v1_reflection_classes()
    call = channel.stream_stream(f"/{V1_SERVICE_NAME}/ServerReflectionInfo",
                                 request_serializer=request_class.SerializeToString,
                                 response_deserializer=response_class.FromString)
    return list(call(iter([request_class(**request)]), metadata=metadata, timeout=10))


def test_reflection_v1_lists_the_services_and_describes_itself(channel):
    responses = reflect_v1(channel, {"list_services": ""})
    assert {s.name for s in responses[0].list_services_response.service} == SERVICES
    responses = reflect_v1(channel, {"file_containing_symbol": V1_SERVICE_NAME})
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in responses[0].file_descriptor_response.file_descriptor_proto]
    assert [(f.package, [s.name for s in f.service]) for f in files] == [("grpc.reflection.v1", ["ServerReflection"])]
    responses = reflect_v1(channel, {"file_containing_symbol": "inference.v1.InferenceService"})
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in responses[0].file_descriptor_response.file_descriptor_proto]
    assert "Generate" in [m.name for f in files for s in f.service for m in s.method]


def test_reflection_needs_the_key_in_both_versions(channel):
    assert code_of(lambda: reflect_v1(channel, {"list_services": ""}, metadata=())) == grpc.StatusCode.UNAUTHENTICATED
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    v1alpha = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    assert code_of(lambda: list(v1alpha)) == grpc.StatusCode.UNAUTHENTICATED
    v1alpha = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                        metadata=AUTH, timeout=10)
    assert {s.name for s in list(v1alpha)[0].list_services_response.service} == SERVICES


@pytest.mark.parametrize("how", ["plaintext", "no-client-cert", "unrelated-client-cert", "unrelated-server-ca"])
def test_mutual_tls_refuses_other_peers(engine, tls, how):
    if how == "plaintext":
        channel = grpc.insecure_channel(engine.target)
    elif how == "no-client-cert":
        channel = grpc.secure_channel(engine.target, grpc.ssl_channel_credentials(tls.ca.read_bytes()))
    elif how == "unrelated-client-cert":
        channel = grpc.secure_channel(engine.target, mtls_credentials(tls, tls.other_client_cert,
                                                                      tls.other_client_key))
    else:  # the client does not trust the engine's certificate
        channel = grpc.secure_channel(engine.target, mtls_credentials(tls, ca=tls.other_ca))
    with channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert code_of(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_tls_without_client_certificates(tls, tmp_path):
    """`--tls-cert/--tls-key` alone: any client that trusts the CA connects; plaintext does not."""
    engine = start_engine("--max-model-len", "256", "--kv-cache-memory", "16", "--tls-cert", str(tls.server_cert),
                          "--tls-key", str(tls.server_key), log_path=str(tmp_path / "engine.log"),
                          credentials=grpc.ssl_channel_credentials(tls.ca.read_bytes()))
    try:
        with grpc.secure_channel(engine.target, grpc.ssl_channel_credentials(tls.ca.read_bytes())) as channel:
            info = pb_grpc.InferenceServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.max_context_length == 256  # no key configured: none asked for
        with grpc.insecure_channel(engine.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert code_of(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5)) == \
                grpc.StatusCode.UNAVAILABLE
    finally:
        assert engine.stop() == 0


def test_a_second_engine_on_a_taken_port_exits_with_a_clear_message(engine):
    # The engine's socket has no SO_REUSEPORT: even a socket asking for it cannot share the port.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with pytest.raises(OSError) as info:
            sock.bind(("127.0.0.1", engine.port))
        assert info.value.errno == errno.EADDRINUSE
    result = subprocess.run([sys.executable, "-m", "inference_service.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(engine.port), "--metrics-port", str(free_port())],
                            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{engine.port}: the address is already in use" in result.stderr
    # The first engine still serves alone.
    assert engine.process.poll() is None


@pytest.mark.parametrize("args, message", [
    (["--tls-cert", "x.crt"], "--tls-cert and --tls-key go together"),
    (["--tls-ca", "ca.crt"], "--tls-ca (mutual TLS) needs --tls-cert and --tls-key"),
    (["--tls-cert", "/nonexistent/c.crt", "--tls-key", "/nonexistent/c.key"], "--tls-cert: no such file"),
])
def test_bad_tls_flags_are_refused(args, message):
    result = subprocess.run([sys.executable, "-m", "inference_service.cli", "serve", *args],
                            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_the_engine_listens_on_loopback_by_default():
    from inference_service.cli import build_parser, configs_from_args

    _, server = configs_from_args(build_parser().parse_args(["serve"]))
    assert server.host == "127.0.0.1"


def test_make_serve_refuses_a_taken_port():
    """`make serve` (inference_service.launch) checks both ports before starting anything."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "inference_service.launch", "--engine-port", str(free_port()),
                                 "--proxy-port", str(port)], capture_output=True, text=True, timeout=60,
                                cwd=REPO_ROOT)
    assert result.returncode == 1
    assert f"make serve: --proxy-port {port}: cannot listen on 127.0.0.1:{port}: the address is already in use" \
        in result.stderr
