"""An MCP server over stdio for the proxy's tests (built with the `mcp` SDK).

Tools: `add`, `crash` (the process exits), `hang` (never answers), `learn` (adds a tool, then says the
list changed). With `--hang-on-start` it never completes the handshake.
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("calc")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def crash() -> str:
    """Exit the server process at once."""
    os._exit(3)


@server.tool()
async def hang() -> str:
    """Never return."""
    import anyio
    await anyio.sleep(3600)
    return "unreachable"


@server.tool()
async def learn(ctx: Context) -> str:
    """Add the tool `multiply` and announce that the tool list changed."""

    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    server.add_tool(multiply)
    try:
        await ctx.notify_tools_changed()
    except Exception:  # noqa: BLE001 - older protocol: a plain notification instead
        pass
    try:
        await ctx.session.send_tool_list_changed()
    except Exception:  # noqa: BLE001
        pass
    return "learned multiply"


if __name__ == "__main__":
    if "--hang-on-start" in sys.argv:
        time.sleep(3600)
    server.run("stdio")
