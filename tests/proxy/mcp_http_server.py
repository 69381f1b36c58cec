"""An MCP server over streamable HTTP for the proxy's tests: `python mcp_http_server.py PORT [TOKEN]`.

With TOKEN, requests without `Authorization: Bearer TOKEN` are refused (checks the config's headers).
"""

from __future__ import annotations

import sys

import uvicorn
from starlette.responses import JSONResponse

from mcp.server.mcpserver import MCPServer

server = MCPServer("notes")
NOTES: list[str] = []


@server.tool()
def remember(text: str) -> str:
    """Store a note."""
    NOTES.append(text)
    return f"stored note #{len(NOTES)}"


@server.tool()
def recall() -> list[str]:
    """All notes stored so far."""
    return NOTES


def main() -> None:
    port = int(sys.argv[1])
    token = sys.argv[2] if len(sys.argv) > 2 else None
    app = server.streamable_http_app(host="127.0.0.1")

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and token is not None:
            headers = dict(scope.get("headers", []))
            if headers.get(b"authorization") != f"Bearer {token}".encode():
                await JSONResponse({"error": "unauthorized"}, status_code=401)(scope, receive, send)
                return
        await app(scope, receive, send)

    uvicorn.run(guarded, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
