"""Reliability and security test support: a tiny hybrid stack (target, draft, gateway as real
processes), faults (kill -9, SIGTERM, restart on the same port), concurrent gRPC streams that
record what they received, development certificates, /proc memory and /metrics readings."""
from __future__ import annotations

import os
import signal
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash.v1 import common_pb2, gateway_pb2
from support.draft_service import start_draft
from support.gateway_stack import GatewayProcess, start_gateway, wait_until
from support.procs import REPO, ServiceProcess, start_target
from support.prom import scrape

SERVING = health_pb2.HealthCheckResponse.SERVING
# A tiny Bamba (Mamba2 + attention) with SmolLM2's tokenizer that scores 16 ids: text prompts
# work, greedy output soon repeats (prompt lookup gets accepted), and it has a KV cache and a
# recurrent-state pool whose usage the tests read back.
ACTIVE_VOCAB = (1000, 1016)
BLOCK = 8
TARGET_FLAGS = ("--max-block-size", str(BLOCK), "--kv-budget", "64MiB", "--state-slots", "48")
_models: dict[str, Path] = {}


def tiny_hybrid(tmp_path_factory, smollm2_dir: Path) -> Path:
    """One per test session (made on first use)."""
    if "hybrid" not in _models:
        from dflash.prepare.tiny_hybrid import make_tiny_hybrid
        _models["hybrid"] = make_tiny_hybrid(tmp_path_factory.mktemp("tiny_hybrid_smol"),
                                             vocab_from=smollm2_dir, active_vocab=ACTIVE_VOCAB)
    return _models["hybrid"]


PROMPTS = ["The cat sat on the mat. The dog sat on the log.",
           "Once upon a time there was a robot who painted.",
           "def add(a, b):\n    return a + b\n",
           "Rome was not built in a day, they say, and neither was Paris.",
           "The quick brown fox jumps over the lazy dog again and again.",
           "Photosynthesis turns light into chemical energy in plants.",
           "One, two, three, four, five, six, seven, eight, nine, ten.",
           "She sells sea shells by the sea shore every summer morning."]


# -- processes --------------------------------------------------------------------------------
def report(name: str, **figures) -> None:
    """One greppable line of figures per reliability/security test (pytest -s shows them)."""
    print(f"\nRELIABILITY {name} " + " ".join(f"{k}={v}" for k, v in figures.items()))


