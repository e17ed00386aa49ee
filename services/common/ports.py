"""A free TCP port on the loopback interface (for the launcher, tensor-parallel rendezvous,
benchmarks and tests). Another process may take it before the caller binds it: callers retry or
accept that race, as every local launcher does."""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
