"""The web chat UI (`--ui`): a static page at `/` (files in `rest_proxy/static/`, shipped in the package, no
CDN) that talks to the OpenAI routes from the browser, plus two routes of its own so it can show MCP tool
calls and their results: it offers the proxy's MCP tools to the model itself and runs the calls it gets
back through the proxy's MCP connections, round by round, where a plain client would see only the answer.

The page is public (it holds nothing); everything it calls is behind `--api-key`, which the user types in.
"""

from __future__ import annotations

import json
from importlib.resources import files

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from rest_proxy.auth import ApiKeyCheck, invalid_api_key
from rest_proxy.config import ProxyConfig
from rest_proxy.errors import ProxyError, invalid_request

STATIC_DIR = str(files("rest_proxy") / "static")
# Most characters of a tool result the page shows and sends back to the model.
MAX_TOOL_OUTPUT_CHARS = 64_000


class ToolCallRequest(BaseModel):
    name: str = Field(min_length=1)
    arguments: str = "{}"  # JSON text, as the model wrote it


def build_ui_router(api_key: str | None) -> APIRouter:
    """`GET /` (the page) and its MCP routes under `/ui/mcp/` (behind the API key)."""
    router = APIRouter(include_in_schema=False)
    check = ApiKeyCheck(api_key)

    def mcp_of(request: Request):
        if not check.is_authorized(request.scope):
            raise invalid_api_key()
        return request.app.state.mcp

    @router.get("/")
    async def index():
        return FileResponse(f"{STATIC_DIR}/index.html", headers={"Cache-Control": "no-cache"})

    @router.get("/ui/mcp/tools")
    async def mcp_tools(request: Request):
        """The proxy's MCP tools in the chat `tools` format (an empty list without --mcp-config)."""
        mcp = mcp_of(request)
        return {"tools": mcp.tools() if mcp is not None else []}

    @router.post("/ui/mcp/call")
    async def mcp_call(call: ToolCallRequest, request: Request):
        """Runs one MCP tool call the model made; its text output, as the proxy would give it to the model."""
        mcp = mcp_of(request)
        if mcp is None:
            raise invalid_request("the proxy has no MCP servers (--mcp-config)", "name")
        if call.name not in {t["function"]["name"] for t in mcp.tools()}:
            raise ProxyError(404, f"no MCP tool named {call.name!r}", type="invalid_request_error", param="name")
        try:
            json.loads(call.arguments or "{}")
        except json.JSONDecodeError as err:
            raise invalid_request(f"arguments are not JSON: {err}", "arguments") from None
        result = await mcp.call_tool(call.name, call.arguments or "{}")
        return JSONResponse({"output": result.text[:MAX_TOOL_OUTPUT_CHARS]})

    return router


def mount_ui(app: FastAPI, config: ProxyConfig) -> None:
    """Serves the chat UI on `app` when `config.ui`: the page at `/`, its files under `/ui/static/`."""
    if not config.ui:
        return
    app.include_router(build_ui_router(config.api_key))
    app.mount("/ui/static", StaticFiles(directory=STATIC_DIR), name="ui-static")
