"""Bearer API-key check for the OpenAI routes and the API docs; `/health` and `/metrics` stay open
(`/health` then tells only a status: its detail needs the key)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from rest_proxy.errors import ProxyError

# /docs, /redoc and /openapi.json describe every route and parameter: behind the key like the routes.
PROTECTED_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/score", "/rerank", "/docs", "/redoc",
                      "/openapi.json")


def invalid_api_key() -> ProxyError:
    return ProxyError(401, "Incorrect or missing API key: send it as `Authorization: Bearer <key>`.",
                      type="invalid_request_error", code="invalid_api_key")


class ApiKeyCheck:
    """Whether a request carries `Authorization: Bearer <api_key>` (constant-time); with no key, all do."""

    def __init__(self, api_key: str | None):
        self.api_key = api_key.encode() if api_key else None

    def is_authorized(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.check = ApiKeyCheck(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or not scope["path"].startswith(PROTECTED_PREFIXES) or self.check.is_authorized(scope)):
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse
        err = invalid_api_key()
        await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
            scope, receive, send)
