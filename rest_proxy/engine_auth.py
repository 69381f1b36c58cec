"""How the proxy presents itself to the engines: TLS (mutual with a client certificate) and the engine's key."""

from __future__ import annotations

from pathlib import Path

import grpc


class _BearerToken:
    """Adds `authorization: Bearer <key>` to a call's metadata.

    NOTE: call credentials (`grpc.access_token_call_credentials`) would do this, but gRPC sends them only
    over TLS; the key must also work on a plaintext channel inside a trusted network.
    """

    def __init__(self, api_key: str):
        self._header = ("authorization", f"Bearer {api_key}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._header)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryUnaryBearerToken(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamStreamBearerToken(_BearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def bearer_token_interceptors(api_key: str) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that send the key on every call the proxy makes (unary and bidi streaming).

    NOTE: one object each: a channel files an interceptor under the first kind it is an instance of.
    """
    return [_UnaryUnaryBearerToken(api_key), _StreamStreamBearerToken(api_key)]


def channel_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting `ca` (None: the system's roots) with an optional client certificate;
    None (plaintext) when none of the three is given."""
    if ca is None and cert is None:
        return None
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key),
                                        certificate_chain=read(cert))