def restart(p: ServiceProcess, log_dir: Path) -> ServiceProcess:
    """A new process with the same module, arguments and port (the old one must be gone)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    return ServiceProcess(p.module, p.args, p.service, p.port, log_dir, _extra_env(p)).start()


def _extra_env(p: ServiceProcess) -> dict[str, str]:
    return {k: v for k, v in p.env.items() if k.startswith("DFLASH_")}


def kill9(p: ServiceProcess) -> None:
    os.killpg(p.proc.pid, signal.SIGKILL)
    p.proc.wait(10)


def sigterm(p: ServiceProcess) -> None:
    p.proc.send_signal(signal.SIGTERM)


@dataclass
class Stack:
    target: ServiceProcess
    draft: ServiceProcess | None
    gateway: GatewayProcess
    target_metrics: int
    draft_metrics: int

    def stop(self) -> dict[str, int | None]:
        codes = {"gateway": self.gateway.stop()}
        if self.draft is not None:
            codes["draft"] = self.draft.stop()
        codes["target"] = self.target.stop()
        return codes


def start_stack(model_dir: Path, log_dir: Path, *gateway_flags: str, drafter: str = "prompt-lookup",
                target_flags: tuple[str, ...] = TARGET_FLAGS, draft_flags: tuple[str, ...] = (),
                draft_model: Path | None = None) -> Stack:
    """target (+ draft unless drafter is "none") + gateway, all SERVING; /metrics on free ports."""
    from support.procs import free_port
    tm, dm = free_port(), free_port()
    target = start_target(model_dir, log_dir, *target_flags, "--metrics-port", str(tm))
    draft = None
    try:
        if drafter != "none":
            extra = ("--drafter", drafter, "--metrics-port", str(dm), *draft_flags)
            if drafter == "prompt-lookup":
                extra = (*extra, "--block-size", str(BLOCK))
            draft = start_draft(model_dir, log_dir, *extra, model_dir=draft_model)
        # fixed sizes: these scenarios need the draft drafting at every load (auto may not)
        gw = start_gateway(target.address, model_dir, log_dir, "--speculation", "fixed",
                           *gateway_flags, draft=draft.address if draft else "")
    except BaseException:               # a service that did not start: none left running
        for p in (draft, target):
            if p is not None:
                p.stop()
        raise
    return Stack(target, draft, gw, tm, dm)


def rss_mib(pid: int) -> float:
    """Resident memory of a process from /proc (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def gauge(port: int, name: str) -> float:
    """Sum of a metric's samples on a service's /metrics (0 when absent)."""
    return sum(v for _, v in scrape(port).get(name, []))


def rpc_count(port: int, method: str, code: str) -> float:
    return sum(v for lb, v in scrape(port).get("dflash_rpc_requests_total", [])
               if lb.get("method") == method and lb.get("code") == code)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """gateway_stack.wait_until with this module's argument order."""
    return wait_until(predicate, timeout, interval, what)


# -- concurrent streams -------------------------------------------------------------------------
def request(prompt: str | list[int], max_tokens: int, **fields) -> gateway_pb2.GenerateRequest:
    """Greedy, EOS ignored (always max_tokens tokens); a text prompt (the tokenizer's) or
    token ids."""
    given = ({"text": prompt} if isinstance(prompt, str)
             else {"token_ids": gateway_pb2.TokenIds(ids=prompt)})
    return gateway_pb2.GenerateRequest(
        **given, max_tokens=max_tokens, ignore_eos=True,
        sampling=fields.pop("sampling", common_pb2.SamplingParams(temperature=0.0)), **fields)


@dataclass
class StreamResult:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    usage: gateway_pb2.Usage | None = None
    error: grpc.RpcError | None = None
    arrivals: list[float] = field(default_factory=list)     # monotonic time of each message

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(1 for t in self.arrivals if t0 <= t < t1)


class Streams:
    """Runs requests as concurrent gRPC server streams on threads; `results[i]` fills as
    messages arrive."""

    def __init__(self, stub, requests: list[gateway_pb2.GenerateRequest],
                 metadata: tuple = (), timeout: float = 300) -> None:
        self.results = [StreamResult() for _ in requests]
        self._threads = [threading.Thread(target=self._run, args=(stub, r, i, metadata, timeout),
                                          daemon=True) for i, r in enumerate(requests)]

    def start(self) -> Streams:
        for t in self._threads:
            t.start()
        return self

    def _run(self, stub, req, i: int, metadata: tuple, timeout: float) -> None:
        res = self.results[i]
        try:
            for msg in stub.Generate(req, timeout=timeout, metadata=metadata):
                res.tokens.extend(msg.token_ids)
                res.arrivals.append(time.monotonic())
                if msg.finish_reason:
                    res.finish_reason, res.usage = msg.finish_reason, msg.usage
        except grpc.RpcError as e:
            res.error = e

    def wait_tokens(self, n: int, timeout: float = 60) -> None:
        """Until every stream has received at least n tokens (and none has failed)."""
        def ready():
            failed = [r.error for r in self.results if r.error is not None]
            if failed:
                raise AssertionError(f"a stream failed: {failed[0]}")
            return all(len(r.tokens) >= n for r in self.results)
        wait_for(ready, timeout, f"{n} tokens on every stream", interval=0.02)

    def join(self, timeout: float = 300) -> list[StreamResult]:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "streams still running"
        return self.results


# -- certificates -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Certs:
    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def ssl_context(self) -> ssl.SSLContext:
        """An HTTPS client context trusting the dev CA."""
        return ssl.create_default_context(cafile=str(self.dir / "ca.crt"))

    def client_credentials(self, ca: str = "ca.crt", cert: bool = True) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            self.read(ca), self.read("client.key") if cert else None,
            self.read("client.crt") if cert else None)


def make_certs(out: Path) -> Certs:
    subprocess.run(["bash", str(REPO / "scripts" / "dev_ca.sh"), str(out)], check=True,
                   capture_output=True, text=True)
    return Certs(Path(out))


def tls_health_status(address: str, service: str, creds: grpc.ChannelCredentials | None,
                      timeout: float = 2.0) -> int | None:
    """grpc.health.v1 Check over TLS (creds) or plaintext (None); None when refused."""
    try:
        ch = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        with ch:
            stub = health_pb2_grpc.HealthStub(ch)
            return stub.Check(health_pb2.HealthCheckRequest(service=service),
                              timeout=timeout).status
    except grpc.RpcError:
        return None


def wait_serving_tls(p: ServiceProcess, creds: grpc.ChannelCredentials,
                     timeout: float = 120) -> ServiceProcess:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"{p.module} exited with {p.proc.returncode}:\n{p.log()}")
        if tls_health_status(p.address, p.service, creds) == SERVING:
            return p
        time.sleep(0.2)
    raise TimeoutError(f"{p.module} not SERVING over TLS after {timeout} s:\n{p.log()}")
