"""The seed's regression: nothing asks the target about its attention backend before the backend
exists (docs/architecture.md §7). In-process checks of the worker's stages, then real servers observed
through grpc.health.v1 (Check and a Watch stream)."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.inproc_target import chunked_logits, loaded_worker
from support.procs import health_status, start_target
from support.target_client import TargetClient, rpc_error

from dflash.harness import HookFlags
from runtime.attention.hybrid import HybridAttnBackend
from services.common.errors import NotReady
from services.target.config import TargetConfig
from services.target.hooks import TargetHooks
from services.target.servicer import SERVICE_NAME, TargetServicer, capabilities
from services.target.worker import TargetWorker

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def not_ready(fn) -> str:
    """fn must raise NotReady (an UNAVAILABLE error), not AttributeError; returns the message."""
    try:
        fn()
    except NotReady as e:
        assert not isinstance(e, AttributeError)
        return str(e)
    raise AssertionError("no NotReady raised")


def test_worker_before_backends_is_not_ready(tiny_llama_dir):
    worker = TargetWorker(TargetConfig(model_dir=str(tiny_llama_dir), kv_budget_bytes=1 << 20))
    for what in ("need_mamba_verify_commit", "attn_backend"):
        message = not_ready(lambda what=what: getattr(worker, what))
        assert "stage 'loaded'" in message and "'backends'" in message, message
    assert "stage 'loaded'" in not_ready(lambda: capabilities(worker))
    servicer = TargetServicer()
    servicer.worker = worker
    assert "stage 'loaded'" in not_ready(servicer._ready_engine)
    assert "'pools'" in not_ready(worker.init_attention_backends)   # order: pools first
    not_ready(worker.mark_ready)

    worker.alloc_memory_pools()
    assert "stage 'pools'" in not_ready(lambda: worker.need_mamba_verify_commit)
    assert "stage 'pools'" in not_ready(lambda: worker.attn_backend)

    worker.init_attention_backends()
    assert worker.need_mamba_verify_commit is False
    assert worker.attn_backend.name == "torch"
    assert "stage 'backends'" in not_ready(servicer._ready_engine)   # warm-up not done yet
    worker.mark_ready()
    assert capabilities(worker).mamba_verify_commit is False


def test_dense_model_under_the_hybrid_wrapper(tiny_llama_dir):
    """A wrapper that only delegates must not make a dense model 'need mamba verify commit'."""
    wrapped = TargetWorker(TargetConfig(model_dir=str(tiny_llama_dir), page_size=4,
                                        kv_budget_bytes=1 << 20), TargetHooks(hybrid_wrapper=True))
    not_ready(lambda: wrapped.need_mamba_verify_commit)
    wrapped.alloc_memory_pools()
    wrapped.init_attention_backends()
    assert isinstance(wrapped.attn_backend, HybridAttnBackend)
    assert wrapped.need_mamba_verify_commit is False
    wrapped.mark_ready()
    caps = capabilities(wrapped)
    assert (caps.mamba_verify_commit, caps.hybrid, caps.attention_backend) == (False, False, "torch")
    ids = list(range(3, 30))
    plain = loaded_worker(tiny_llama_dir)
    assert torch.equal(chunked_logits(wrapped, ids, [20, 7]), chunked_logits(plain, ids, [20, 7]))


class HealthWatch:
    """grpc.health.v1 Watch on a background thread: every (monotonic time, status) received."""

    def __init__(self, address: str, service: str, until: int | None = None) -> None:
        self.until = until                      # hang up after receiving this status
        self.channel = grpc.insecure_channel(address)
        stub = health_pb2_grpc.HealthStub(self.channel)
        self.call = stub.Watch(health_pb2.HealthCheckRequest(service=service), wait_for_ready=True,
                               timeout=300)
        self.events: list[tuple[float, int]] = []
        self.ended = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.events.append((time.monotonic(), msg.status))
                if msg.status == self.until:
                    self.call.cancel()          # a watcher that hangs up does not hold the drain
        except grpc.RpcError:
            pass
        finally:
            self.ended.set()

    @property
    def statuses(self) -> list[int]:
        return [s for _, s in self.events]

    def wait_for(self, status: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while status not in self.statuses and time.monotonic() < deadline and not self.ended.is_set():
            time.sleep(0.05)
        return status in self.statuses

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


@pytest.mark.slow
def test_health_is_not_serving_until_warm_up_ends(tiny_llama_dir, log_dir):
    server = start_target(tiny_llama_dir, log_dir, wait=False, hooks=HookFlags(warmup_delay_s=3))
    watch = HealthWatch(server.address, SERVICE_NAME)
    client = TargetClient(server.address)
    unavailable: list[str] = []
    liveness_while_not_serving: list[int | None] = []
    try:
        while SERVING not in watch.statuses:
            assert server.proc.poll() is None, server.log()
            assert not watch.ended.is_set(), "the Watch stream ended early"
            if watch.statuses:                      # connected, and the target not serving yet
                liveness_while_not_serving.append(health_status(server.address, ""))
                try:
                    err = rpc_error(client.capabilities)
                except AssertionError:      # answered: ready between the Watch's last status and
                    _serving_soon(watch)    # this call - SERVING must follow at once
                    break
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                unavailable.append(err.details())
            time.sleep(0.1)
        serving_at = next(t for t, s in watch.events if s == SERVING)
        assert watch.statuses == [NOT_SERVING, SERVING]
        assert unavailable and all("not ready" in m for m in unavailable), unavailable
        # the 3 s warm-up window is seen, and the message names the stage it is in
        assert any("start-up stage 'backends'; still to do: warm-up" in m for m in unavailable)
        assert SERVING in liveness_while_not_serving      # "" is liveness: up before readiness
        log = server.log()
        assert log.index("warm-up done") < log.index(f"{SERVICE_NAME} -> SERVING")
        caps = client.capabilities()
        assert caps.num_layers == 4 and caps.attention_backend == "torch"
        assert watch.statuses == [NOT_SERVING, SERVING] and time.monotonic() > serving_at
    finally:
        watch.close()
        client.close()
        server.stop()


def _serving_soon(watch, within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while SERVING not in watch.statuses:
        assert time.monotonic() < deadline, f"capabilities answered, health still {watch.statuses}"
        time.sleep(0.01)


@pytest.mark.slow
def test_hybrid_wrapper_hook_and_sigterm(tiny_llama_dir, log_dir):
    server = start_target(tiny_llama_dir, log_dir, hooks=HookFlags(hybrid_wrapper=True))
    client = TargetClient(server.address)
    try:
        caps = client.capabilities()
        assert (caps.mamba_verify_commit, caps.hybrid, caps.attention_backend) == (False, False, "torch")
        assert "backend=hybrid need_mamba_verify_commit=False" in server.log()
        watch = HealthWatch(server.address, SERVICE_NAME, until=NOT_SERVING)
        assert watch.wait_for(SERVING, 10)
        assert server.stop() == 0                      # SIGTERM, then the exit status
        watch.ended.wait(10)
        assert watch.statuses[:2] == [SERVING, NOT_SERVING], watch.statuses
        assert "stopping: health NOT_SERVING" in server.log()
        watch.close()
    finally:
        client.close()
        server.kill()
