"""MCP servers from `mcp.json`: connected with the `mcp` SDK, their tools offered to the model as
`<server>__<tool>`, and kept alive: a server that fails, hangs or crashes has its tools withdrawn
and is reconnected (respawned, for stdio) with exponential backoff, never taking the proxy down."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
from dataclasses import dataclass

import anyio
import httpx2
import mcp.types as mt
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from rest_proxy.mcp_config import McpServerConfig
from rest_proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)
SEPARATOR = "__"
_INVALID = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What one MCP tool call gave: `text` is what the model reads (on failure, the error described);
    `server` is the server's name in mcp.json ("" for a tool that does not exist)."""

    server: str
    tool: str
    text: str
    is_error: bool = False


def exposed_name(server: str, tool: str) -> str:
    """OpenAI function names allow [A-Za-z0-9_-]{1,64}; anything else becomes `_`."""
    return _INVALID.sub("_", f"{server}{SEPARATOR}{tool}")[:64]


class McpServerConnection:
    """One configured server, supervised: connect, list tools, follow changes, reconnect on failure."""

    def __init__(self, name: str, config: McpServerConfig, *, ping_interval: float = 5.0,
                 max_backoff: float = 30.0):
        self.name = name
        self.config = config
        self.tools: dict[str, mt.Tool] = {}
        self.client: Client | None = None
        self.ping_interval = ping_interval
        self.max_backoff = max_backoff
        self.connects = 0
        self.first_attempt = asyncio.Event()
        self._changed = asyncio.Event()
        self._broken = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._scope: anyio.CancelScope | None = None

    def _target(self):
        if self.config.command is not None:
            return StdioServerParameters(command=self.config.command, args=self.config.args,
                                         env=self.config.env or None, cwd=self.config.cwd)
        http = httpx2.AsyncClient(headers=self.config.headers, timeout=self.config.timeout)
        return streamable_http_client(self.config.url, http_client=http)

    async def _on_message(self, message) -> None:
        if isinstance(message, Exception):
            log.warning("MCP server %s: transport error: %s", self.name, message)
            self._broken.set()
        elif isinstance(message, mt.ToolListChangedNotification) or \
                isinstance(getattr(message, "root", None), mt.ToolListChangedNotification):
            self._changed.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"mcp-{self.name}")

    async def stop(self) -> None:
        # NOTE: cancel through anyio, not Task.cancel(): the SDK's shielded cleanup (which stops a
        # stdio server's process) only survives cancellation delivered by a cancel scope.
        if self._scope is not None:
            self._scope.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._task, timeout=10)

    async def _supervise(self) -> None:
        with anyio.CancelScope() as self._scope:
            await self._supervise_loop()

    async def _supervise_loop(self) -> None:
        backoff = 0.5
        while True:
            try:
                await self._run_once()
                backoff = 0.5
            except asyncio.CancelledError:
                raise
            except BaseException as err:  # noqa: BLE001 - any failure of one server is contained here
                log.warning("MCP server %s failed: %s", self.name, _describe(err))
            finally:
                self.client = None
                if self.tools:
                    log.warning("MCP server %s: withdrawing its %d tools", self.name, len(self.tools))
                self.tools = {}
                self.first_attempt.set()
            log.info("MCP server %s: reconnecting in %.1f s", self.name, backoff)
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff)

    async def _run_once(self) -> None:
        self._broken.clear()
        self._changed.clear()
        client = Client(self._target(), message_handler=self._on_message,
                        read_timeout_seconds=self.config.timeout, cache=None)
        # NOTE: one scope around the client's whole life (the SDK's task groups must nest inside it);
        # its deadline covers startup only and is lifted once connected.
        with anyio.CancelScope(deadline=anyio.current_time() + self.config.startup_timeout) as scope:
            async with client:
                await self._refresh(client)
                scope.deadline = math.inf
                self.client = client
                self.connects += 1
                self.first_attempt.set()
                log.info("MCP server %s: connected, %d tools", self.name, len(self.tools))
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._listen, client)
                    await self._watch(client)
                    tg.cancel_scope.cancel()
        if scope.cancelled_caught:
            raise TimeoutError(f"not connected within {self.config.startup_timeout:g} s")

    async def _listen(self, client: Client) -> None:
        """On 2026-07-28+ connections change events come on a `subscriptions/listen` stream."""
        try:
            async with client.listen(tools_list_changed=True) as sub:
                async for _event in sub:
                    self._changed.set()
        except Exception as err:  # noqa: BLE001 - older protocol: notifications reach _on_message instead
            log.debug("MCP server %s: no listen stream (%s)", self.name, _describe(err))

    async def _watch(self, client: Client) -> None:
        while not self._broken.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self.ping_interval)
            if self._changed.is_set():
                self._changed.clear()
                with anyio.fail_after(self.config.timeout):
                    await self._refresh(client)
                log.info("MCP server %s: tools changed, now %d", self.name, len(self.tools))
                continue
            # NOTE: no `ping` at 2026-07-28; listing the tools proves liveness and catches missed changes.
            with anyio.fail_after(self.config.timeout):
                await self._refresh(client)
        raise ConnectionError("transport failed")

    async def _refresh(self, client: Client) -> None:
        tools: dict[str, mt.Tool] = {}
        cursor = None
        while True:
            page = await client.list_tools(cursor=cursor) if cursor else await client.list_tools()
            tools.update({t.name: t for t in page.tools})
            cursor = page.next_cursor
            if not cursor:
                break
        self.tools = tools


