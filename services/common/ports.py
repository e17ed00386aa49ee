"""A free TCP port on the loopback interface (for the launcher, tensor-parallel rendezvous,
benchmarks and tests). Another process may take it before the caller binds it: callers retry or
accept that race, as every local launcher does.

The port is drawn at random below the kernel's ephemeral range (net.ipv4.ip_local_port_range,
where outgoing connections take their local ports), never one this process handed out before:
a port the kernel picked with bind(0) comes from that range, and an outgoing connection made
before the service bound it could take it (a draft's metrics port, in CI: "Address already in
use")."""
from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000                          # below this: well-known and registered services
_given: set[int] = set()
_random = random.SystemRandom()


def free_port() -> int:
    ephemeral = _ephemeral_low()
    if ephemeral - _LOWEST >= 1000:
        for _ in range(200):
            port = _random.randrange(_LOWEST, ephemeral)
            if port not in _given and _bindable(port):
                _given.add(port)
                return port
    with socket.socket() as s:           # no room below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _given.add(port)
    return port


def _ephemeral_low() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                     # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
