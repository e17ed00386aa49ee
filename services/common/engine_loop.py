"""Continuous batching: RPC handlers submit work and await it; one engine thread owns the model
and runs everything pending as one batch per iteration, up to a token budget, with no waiting
window. Latency-critical work (verify/propose blocks, releases) is taken first, then prompt
work FIFO with what is left of the budget; prompts larger than the rest are split into chunks.
Work whose caller went away (a cancelled RPC) is dropped before it runs, except detached work:
a Release runs even when its RPC timed out, so memory never waits for a sequence's lease."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("dflash.engine")


@dataclass(eq=False)
class Work:
    kind: str                         # e.g. "prefill", "verify", "propose", "release"
    seq_id: str
    payload: Any
    cost: int                         # tokens this work puts through the model
    splittable: bool = False          # prompt work: may run in chunks across iterations
    detached: bool = False            # runs even when its caller has gone (a Release: memory is
                                      # freed whether or not anyone still waits for the answer)
    done_tokens: int = 0              # progress of a split work
    state: dict[str, Any] = field(default_factory=dict)   # scratch for the step (chunk outputs)
    future: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None
    enqueued_at: float = field(default_factory=time.monotonic)
    finished: bool = False

    @property
    def remaining(self) -> int:
        return self.cost - self.done_tokens

    def cancelled(self) -> bool:
        """Its caller gave up before it ran: it is dropped (never for a detached work)."""
        return not self.detached and self.future is not None and self.future.cancelled()

    def resolve(self, result: Any) -> None:
        self.finished = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(settle, self.future, result, None)

    def fail(self, error: BaseException) -> None:
        self.finished = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(settle, self.future, None, error)


def settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


Step = Callable[[list[tuple[Work, int]]], None]


class EngineLoop:
    """step(batch) receives [(work, n_tokens)] and must resolve or fail every work it finishes;
    a split work that is not finished stays queued for the next iteration."""

    def __init__(self, step: Step, token_budget: int, name: str = "engine",
                 on_idle: Callable[[], None] | None = None, idle_tick_s: float = 0.5,
                 on_start: Callable[[], None] | None = None) -> None:
        self.step = step
        self.on_start = on_start      # first thing on the engine thread (runtime.threads.parallel)
        self.token_budget = token_budget
        self.on_idle = on_idle
        self.idle_tick_s = idle_tick_s
        self._urgent: list[Work] = []
        self._prompts: list[Work] = []
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._running = 0             # works of the batch being run (they stay queued meanwhile)
        self.iterations = 0
        # True: prompt chunks never share a forward with other works (set by the target where
        # CUDA graphs are captured: a mixed batch runs eagerly); read at every iteration
        self.prompts_apart: Callable[[], bool] = lambda: False
        # apart: at most this many sequences' chunks in a prompts' forward (1: the lone chunk a
        # captured prefill graph runs; more: one eager forward for the prompts waiting together)
        self.prompt_sequences = 1
        self._prompts_turn = False    # apart: the next forward is the prompts' (they alternate)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    @property
    def waiting(self) -> int:
        """Works queued and not in the batch being run."""
        with self._cv:
            return len(self._urgent) + len(self._prompts) - self._running

    @property
    def running(self) -> int:
        """Works in the batch being run (0 between batches)."""
        with self._cv:
            return self._running

    async def submit(self, work: Work) -> Any:
        loop = asyncio.get_running_loop()
        work.loop, work.future = loop, loop.create_future()
        with self._cv:
            (self._prompts if work.splittable else self._urgent).append(work)
            self._cv.notify()
        return await work.future

    def call(self, fn: Callable[[], Any]) -> None:
        """Runs fn on the engine thread before the next batch (state changes stay single-owner)."""
        self.post(Work(kind="call", seq_id="", payload=fn, cost=0))

    def post(self, work: Work) -> None:
        with self._cv:
            self._urgent.append(work)
            self._cv.notify()

    def _take(self) -> list[tuple[Work, int]]:
        with self._cv:
            while not self._stopped and not self._urgent and not self._prompts:
                if not self._cv.wait(timeout=self.idle_tick_s) and self.on_idle:
                    self._cv.release()
                    try:
                        self.on_idle()
                    finally:
                        self._cv.acquire()
            if self._stopped:
                return []
            for queue in (self._urgent, self._prompts):
                queue[:] = [w for w in queue if not w.cancelled()]
            batch: list[tuple[Work, int]] = []
            apart = self.prompts_apart()
            urgent, prompts = self._turns(apart)
            budget = self._fill(self._urgent, self.token_budget, batch, urgent)
            self._fill(self._prompts, budget, batch, prompts,
                       self.prompt_sequences if apart else None)
            self._running = len(batch)
            return batch

    def _turns(self, apart: bool) -> tuple[bool, bool]:
        """Whether this iteration computes the urgent works (verifies, proposes) and whether it
        computes prompt chunks: both, unless prompts run apart (prompts_apart) - then, while
        both wait, they take turns, so that neither starves."""
        if not apart:
            return True, True
        computing = any(w.remaining for w in self._urgent)
        if not (computing and self._prompts):
            return True, not computing
        self._prompts_turn = not self._prompts_turn
        return not self._prompts_turn, self._prompts_turn

    @staticmethod
    def _fill(queue: list[Work], budget: int, batch: list[tuple[Work, int]],
              computing: bool, max_computing: int | None = None) -> int:
        """Takes the queue's works FIFO into `batch` within `budget` (a prompt larger than what
        is left is split; the first work always fits); computing False: only works of cost 0
        (releases, calls); max_computing: at most that many works with tokens (prompts apart:
        prompt_sequences sequences' chunks per forward; 1, the batch a prefill graph was
        captured for). Returns the budget left."""
        taken = 0
        for w in queue:
            if w.remaining and not (computing and (max_computing is None or taken < max_computing)):
                continue
            if w.remaining <= budget or not batch:
                n = w.remaining if (w.remaining <= budget or not w.splittable) else budget
            elif w.splittable and budget > 0:
                n = budget
            else:
                continue
            batch.append((w, n))
            taken += bool(w.remaining)
            budget = max(budget - n, 0)      # no break: works of cost 0 (releases) still fit
        return budget

    def _run(self) -> None:
        if self.on_start is not None:
            self.on_start()
        while True:
            batch = self._take()
            if not batch:
                if self._stopped:
                    return
                continue
            calls = [w for w, _ in batch if w.kind == "call"]
            for w in calls:
                self._safe(w.payload)
                w.finished = True
            work = [(w, n) for w, n in batch if w.kind != "call"]
            if work:
                try:
                    self.step(work)
                except Exception as e:  # a bug in the step: fail this batch, keep serving
                    log.exception("engine step failed")
                    for w, _ in work:
                        if not w.finished:
                            w.fail(e)
            self.iterations += 1
            with self._cv:
                for w, _ in batch:
                    if w.finished:
                        for queue in (self._urgent, self._prompts):
                            if w in queue:
                                queue.remove(w)
                self._running = 0

    @staticmethod
    def _safe(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception:
            log.exception("engine call failed")
