"""The target's tensor-parallel ranks (--tensor-parallel-size N > 1; runtime/tensor_parallel.py).

Rank 0 is the service: it owns the gRPC endpoint, the engine (scheduling, KV page tables,
prefix cache, sampling) and the logits. Ranks 1..N-1 are child processes that hold the rest of
each layer's heads and MLP columns and their share of every KV page, and follow rank 0 in
lockstep: rank 0 broadcasts every operation that touches model state - a forward (with its page
tables: where each new token's KV goes), the KV moves of a tree commit, CUDA graph capture - and
runs it itself; the layers' all-reduces pair the ranks inside each forward. Followers keep no
sequence state of their own, so nothing but those operations needs mirroring.

Start-up keeps the contract across ranks (docs/architecture.md §7): every rank joins the group,
loads its share, allocates its pools and builds its attention backend; rank 0 waits for each
follower's report before its engine starts, so the target is SERVING only when every rank is
ready, and a rank that fails (an exception: its message; killed: its exit code) fails the
service's start-up naming that rank. While serving, a follower that dies leaves rank 0 unable to
compute: rank 0 logs which rank and exits, to be restarted whole (as vLLM's engine does when a
worker dies); the gateway rebuilds its requests' sequences when the target is back. A follower
whose rank 0 dies exits too."""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime import tensor_parallel, threads
from services.common.ports import free_port
from services.target.config import TargetConfig
from services.target.hooks import TargetHooks

log = logging.getLogger("dflash.target.ranks")

POLL_S = 0.2                            # how often rank 0 looks at its followers
GROUP_TIMEOUT_S = 600.0                 # a collective waits this long (a rank's first kernels)
EXIT_RANK_LOST = 70                     # rank 0's exit code when a follower died while serving


class RankFailed(RuntimeError):
    """A follower failed (its error or exit code in the message)."""


@dataclass(frozen=True)
class Report:
    """A follower's word to rank 0 over the start-up queue."""
    rank: int
    ok: bool
    detail: str = ""                    # the error (not ok)
    kv_pages: int = 0                   # its KV pages (ok): every rank must hold the same


