"""Bearer API-key check for the OpenAI routes; `/health`, `/metrics` and the docs stay open."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from rest_proxy.errors import ProxyError

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.api_key is None or scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or not scope["path"].startswith(PROTECTED_PREFIXES) or self._authorized(scope)):
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse
        err = ProxyError(401, "Incorrect or missing API key: send it as `Authorization: Bearer <key>`.",
                         type="invalid_request_error", code="invalid_api_key")
        await JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
            scope, receive, send)
