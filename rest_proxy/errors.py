"""Errors in OpenAI's shape, and the mapping from gRPC status codes to HTTP statuses."""

from __future__ import annotations

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# gRPC status code number -> (HTTP status, OpenAI error type).
_GRPC_TO_HTTP: dict[int, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT.value[0]: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE.value[0]: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION.value[0]: (400, "invalid_request_error"),
    grpc.StatusCode.UNIMPLEMENTED.value[0]: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND.value[0]: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS.value[0]: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED.value[0]: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED.value[0]: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE.value[0]: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED.value[0]: (504, "timeout"),
    grpc.StatusCode.CANCELLED.value[0]: (499, "cancelled"),
}

_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                 503: "service_unavailable", 504: "timeout"}


class ProxyError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _STATUS_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param)


def grpc_code_name(code: int) -> str:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return str(code)


def from_engine_error(code: int, message: str, field: str = "") -> ProxyError:
    """Map an in-band `inference.v1.Error` (or a call's status) to the client's error."""
    status, error_type = _GRPC_TO_HTTP.get(code, (500, "server_error"))
    name = grpc_code_name(code).lower()
    if code == grpc.StatusCode.UNIMPLEMENTED.value[0]:
        name = "unsupported"
    return ProxyError(status, message or name, type=error_type, param=field or None, code=name)


def from_rpc_error(err: grpc.aio.AioRpcError | grpc.RpcError, target: str = "") -> ProxyError:
    """Map a failed gRPC call; an unreachable engine (UNAVAILABLE) becomes 503."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.UNAVAILABLE:
        where = f" at {target}" if target else ""
        return ProxyError(503, f"engine{where} unavailable: {details}", type="service_unavailable",
                          code="engine_unavailable")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        # The engine refused the proxy's own key, not the client's: a deployment error, not a 401.
        where = f" at {target}" if target else ""
        return ProxyError(502, f"engine{where} refused the proxy's credentials (check --engine-api-key)",
                          type="server_error", code="engine_auth_failed")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (details or ""):
        # gRPC's message-size limit, not a full queue: retrying (what a 429 invites) cannot help.
        return ProxyError(413, f"the request is larger than the engine accepts: {details}",
                          type="invalid_request_error", code="request_too_large")
    return from_engine_error(code.value[0], details or code.name)


def _validation_param(loc: tuple) -> str | None:
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app answers has OpenAI's shape; request validation is a 400."""

    @app.exception_handler(ProxyError)
    async def _proxy_error(_: Request, exc: ProxyError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = _validation_param(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid request")
        message = f"{param}: {msg}" if param else str(msg)
        return JSONResponse(invalid_request(message, param).body(), status_code=400)

    @app.exception_handler(UnicodeError)
    async def _unicode_error(_: Request, exc: UnicodeError) -> JSONResponse:
        return JSONResponse(invalid_request(f"request text is not valid Unicode: {exc}").body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ProxyError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))
