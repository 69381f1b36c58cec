"""`mcp.json` in the common format: `{"mcpServers": {name: {"command", "args", "env"} | {"url", "headers"}}}`."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class McpConfigError(ValueError):
    """An `mcp.json` that cannot be used; the message names the file."""


class McpServerConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    command: str | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    disabled: bool = False
    timeout: float = Field(default=30.0, gt=0, description="seconds for each tool call and tool listing")
    startup_timeout: float = Field(default=30.0, gt=0, description="seconds for starting and connecting")

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of `command` (stdio) or `url` (streamable HTTP)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be http(s), got {self.url!r}")
        return self


class McpConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    mcpServers: dict[str, McpServerConfig]


def load_mcp_config(path: str | Path) -> dict[str, McpServerConfig]:
    """The enabled servers of the config at `path`; McpConfigError says what is wrong and where."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as err:
        raise McpConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    except ValueError as err:
        raise McpConfigError(f"{path}: invalid JSON: {err}") from None
    try:
        config = McpConfig.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in err.errors())
        raise McpConfigError(f"{path}: invalid MCP config: {problems}") from None
    for name in config.mcpServers:
        if not name or "__" in name:
            raise McpConfigError(f"{path}: invalid server name {name!r} (non-empty, without '__')")
    return {name: server for name, server in config.mcpServers.items() if not server.disabled}
