"""The skeleton both model engines share (target: services/target/engine.py, draft:
services/draft/engine.py): the sequence table, the engine loop (services/common/engine_loop.py)
that runs `_step` on its one thread, leases, Release, the gauges and the forward statistics.

All sequence state is touched only on the engine thread; RPC handlers submit work and await it."""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from dflash.v1 import common_pb2
from runtime import threads
from services.common import metrics
from services.common.engine_loop import EngineLoop, Work, settle
from services.common.errors import ServiceError
from services.common.leases import Leased, LeaseSweeper

S = TypeVar("S", bound=Leased)
T = TypeVar("T")


class EngineStats:
    """What the forwards of an engine did (read by tests and benchmarks; /metrics has the same
    as FORWARD_SECONDS and FORWARD_TOKENS)."""

    def __init__(self) -> None:
        self.batches = 0                # forwards
        self.items = 0                  # works in them (a prefill chunk, a verify, a propose)
        self.max_batch = 0
        self.tokens = 0
        self.seconds = 0.0
        self.verifies = 0               # target: verified blocks, their drafts, accepted drafts
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def record_forward(self, items: int, tokens: int, seconds: float) -> None:
        self.batches += 1
        self.items += items
        self.max_batch = max(self.max_batch, items)
        self.tokens += tokens
        self.seconds += seconds
        lb = metrics.labels()
        metrics.FORWARD_SECONDS.labels(lb.model_name, lb.service).observe(seconds)
        metrics.FORWARD_TOKENS.labels(lb.model_name, lb.service).inc(tokens)

    def record_verify(self, drafts: int, accepted: int) -> None:
        self.verifies += 1
        self.draft_tokens += drafts
        self.accepted_tokens += accepted


class SequenceEngine(ABC, Generic[S]):
    def __init__(self, token_budget: int, lease_seconds: float, name: str) -> None:
        self.seqs: dict[str, S] = {}
        self.loop = EngineLoop(self._step, token_budget, name=name,
                               on_idle=self._expire_leases, on_start=threads.parallel)
        self.leases = LeaseSweeper(lease_seconds, self._release)
        self.stats = EngineStats()

    def start(self) -> None:
        metrics.watch_queue(self.loop)          # running/waiting, read at scrape time
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    async def on_engine_thread(self, fn: Callable[[], T]) -> T:
        """fn() on the engine thread (the one that computes with the process's threads), its
        result or exception returned here: start-up measurements that must see the threads
        serving will use."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def call() -> None:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                loop.call_soon_threadsafe(settle, future, None, e)
            else:
                loop.call_soon_threadsafe(settle, future, result, None)
        self.loop.call(call)
        return await future

    async def release(self, seq_id: str) -> bool:
        """Frees the sequence (False: it was not there). Runs even if its caller goes away."""
        return await self.loop.submit(Work("release", seq_id, None, cost=0, detached=True))

    async def _submit(self, work: Work) -> Any:
        """Work on a sequence (Prefill, Verify, Propose). If its caller goes away first (the RPC
        was cancelled or passed its deadline), the sequence is released at once: the caller
        cannot know what state it was left in and starts it anew, and its memory must not wait
        for the lease."""
        try:
            return await self.loop.submit(work)
        except asyncio.CancelledError:
            self.abandoned(work)
            raise

    def abandoned(self, work: Work) -> None:
        """The caller of `work` is gone (also after it was answered, when the answer could not
        be delivered): its sequence is released (any thread)."""
        self.loop.post(Work("release", work.seq_id, work, cost=0, detached=True))

    # -- engine thread -------------------------------------------------------------------------
    @abstractmethod
    def _step(self, batch: list[tuple[Work, int]]) -> None:
        """Runs one iteration's works; must answer or fail every work it finishes."""

    @abstractmethod
    def _free(self, seq: S) -> None:
        """Gives the sequence's memory back."""

    @abstractmethod
    def kv_usage(self) -> float:
        """Share of the KV pages in use."""

    def load(self) -> common_pb2.EngineLoad:
        """What the gateway places requests by (gateway/state.py), in every answer."""
        return common_pb2.EngineLoad(sequences=len(self.seqs), kv_usage=self.kv_usage())

    def _publish_more(self) -> None:
        """Gauges of an engine's own (the target's recurrent state pool)."""

    def _release(self, seq_id: str) -> bool:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return False
        self._free(seq)
        return True

    def _release_work(self, work: Work) -> bool:
        """A Release; or, for an abandoned work (the payload), the release of the sequence it
        used - not of one that a later call started anew under the same id."""
        abandoned = work.payload
        if isinstance(abandoned, Work):
            seq = self.seqs.get(work.seq_id)
            if seq is None or (abandoned.state.get("seq") is not seq
                               and seq.born > abandoned.enqueued_at):
                return False
        return self._release(work.seq_id)

    def _sweep_leases(self) -> None:
        """At the start of a step: at most once a second (leases.py)."""
        if self.leases.maybe_sweep(self.seqs):
            self._publish()

    def _expire_leases(self) -> None:
        if self.leases.sweep(self.seqs):
            self._publish()

    def _answer(self, work: Work, result: object) -> None:
        """Gauges first: a caller that reads /metrics after its reply sees its own effect."""
        self._publish()
        work.resolve(result)

    def _refuse(self, work: Work, error: ServiceError) -> None:
        self._publish()
        work.fail(error)

    def _publish(self) -> None:
        """Gauges of this engine's state (engine thread, after each step and lease check)."""
        lb = metrics.labels()
        metrics.KV_USAGE.labels(lb.model_name, lb.service).set(self.kv_usage())
        metrics.SEQUENCES.labels(lb.model_name, lb.service).set(len(self.seqs))
        metrics.PREFIX_CACHED_PAGES.labels(lb.model_name, lb.service).set(self.prefix_cached_pages())
        self._publish_more()

    def prefix_cached_pages(self) -> int:
        """Pages the prefix cache holds (0: none, or no prefix caching)."""
        return 0

