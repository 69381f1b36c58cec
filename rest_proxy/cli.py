"""`rest-proxy serve --engine localhost:50051 [--engine host:port ...] --port 8000 ...`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace

from rest_proxy.mcp_config import McpConfigError, load_mcp_config
from rest_proxy.reasoning import ALIASES as REASONING_ALIASES
from rest_proxy.reasoning import FORMATS as REASONING_FORMATS
from rest_proxy.reasoning import NONE as NO_REASONING
from rest_proxy.tool_parsers import ALIASES, AUTO, PARSERS
from rest_proxy.workers import MAX_DEFAULT_WORKERS, default_num_workers, serve_workers

API_KEY_ENV = "REST_PROXY_API_KEY"
ENGINE_API_KEY_ENV = "REST_PROXY_ENGINE_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rest-proxy", description="OpenAI-compatible REST proxy for the engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI API in front of one or more engines")
    serve.add_argument("--engine", action="append", default=None, metavar="HOST:PORT",
                       help="engine gRPC target; repeat for several models (default localhost:50051)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=None, metavar="N",
                       help=f"proxy processes serving the port (the proxy is stateless; the kernel spreads "
                            f"connections over them). One event loop tops out near one core while streaming "
                            f"hundreds of responses, so the default is one per usable CPU (affinity and cgroup "
                            f"limit), at most {MAX_DEFAULT_WORKERS}: here {default_num_workers()}. The workers "
                            f"share stored responses (previous_response_id) in a SQLite file")
    serve.add_argument("--api-key", default=None,
                       help=f"require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize "
                            f"(default: ${API_KEY_ENV}; unset: no auth)")
    serve.add_argument("--mcp-config", default=None, metavar="mcp.json",
                       help='MCP servers: {"mcpServers": {name: {"command","args","env"} | {"url","headers"}}}')
    serve.add_argument("--mcp-execute", action=argparse.BooleanOptionalAction, default=True,
                       help="run the MCP tools the model calls and continue (default: on); "
                            "--no-mcp-execute returns the calls to the client")
    serve.add_argument("--max-mcp-rounds", type=int, default=5, help="most model rounds with MCP execution")
    serve.add_argument("--tool-call-parser", "--tool-parser", dest="tool_parser", default=AUTO,
                       choices=[AUTO, *sorted(PARSERS), *sorted(ALIASES)],
                       help="tool-call format for every model; auto (default): per model, from its chat "
                            "template, else its family (rest_proxy/tool_parsers FAMILY_PARSERS)")
    serve.add_argument("--reasoning-parser", default=None,
                       choices=sorted(REASONING_FORMATS) + sorted(REASONING_ALIASES) + [NO_REASONING],
                       help="split <think>...</think> into reasoning_content (default: from the model's chat "
                            "template: one that mentions <think> or enable_thinking; none: never)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="deadline in seconds for each engine call (exceeded: 504)")
    serve.add_argument("--max-body-size", type=float, default=8.0, metavar="MiB",
                       help="largest request body in MiB; larger ones get 413")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a client has to send a request's headers before its connection is closed")
    serve.add_argument("--body-timeout", type=float, default=60.0,
                       help="seconds a client has to send a request's body (exceeded: 408)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM; meanwhile new ones get 503")
    serve.add_argument("--docs", action=argparse.BooleanOptionalAction, default=True,
                       help="serve /docs, /redoc and /openapi.json (behind --api-key when it is set); "
                            "--no-docs switches them off")
    serve.add_argument("--responses-store-size", type=int, default=1000, metavar="N",
                       help="most responses kept for previous_response_id and GET /v1/responses/{id} "
                            "(least recently used evicted first; 0: none kept). Per replica: in memory, or "
                            "shared by its --workers in a SQLite file")
    serve.add_argument("--responses-store-ttl", type=float, default=3600.0, metavar="SECONDS",
                       help="seconds a stored response is kept")
    serve.add_argument("--ui", action=argparse.BooleanOptionalAction, default=False,
                       help="serve the web chat UI at / (on in `make serve`); it calls the API with the key "
                            "the user types in")
    engine = serve.add_argument_group("engine connection")
    engine.add_argument("--engine-api-key", default=None,
                        help=f"key the engines require (their --api-key; default: ${ENGINE_API_KEY_ENV})")
    engine.add_argument("--engine-tls-ca", default=None, metavar="PEM",
                        help="connect to the engines over TLS, trusting this CA (their certificates' issuer)")
    engine.add_argument("--engine-tls-cert", default=None, metavar="PEM",
                        help="client certificate for engines that require mutual TLS (their --tls-ca)")
    engine.add_argument("--engine-tls-key", default=None, metavar="PEM", help="private key of --engine-tls-cert")
    serve.add_argument("--log-level", default="info")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mcp_servers = {}
    if args.mcp_config:
        try:
            mcp_servers = load_mcp_config(args.mcp_config)
        except McpConfigError as err:
            print(f"rest-proxy: {err}", file=sys.stderr)
            return 2
    from rest_proxy.config import ProxyConfig

    try:
        config = ProxyConfig(engines=args.engine or ["localhost:50051"],
                             api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                             tool_parser=None if args.tool_parser == AUTO else args.tool_parser,
                             reasoning_parser=args.reasoning_parser,
                             mcp_servers=mcp_servers, mcp_execute=args.mcp_execute,
                             max_mcp_rounds=args.max_mcp_rounds, request_timeout=args.request_timeout,
                             max_body_bytes=int(args.max_body_size * 2**20), header_timeout=args.header_timeout,
                             body_timeout=args.body_timeout,
                             engine_api_key=args.engine_api_key or os.environ.get(ENGINE_API_KEY_ENV) or None,
                             engine_tls_ca=args.engine_tls_ca, engine_tls_cert=args.engine_tls_cert,
                             engine_tls_key=args.engine_tls_key, docs=args.docs,
                             responses_store_size=args.responses_store_size,
                             responses_store_ttl=args.responses_store_ttl, ui=args.ui,
                             workers=default_num_workers() if args.workers is None else args.workers)
    except ValueError as err:
        print(f"rest-proxy: {err}", file=sys.stderr)
        return 2
    from inference_service.ports import ensure_port_free

    try:
        ensure_port_free(args.host, args.port)
    except OSError as err:
        print(f"rest-proxy: {err}", file=sys.stderr)
        return 2
    print(f"rest-proxy: serving the OpenAI API on http://{args.host}:{args.port}/v1 "
          f"(engines: {', '.join(config.engines)}; {config.workers} worker{'s' if config.workers > 1 else ''})",
          flush=True)
    if config.ui:
        print(f"rest-proxy: chat UI on http://{args.host}:{args.port}/", flush=True)
    if config.workers == 1:
        return _serve(config, args, sockets=None)
    return serve_workers(config.workers, args.host, args.port, lambda sock, state_dir: _serve(
        replace(config, responses_store_path=os.path.join(state_dir, "responses.sqlite")), args, sockets=[sock]))


def _serve(config, args: argparse.Namespace, sockets) -> int:
    """One proxy process: the app under uvicorn until SIGTERM has drained it (`sockets`: listen on
    these, as a worker; None: bind --host/--port)."""
    from inference_service.engine.gc_heap import freeze_startup_heap
    from rest_proxy.app import create_app
    from rest_proxy.drain import DrainingServer
    from rest_proxy.limits import uvicorn_config

    app = create_app(config)
    freeze_startup_heap()  # one app a process: full collections skip what lives until exit
    # NOTE: the drain already gave streams --shutdown-timeout; past it uvicorn cuts what is left at once
    # (its own graceful wait would let them run on for that long again).
    server = DrainingServer(uvicorn_config(app, config, host=args.host, port=args.port,
                                           log_level=args.log_level.lower(), timeout_graceful_shutdown=0.05),
                            app.state.drain, args.shutdown_timeout)
    server.run(sockets=sockets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
