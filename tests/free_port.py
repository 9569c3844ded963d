"""A free TCP port on the loopback interface, for the 2-process gloo tests' rendezvous."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port no socket is bound to right now (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