def group_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def compute_threads(size: int) -> int:
    """CPU threads per rank: the process's share of the cores (N ranks on one host)."""
    return max(1, threads.COMPUTE_THREADS // size)


class TensorParallelRanks:
    """Rank 0's handle on its followers."""

    def __init__(self, config: TargetConfig, procs: list, reports: mp.Queue) -> None:
        self.config, self.procs, self.reports = config, procs, reports
        self._watching = False
        self._ready: list[Report] = []     # ready reports read while looking for errors

    @classmethod
    def launch(cls, config: TargetConfig, hooks: TargetHooks) -> TensorParallelRanks:
        """Starts ranks 1..N-1 and joins the group with them (blocking: a start-up stage)."""
        size = config.tensor_parallel_size
        address = f"127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        reports = ctx.Queue()
        level = logging.getLevelName(logging.getLogger("dflash").getEffectiveLevel())
        procs = [ctx.Process(target=follow, args=(config, hooks, rank, address, reports, level),
                             name=f"target-rank-{rank}", daemon=True)
                 for rank in range(1, size)]
        for p in procs:
            p.start()
        ranks = cls(config, procs, reports)
        log.info("tensor-parallel ranks started", extra={
            "size": size, "backend": group_backend(config.device),
            "pids": [p.pid for p in procs]})
        threads_each = compute_threads(size)
        threads.COMPUTE_THREADS = threads_each       # rank 0's engine thread: its share
        ranks._blocking("joining the tensor-parallel group", lambda: tensor_parallel.init(
            group_backend(config.device), 0, size, address, GROUP_TIMEOUT_S))
        return ranks

    # -- start-up -------------------------------------------------------------------------------
    def wait_ready(self, kv_pages: int, timeout_s: float = GROUP_TIMEOUT_S) -> None:
        """Every follower's report that it built its backend (rank 0 has built its own)."""
        deadline = time.monotonic() + timeout_s
        ready = 0
        while ready < len(self.procs):
            report = self._next_report(deadline, "building its attention backend")
            if not report.ok:
                raise RankFailed(f"tensor-parallel rank {report.rank} failed during start-up: "
                                 f"{report.detail}")
            if report.kv_pages != kv_pages:
                raise RankFailed(f"tensor-parallel rank {report.rank} holds {report.kv_pages} KV "
                                 f"pages, rank 0 {kv_pages}: every rank must hold the same")
            ready += 1
        log.info("every tensor-parallel rank is ready", extra={"ranks": len(self.procs) + 1})

    def _next_report(self, deadline: float, doing: str) -> Report:
        while True:
            if self._ready:
                return self._ready.pop(0)
            try:
                return self.reports.get(timeout=POLL_S)
            except queue.Empty:
                pass
            self._check_alive(doing)
            if time.monotonic() > deadline:
                raise RankFailed(f"tensor-parallel ranks did not finish {doing} in time")

    def _blocking(self, doing: str, fn: Callable[[], None]) -> None:
        """fn() (a collective) on a daemon thread, while watching the followers: a follower that
        died or failed fails it at once instead of leaving it blocked until the group's timeout
        (the thread is left behind; start-up fails and the process exits)."""
        done, error = threading.Event(), []

        def run() -> None:
            try:
                fn()
            except BaseException as e:              # noqa: BLE001 - carried to the caller
                error.append(e)
            done.set()
        threading.Thread(target=run, name="tp-collective", daemon=True).start()
        while not done.wait(POLL_S):
            self._check_alive(doing)
        if error:
            raise RankFailed(f"tensor-parallel start-up failed while {doing}: {error[0]}")

    def _check_alive(self, doing: str) -> None:
        """A follower's error report or exit -> RankFailed naming it (ready reports are kept
        for wait_ready)."""
        while True:
            try:
                report = self.reports.get_nowait()
            except queue.Empty:
                break
            if not report.ok:
                raise RankFailed(f"tensor-parallel rank {report.rank} failed during start-up "
                                 f"({doing}): {report.detail}")
            self._ready.append(report)
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                raise RankFailed(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code "
                                 f"{p.exitcode} during start-up ({doing})")

    # -- serving --------------------------------------------------------------------------------
    def send(self, *op) -> None:
        """An operation every follower runs too, in this order (rank 0 runs it right after)."""
        dist.broadcast_object_list([op], src=0)

    def watch(self) -> None:
        """From now on a follower's death ends this process (EXIT_RANK_LOST)."""
        self._watching = True
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _watch(self) -> None:
        while self._watching:
            dead = self._dead()
            if dead is not None and self._watching:
                self._exit(*dead)
            time.sleep(POLL_S)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """An operation of every rank: when it fails because the group did (a follower died
        inside a collective), this process ends at once as the watchdog would - before the
        engine could answer the batch's calls INTERNAL, which the gateway does not retry."""
        try:
            yield
        except Exception as e:
            deadline = time.monotonic() + 2.0       # its exit may not be visible yet
            while (dead := self._dead()) is None and time.monotonic() < deadline:
                time.sleep(POLL_S / 4)
            if dead is not None:
                self._exit(*dead)
            if isinstance(e, dist.DistError):
                _exit_rank_lost(f"the tensor-parallel group failed while serving: {e}")
            raise

    def _dead(self) -> tuple[int, int | None, int] | None:
        """(rank, pid, exit code) of a follower that exited, else None."""
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return rank, p.pid, p.exitcode
        return None

    def _exit(self, rank: int, pid: int | None, code: int) -> None:
        _exit_rank_lost(f"tensor-parallel rank {rank} (pid {pid}) exited with code {code} "
                        f"while serving: the target cannot compute without it")

    def stop(self) -> None:
        """Followers leave their loop and exit (the service stops)."""
        self._watching = False
        try:
            self.send("stop")
        except Exception as e:                      # noqa: BLE001 - a follower already gone
            log.info("tensor-parallel stop not delivered to every rank: %s", e)
        for p in self.procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.terminate()


# -- a follower ----------------------------------------------------------------------------------
def follow(config: TargetConfig, hooks: TargetHooks, rank: int, address: str,
           reports: mp.Queue, log_level: str = "INFO") -> None:
    """Rank `rank`'s process: start-up stages, a report to rank 0, then rank 0's operations
    until "stop" (or rank 0 is gone)."""
    from services.common.logs import setup_logging
    from services.target.worker import TargetWorker
    setup_logging(log_level, f"target-rank-{rank}")
    _exit_with_parent()
    threads.serial()
    size = config.tensor_parallel_size
    try:
        tensor_parallel.init(group_backend(config.device), rank, size, address, GROUP_TIMEOUT_S)
        if config.device.startswith("cuda"):
            torch.cuda.set_device(rank)
        if hooks.fail_tensor_parallel_rank == rank:
            raise RuntimeError("testing hook: this rank fails at start-up")
        time.sleep(hooks.backend_delay_s)
        worker = TargetWorker(config, hooks, rank=rank)
        worker.alloc_memory_pools()
        worker.init_attention_backends()
    except BaseException as e:                      # reported, then exit
        reports.put(Report(rank, False, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from e
    reports.put(Report(rank, True, kv_pages=worker.kv_cache.usable_pages))
    threads.parallel(compute_threads(size))
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            name, *args = box[0]
            if name == "stop":
                break
            RANK_OPS[name](worker, *args)
    except Exception as e:                          # noqa: BLE001 - rank 0 gone or failed
        log.error("tensor-parallel rank %d stops: %s", rank, e)
        logging.shutdown()
        os._exit(1)
    dist.destroy_process_group()


def _exit_rank_lost(why: str) -> None:
    """Rank 0 ends (EXIT_RANK_LOST) to be restarted whole, its followers with it."""
    log.error("%s; exiting to be restarted whole", why)
    logging.shutdown()
    os._exit(EXIT_RANK_LOST)


def _exit_with_parent() -> None:
    """A follower exits when rank 0 does (killed: no collective may ever fail to tell it)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="tp-parent", daemon=True).start()


# the operations rank 0 sends (TargetWorker mirrors each of them through TensorParallelRanks.send)
RANK_OPS: dict[str, Callable] = {
    "forward": lambda worker, *args: worker.forward(*args),
    "copy_positions": lambda worker, *args: worker.kv_cache.copy_positions(*args),
    "capture_cuda_graphs": lambda worker: worker.capture_cuda_graphs(),
}
