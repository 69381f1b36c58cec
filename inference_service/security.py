"""What guards the engine port: the bearer-token check on gRPC metadata and the server's TLS credentials."""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from inference_service.config import ServerConfig

# NOTE: the health service answers without the key, so Kubernetes' native gRPC probes (which send no
# metadata) and Envoy's health checks work; it tells only SERVING or NOT_SERVING.
UNAUTHENTICATED_SERVICES = ("/grpc.health.v1.Health/",)


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""

    async def abort(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kinds = {"unary_unary": grpc.unary_unary_rpc_method_handler,
             "unary_stream": grpc.unary_stream_rpc_method_handler,
             "stream_unary": grpc.stream_unary_rpc_method_handler,
             "stream_stream": grpc.stream_stream_rpc_method_handler}
    for kind, make in kinds.items():
        if getattr(handler, kind) is not None:
            return make(abort, handler.request_deserializer, handler.response_serializer)
    raise TypeError(f"unknown handler kind: {handler!r}")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call but health checks with UNAUTHENTICATED unless its metadata carries
    `authorization: Bearer <api_key>` (compared in constant time)."""

    def __init__(self, api_key: str):
        self._key = api_key.encode()

    def is_authorized(self, metadata) -> bool:
        for name, value in metadata or ():
            if name == "authorization":
                raw = value.encode() if isinstance(value, str) else value
                scheme, _, token = raw.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or handler_call_details.method.startswith(UNAUTHENTICATED_SERVICES)
                or self.is_authorized(handler_call_details.invocation_metadata)):
            return handler
        return _deny(handler, "missing or wrong API key: send the metadata `authorization: Bearer <key>`")


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from `--tls-cert/--tls-key` (client certificates signed by `--tls-ca` required
    when it is given), or None for plaintext."""
    if config.tls_cert is None:
        return None
    pair = (Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())
    ca = Path(config.tls_ca).read_bytes() if config.tls_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)
