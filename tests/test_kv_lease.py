"""KV pages come back on Release and on lease expiry (a vanished client leaks nothing),
observed through the target's Prometheus metrics over HTTP."""
from __future__ import annotations

import time

import grpc
import pytest
from support import prom
from support.procs import free_port, start_target
from support.target_client import TargetClient, expect_status

LEASE_S = 1.5
PAGE = 4


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def client(tiny_llama_dir, tmp_path_factory, metrics_port):
    server = start_target(tiny_llama_dir, tmp_path_factory.mktemp("logs"), "--page-size", str(PAGE),
                          "--kv-budget", "1MiB", "--lease-seconds", str(LEASE_S),
                          "--metrics-port", str(metrics_port))
    c = TargetClient(server.address)
    yield c
    c.close()
    assert server.stop() == 0
    assert "lease expired" in server.log()


def kv_usage(port: int) -> float:
    return prom.value(port, "dflash_kv_cache_usage_ratio", service="target")


def active(port: int) -> float:
    return prom.value(port, "dflash_sequences_active", service="target")


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_release_returns_pages(client, metrics_port):
    total = client.capabilities().kv_pages_total
    assert (kv_usage(metrics_port), active(metrics_port)) == (0, 0)
    lengths = {"r1": 10, "r2": 21, "r3": 4}                    # 3 + 6 + 1 pages of 4 tokens
    for token, (seq, n) in enumerate(lengths.items(), start=1):
        client.prefill(seq, [token] * n)        # no shared prefix: no page is shared
    assert active(metrics_port) == 3
    assert kv_usage(metrics_port) == pytest.approx(10 / total)
    v = client.verify("r2", [3, 4, 5, 6])                      # 21 -> up to 25 tokens: 7 pages
    pages = 3 + -(-v.seq_len // PAGE) + 1
    assert kv_usage(metrics_port) == pytest.approx(pages / total)
    assert client.release("r2")
    assert kv_usage(metrics_port) == pytest.approx(4 / total) and active(metrics_port) == 2
    assert client.release("r1") and client.release("r3")
    assert (kv_usage(metrics_port), active(metrics_port)) == (0, 0)


def test_lease_expiry_frees_an_idle_sequence_only(client, metrics_port):
    client.prefill("idle", [1] * 12)                           # 3 pages, never touched again
    first = client.prefill("busy", [2] * 5).next_token          # 2 pages, kept in use
    anchor, t0 = first, time.monotonic()
    while time.monotonic() - t0 < 2.5 * LEASE_S:               # past the idle one's lease
        anchor = client.verify("busy", [anchor]).committed_tokens[-1]
        time.sleep(LEASE_S / 5)
    assert wait_until(lambda: active(metrics_port) == 1, 5)
    expect_status(lambda: client.verify("idle", [1]), grpc.StatusCode.NOT_FOUND,
                  "unknown sequence 'idle'", "lease expired")
    busy = client.verify("busy", [anchor])                     # still alive
    total = client.capabilities().kv_pages_total
    assert kv_usage(metrics_port) == pytest.approx(-(-busy.seq_len // PAGE) / total)
    # the client vanishes: its sequence expires too and the pool is empty again
    assert wait_until(lambda: active(metrics_port) == 0, LEASE_S + 5)
    assert kv_usage(metrics_port) == 0
    expect_status(lambda: client.verify("busy", [1]), grpc.StatusCode.NOT_FOUND, "'busy'")
