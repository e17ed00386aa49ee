"""services/common/ports.py: free ports for the launcher, rendezvous and tests."""
from __future__ import annotations

import socket

from services.common import ports


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == len(got)                   # never the same port twice
    assert all(ports._LOWEST <= p < low for p in got)  # outgoing connections never take them
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[-1]))


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert not ports._bindable(taken)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports._LOWEST + 1000)
        assert all(ports._LOWEST <= ports.free_port() < ports._LOWEST + 1000 for _ in range(20))
