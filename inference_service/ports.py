"""A port check before a long startup: fail at once, with a clear message, when the port is taken."""

from __future__ import annotations

import errno
import socket


def ensure_port_free(host: str, port: int) -> None:
    """Raises OSError naming the port when something already listens on `host:port` (0: any port is fine)."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise OSError(f"cannot listen on {host}:{port}: the address is already in use "
                                  f"(another engine or program holds the port)") from None
