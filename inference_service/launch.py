"""`make serve`: starts the engine and the OpenAI proxy together and stops both on Ctrl-C."""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_service.ports import ensure_port_free


def wait_until_serving(target: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Polls the engine's gRPC health service until SERVING; fails if the process exits first."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"the engine exited with code {process.returncode} before serving")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise SystemExit(f"the engine did not report SERVING on {target} within {timeout_s:.0f}s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Start the engine and the OpenAI-compatible proxy.")
    parser.add_argument("--engine-port", type=int, default=50051)
    parser.add_argument("--proxy-port", type=int, default=8000)
    parser.add_argument("--model", default=None,
                        help="GGUF file, HF folder or hub id org/name (default: embedded SmolLM2)")
    parser.add_argument("--proxy-args", default="", metavar="FLAGS",
                        help='flags of the proxy, one shell-quoted string (make serve: PROXY_ARGS="--ui ...")')
    args, engine_args = parser.parse_known_args(argv)

    for name, port in (("--engine-port", args.engine_port), ("--proxy-port", args.proxy_port)):
        try:
            ensure_port_free("127.0.0.1", port)
        except OSError as e:
            raise SystemExit(f"make serve: {name} {port}: {e}") from None
    engine_cmd = [sys.executable, "-m", "inference_service.cli", "serve", "--port", str(args.engine_port)]
    if args.model:
        engine_cmd += ["--model", args.model]
    engine = subprocess.Popen(engine_cmd + engine_args)
    processes = [engine]

    def stop(*_, exit_code: int = 0):
        for p in reversed(processes):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(processes):
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                p.kill()
        sys.exit(exit_code)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    wait_until_serving(f"127.0.0.1:{args.engine_port}", engine, timeout_s=300)
    proxy_flags = shlex.split(args.proxy_args)
    ui_flags = [f for f in proxy_flags if f in ("--ui", "--no-ui")]
    proxy = subprocess.Popen([sys.executable, "-m", "rest_proxy.cli", "serve", "--engine",
                              f"127.0.0.1:{args.engine_port}", "--port", str(args.proxy_port),
                              *proxy_flags])
    processes.append(proxy)
    print(f"\nEngine (gRPC): localhost:{args.engine_port}\n"
          f"OpenAI API:    http://localhost:{args.proxy_port}/v1  (Ctrl-C stops both)\n"
          + (f"Chat UI:       http://localhost:{args.proxy_port}/\n" if ui_flags[-1:] == ["--ui"] else ""),
          flush=True)
    while all(p.poll() is None for p in processes):
        time.sleep(0.5)
    # One of the two ended by itself (a taken port, a crash): say which, stop the other, fail.
    for name, p in (("engine", engine), ("proxy", proxy)):
        if p.poll() is not None:
            print(f"make serve: the {name} exited with code {p.returncode}", file=sys.stderr, flush=True)
    stop(exit_code=1)


if __name__ == "__main__":
    main()
