"""The compose healthcheck probe (`python -m services.common.health_probe HOST:PORT SERVICE`)
against a real target process: non-zero while it warms up (NOT_SERVING), zero once SERVING,
non-zero for an unknown service name and when nothing listens."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from grpc_health.v1 import health_pb2
from support.procs import REPO, free_port, health_status, start_target

from dflash.harness import HookFlags

pytestmark = pytest.mark.slow           # a target and a probe process per check

TARGET = "dflash.v1.Target"
WARMUP_S = 8.0


def probe(address: str, service: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.common.health_probe", address, service,
                           *extra], check=False, cwd=REPO, capture_output=True, text=True,
                          timeout=30)


@pytest.fixture(scope="module")
def warming_target(tiny_llama_dir, tmp_path_factory):
    """A target that is listening (health "" answers) but still NOT_SERVING for WARMUP_S
    (the first test sees it so; the others do not depend on its state)."""
    p = start_target(tiny_llama_dir, tmp_path_factory.mktemp("probe_logs"), wait=False,
                     hooks=HookFlags(warmup_delay_s=WARMUP_S))
    deadline = time.monotonic() + 60
    while health_status(p.address, TARGET) is None:
        assert p.proc.poll() is None, p.log()
        assert time.monotonic() < deadline, "the target never answered on grpc.health.v1"
        time.sleep(0.1)
    yield p
    p.stop()


def test_probe_follows_not_serving_then_serving(warming_target):
    p = warming_target
    assert health_status(p.address, TARGET) == health_pb2.HealthCheckResponse.NOT_SERVING
    not_yet = probe(p.address, TARGET)
    assert not_yet.returncode == 1, not_yet
    assert "NOT_SERVING" in not_yet.stderr
    # the server itself ("" = liveness) is SERVING all along
    assert probe(p.address, "").returncode == 0
    p.wait_serving(timeout=120)
    ok = probe(p.address, TARGET)
    assert ok.returncode == 0, ok
    assert "SERVING" in ok.stdout


def test_probe_unknown_service_and_nothing_listening(warming_target):
    unknown = probe(warming_target.address, "dflash.v1.NoSuchService")
    assert unknown.returncode == 1
    assert "does not know the service" in unknown.stderr
    nobody = probe(f"127.0.0.1:{free_port()}", TARGET, "--timeout", "1")
    assert nobody.returncode == 1
    assert "UNAVAILABLE" in nobody.stderr or "DEADLINE_EXCEEDED" in nobody.stderr


def test_probe_rejects_bad_arguments():
    bad = probe("no-port-here", TARGET)
    assert bad.returncode == 2
    assert "HOST:PORT" in bad.stderr