def _describe(err: BaseException) -> str:
    if isinstance(err, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in err.exceptions)
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class McpManager:
    """All configured servers; the tools they offer now, and running the model's calls to them."""

    def __init__(self, servers: dict[str, McpServerConfig], *, metrics: ProxyMetrics | None = None,
                 ping_interval: float = 5.0, max_backoff: float = 30.0):
        self.metrics = metrics
        self.connections = {name: McpServerConnection(name, cfg, ping_interval=ping_interval,
                                                      max_backoff=max_backoff)
                            for name, cfg in servers.items()}

    async def start(self, wait: float = 10.0) -> None:
        """Start every server and wait (up to `wait` s) for each one's first attempt."""
        for conn in self.connections.values():
            conn.start()
        if self.connections:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(c.first_attempt.wait()
                                                        for c in self.connections.values())), wait)

    async def stop(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.connections.values()))

    def _index(self) -> dict[str, tuple[McpServerConnection, mt.Tool]]:
        return {exposed_name(c.name, t.name): (c, t) for c in self.connections.values() for t in c.tools.values()}

    def tools(self) -> list[dict]:
        """OpenAI tool definitions of every tool offered now."""
        out = []
        for name, (conn, tool) in sorted(self._index().items()):
            if self.metrics is not None:
                self.metrics.mcp_tools.labels(server=conn.name).set(len(conn.tools))
            description = tool.description or tool.title or tool.name
            out.append({"type": "function", "function": {
                "name": name, "description": f"[{conn.name}] {description}",
                "parameters": tool.input_schema or {"type": "object", "properties": {}}}})
        return out

    def _count(self, server: str, tool: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.mcp_tool_calls.labels(server=server, tool=tool, outcome=outcome).inc()

    async def call_tool(self, name: str, arguments_json: str) -> ToolResult:
        """Run a call the model made; any failure is described in the result's text, for the model."""
        entry = self._index().get(name)
        if entry is None:
            self._count("", name, "unknown_tool")
            return ToolResult("", name, f"Error: there is no tool named {name!r}.", is_error=True)
        conn, tool = entry

        def failed(outcome: str, text: str) -> ToolResult:
            self._count(conn.name, tool.name, outcome)
            return ToolResult(conn.name, tool.name, text, is_error=True)

        try:
            arguments = json.loads(arguments_json or "{}")
        except ValueError as err:
            return failed("bad_arguments", f"Error: the arguments are not valid JSON ({err}).")
        if not isinstance(arguments, dict):
            return failed("bad_arguments", "Error: the arguments must be a JSON object.")
        client = conn.client
        if client is None:
            return failed("unavailable", f"Error: the tool server {conn.name!r} is unavailable.")
        try:
            with anyio.fail_after(conn.config.timeout):
                result = await client.call_tool(tool.name, arguments)
        except TimeoutError:
            conn._broken.set()
            return failed("timeout", f"Error: {name} timed out after {conn.config.timeout:g} s.")
        except Exception as err:  # noqa: BLE001 - reported to the model, the proxy keeps going
            return failed("failed", f"Error: {name} failed: {_describe(err)}")
        text = "\n".join(_content_text(block) for block in result.content)
        if result.is_error:
            return failed("error", f"Error: {text}")
        self._count(conn.name, tool.name, "ok")
        if not text and getattr(result, "structured_content", None) is not None:
            text = json.dumps(result.structured_content)
        return ToolResult(conn.name, tool.name, text)


def _content_text(block) -> str:
    if getattr(block, "type", None) == "text":
        return block.text
    return json.dumps(block.model_dump(mode="json", exclude_none=True))
