"""Test helpers: run the proxy for real on a loopback port, from a thread."""

from __future__ import annotations

import threading
import time

import uvicorn

from rest_proxy.app import create_app
from rest_proxy.config import ProxyConfig
from rest_proxy.limits import uvicorn_config
from tests.proxy.fake_engine import free_port


class ProxyServer:
    def __init__(self, config: ProxyConfig):
        self.config = config
        self.app = create_app(config)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn_config(self.app, config, host="127.0.0.1", port=self.port,
                                                    log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ProxyServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the proxy did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(15)
