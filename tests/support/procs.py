"""Start the real services as child processes and wait for them through grpc.health.v1."""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash.harness import NO_HOOK_FLAGS, HookFlags
from services.common.ports import free_port

REPO = Path(__file__).resolve().parents[2]



def health_status(address: str, service: str, timeout: float = 2.0) -> int | None:
    """The grpc.health.v1 Check status, or None when nothing answers."""
    try:
        with grpc.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
    except grpc.RpcError:
        return None


# every service a test started: killed when pytest exits if still running (a fixture that failed
# half way must not leave one holding its ports and cores for the rest of the run)
_STARTED: list[ServiceProcess] = []


@atexit.register
def _kill_leftovers() -> None:
    for p in _STARTED:
        p.kill()


class ServiceProcess:
    """`python -m <module> <args>` with its log in a file; stopped with SIGTERM (then KILL)."""

    def __init__(self, module: str, args: list[str], service: str, port: int,
                 log_dir: Path, env: dict[str, str] | None = None,
                 prefix: list[str] | None = None) -> None:
        """prefix: a command the process runs under (e.g. a private /dev/shm)."""
        self.module, self.args, self.service, self.port = module, args, service, port
        self.prefix = prefix or []
        self.address = f"127.0.0.1:{port}"
        self.log_path = Path(log_dir) / f"{module.replace('.', '_')}_{port}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServiceProcess:
        self.log_file = open(self.log_path, "w")  # noqa: SIM115 - open while the process runs
        self.proc = subprocess.Popen([*self.prefix, sys.executable, "-m", self.module, *self.args],
                                     cwd=REPO, env=self.env, stdout=self.log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        _STARTED.append(self)
        return self

    def wait_serving(self, timeout: float = 180.0) -> ServiceProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited with {self.proc.returncode}:\n{self.log()}")
            if health_status(self.address, self.service) == health_pb2.HealthCheckResponse.SERVING:
                return self
            time.sleep(0.2)
        raise TimeoutError(f"{self.module} not SERVING after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait(5)
        finally:
            self.log_file.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def service_command(role: str, args: list[str], hooks: HookFlags) -> tuple[str, list[str]]:
    """(module, args) of `python -m`: the service itself, or dflash.harness when hooks are set."""
    module, *rest = hooks.module(role)
    return module, [*rest, *args]


def start_target(model_dir: str | Path, log_dir: Path, *extra: str, wait: bool = True,
                 env: dict[str, str] | None = None, hooks: HookFlags = NO_HOOK_FLAGS,
                 prefix: list[str] | None = None) -> ServiceProcess:
    """prefix: a command the target runs under (e.g. taskset)."""
    port = free_port()
    module, args = service_command("target", ["--model", str(model_dir), "--port", str(port),
                                              "--host", "127.0.0.1", *extra], hooks)
    p = ServiceProcess(module, args, "dflash.v1.Target", port, log_dir, env, prefix).start()
    return p.wait_serving() if wait else p


def stop_launcher(proc: subprocess.Popen, timeout: float = 60) -> None:
    """A `dflash up` / `dflash demo` process started in its own session: SIGTERM (it stops its
    children), then SIGKILL of its group if it does not exit in time."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
