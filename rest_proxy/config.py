"""The proxy's configuration, checked once when it is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rest_proxy.mcp_config import McpServerConfig
from rest_proxy.reasoning import get_format
from rest_proxy.tool_parsers import get_parser


@dataclass(slots=True)
class ProxyConfig:
    engines: list[str]
    api_key: str | None = None
    tool_parser: str | None = None  # None: chosen from each model's family and chat template
    reasoning_parser: str | None = None  # None: chosen from each model's chat template; "none": never parse
    mcp_servers: dict[str, McpServerConfig] = field(default_factory=dict)
    mcp_execute: bool = True
    max_mcp_rounds: int = 5
    mcp_ping_interval: float = 5.0
    mcp_max_backoff: float = 30.0
    mcp_startup_wait: float = 10.0
    request_timeout: float | None = None  # seconds per engine call; None: no deadline
    engine_refresh_interval: float = 1.0
    max_body_bytes: int = 8 * 2**20  # larger request bodies get 413
    header_timeout: float = 10.0  # seconds a client has to send a request's headers
    body_timeout: float = 60.0  # seconds a client has to send a request's body (408 after)
    # What the proxy presents to the engines: their API key, TLS (CA of the engines' certificates) and,
    # for mutual TLS, a client certificate and key (PEM paths).
    engine_api_key: str | None = None
    engine_tls_ca: str | None = None
    engine_tls_cert: str | None = None
    engine_tls_key: str | None = None
    docs: bool = True  # /docs, /redoc, /openapi.json (behind api_key when it is set)
    # Stored responses for previous_response_id: at most this many (LRU), each this many seconds at most.
    responses_store_size: int = 1000
    responses_store_ttl: float = 3600.0
    # The SQLite file the workers of one proxy share them in (set by the CLI under --workers > 1); None: memory.
    responses_store_path: str | None = None
    ui: bool = False  # the web chat UI at `/` (rest_proxy/ui.py)
    # Processes serving the port (rest_proxy/workers.py); > 1: metrics in prometheus-client's multiprocess mode.
    workers: int = 1

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("at least one --engine target is required")
        if self.tool_parser is not None:
            get_parser(self.tool_parser)  # an unknown name refuses to start
        if self.reasoning_parser is not None:
            get_format(self.reasoning_parser)
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.max_mcp_rounds < 1:
            raise ValueError("max_mcp_rounds must be >= 1")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError("request_timeout must be > 0")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if not (self.header_timeout > 0 and self.body_timeout > 0):
            raise ValueError("header_timeout and body_timeout must be > 0")
        if self.responses_store_size < 0:
            raise ValueError("--responses-store-size must be >= 0")
        if not self.responses_store_ttl > 0:
            raise ValueError("--responses-store-ttl must be > 0")
        if (self.engine_tls_cert is None) != (self.engine_tls_key is None):
            raise ValueError("--engine-tls-cert and --engine-tls-key go together")
        for flag, path in (("--engine-tls-ca", self.engine_tls_ca), ("--engine-tls-cert", self.engine_tls_cert),
                           ("--engine-tls-key", self.engine_tls_key)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag}: no such file {path!r}")
