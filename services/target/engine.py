"""The target engine: sequence table, leases, and the batched step over prefill chunks and
verify blocks. All sequence state is touched only on the engine thread."""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch

from runtime.attention.metadata import SeqSlice
from runtime.kv_cache import OutOfPages
from runtime.sampling import (
    Acceptance,
    SamplingConfig,
    greedy_accept,
    rejection_accept,
    suppress_tokens,
    target_probs,
)
from runtime.state_pool import OutOfStateSlots
from services.common import metrics
from services.common.engine_loop import EngineLoop, Work
from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
)
from services.common.leases import LeaseSweeper
from services.target.sequence import TargetSequence
from services.target.worker import TargetWorker

log = logging.getLogger("dflash.target.engine")


@dataclass(frozen=True)
class PrefillCall:
    seq_id: str
    token_ids: list[int]
    sampling: SamplingConfig
    capture_layers: tuple[int, ...]
    feature_dtype: torch.dtype
    num_generated: int = 0


@dataclass(frozen=True)
class PrefillResult:
    next_token: int
    features: torch.Tensor | None       # [L, K*H] in the requested dtype (CPU)
    seq_len: int


@dataclass(frozen=True)
class VerifyResult:
    accepted: int
    committed: list[int]
    features: torch.Tensor | None       # [a+1, K*H]
    seq_len: int


class TargetEngine:
    def __init__(self, worker: TargetWorker) -> None:
        self.worker = worker
        self.seqs: dict[str, TargetSequence] = {}
        self.loop = EngineLoop(self._step, worker.config.token_budget, name="target-engine",
                               on_idle=self._expire_leases)
        self.leases = LeaseSweeper(worker.config.lease_seconds, self._release)
        self.stats = EngineStats()

    def start(self) -> None:
        metrics.watch_queue(self.loop)          # running/waiting, read at scrape time
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    # -- API used by the servicer (awaitable) ------------------------------------------------
    async def prefill(self, call: PrefillCall) -> PrefillResult:
        return await self.loop.submit(Work("prefill", call.seq_id, call, cost=len(call.token_ids),
                                           splittable=True))

    async def verify(self, seq_id: str, tokens: list[int]) -> VerifyResult:
        return await self.loop.submit(Work("verify", seq_id, tokens, cost=len(tokens)))

    async def release(self, seq_id: str) -> bool:
        return await self.loop.submit(Work("release", seq_id, None, cost=0))

    # -- engine thread -------------------------------------------------------------------------
    def _step(self, batch: list[tuple[Work, int]]) -> None:
        self.leases.maybe_sweep(self.seqs)
        runnable: list[tuple[Work, int, TargetSequence]] = []
        busy: set[str] = set()
        for work, n in batch:
            if self._must_wait(work, busy):
                continue                        # stays queued for the next iteration
            try:
                seq = self._admit(work, n)
            except ServiceError as e:
                self._drop_failed_prefill(work)
                self._publish()
                work.fail(e)
                continue
            if seq is not None:
                runnable.append((work, n, seq))
                busy.add(work.seq_id)
        if runnable:
            self._run_forward(runnable)
        self._publish()

    def _must_wait(self, work: Work, busy: set[str]) -> bool:
        """At most one forward per sequence per iteration (two Verify calls of one sequence
        would write the same KV positions), and no Verify before its Prefill has finished."""
        if work.kind == "release":
            return False
        if work.seq_id in busy:
            return True
        seq = self.seqs.get(work.seq_id)
        return work.kind == "verify" and seq is not None and seq.prefilling

    def _admit(self, work: Work, n: int) -> TargetSequence | None:
        """Per-work checks and allocation; None when the work finished without a forward."""
        if work.kind == "release":
            self._resolve(work, self._release(work.seq_id))
            return None
        if work.kind == "prefill":
            if work.done_tokens == 0:
                seq = self._start_prefill(work)
                # all pages of the prompt at once: a prompt that does not fit fails before any
                # forward, instead of in a later chunk after others were slowed down by it
                self._ensure_pages(seq, len(work.payload.token_ids))
                return seq
            seq = work.state["seq"]
            if self.seqs.get(work.seq_id) is not seq:
                raise NotFound(f"sequence {work.seq_id!r} was released or replaced during its "
                               f"prefill")
            return seq
        seq = self.seqs.get(work.seq_id)
        if seq is None:
            raise NotFound(f"unknown sequence {work.seq_id!r}: never prefilled, released, or its "
                           f"lease expired; Prefill it again")
        max_ctx = self.worker.facts.max_context
        if seq.seq_len + n > max_ctx:
            raise InvalidArgument(f"verify of {n} tokens at position {seq.seq_len} passes the "
                                  f"max context {max_ctx}; at most {max_ctx - seq.seq_len} fit")
        self._check_verify_states(seq, n)
        self._ensure_pages(seq, seq.seq_len + n)
        return seq

    def _check_verify_states(self, seq: TargetSequence, n: int) -> None:
        """hybrid: a block of 2+ tokens keeps per-position states in the sequence's verify slot."""
        pool = self.worker.state_pool
        if n > 1 and seq.state_slot is not None and pool.verify_slot(seq.state_slot) is None:
            raise FailedPrecondition(
                f"sequence {seq.seq_id!r} holds no verify states (all {pool.num_verify_slots} "
                f"verify state slots were taken when it was prefilled), so only 1-token blocks "
                f"can be verified, not {n}; Release and Prefill it again when a slot is free, or "
                f"start the target with more --verify-state-slots")

    def _start_prefill(self, work: Work) -> TargetSequence:
        call: PrefillCall = work.payload
        if call.seq_id in self.seqs:            # a Prefill replaces the sequence
            self._release(call.seq_id)
        seed = call.sampling.seed if call.sampling.seed is not None else random.getrandbits(63)
        generator = None
        if not call.sampling.greedy:
            generator = torch.Generator(device=self.worker.device)
            generator.manual_seed(seed)
        seq = TargetSequence(call.seq_id, call.sampling, call.capture_layers, call.feature_dtype,
                             generator, num_generated=call.num_generated)
        if self.worker.facts.hybrid:
            try:
                seq.state_slot = self.worker.state_pool.allocate(call.seq_id)
            except OutOfStateSlots as e:
                raise ResourceExhausted(str(e)) from None
        self.seqs[call.seq_id] = seq
        work.state.update(seq=seq, features=[])
        return seq

    def _ensure_pages(self, seq: TargetSequence, num_tokens: int) -> None:
        try:
            self.worker.kv_cache.ensure(seq.table, num_tokens)
        except OutOfPages as e:
            raise ResourceExhausted(str(e)) from None

    def _drop_failed_prefill(self, work: Work) -> None:
        """A prefill that failed leaves no half-built sequence behind."""
        if work.kind == "prefill" and self.seqs.get(work.seq_id) is work.state.get("seq") is not None:
            self._release(work.seq_id)

    @torch.inference_mode()           # acceptance edits the (inference-mode) logits in place
    def _run_forward(self, runnable: list[tuple[Work, int, TargetSequence]]) -> None:
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        for work, n, seq in runnable:
            tokens = work.payload.token_ids[work.done_tokens: work.done_tokens + n] \
                if work.kind == "prefill" else work.payload
            start = work.done_tokens if work.kind == "prefill" else seq.seq_len
            ids.extend(tokens)
            positions.extend(range(start, start + n))
            slices.append(SeqSlice(seq.table, start, n))
        capture = tuple(sorted({layer for _, _, s in runnable for layer in s.capture_layers}))
        t0 = time.perf_counter()
        out = self.worker.forward(
            slices, torch.tensor(ids), torch.tensor(positions), capture,
            [s.state_slot for _, _, s in runnable],
            verify=[w.kind == "verify" for w, _, _ in runnable])
        rows, offset = [], 0
        for work, n, seq in runnable:
            if work.kind == "verify":
                rows.extend(range(offset, offset + n))
            elif work.done_tokens + n == len(work.payload.token_ids):
                rows.append(offset + n - 1)
            offset += n
        logits = self.worker.logits(out.hidden[rows]) if rows else None
        self._finish(runnable, out.captured, capture, logits)
        seconds = time.perf_counter() - t0
        self.stats.forwards += 1
        self.stats.forward_tokens += len(ids)
        self.stats.forward_seconds += seconds
        lb = metrics.labels()
        metrics.FORWARD_SECONDS.labels(lb.model_name, lb.service).observe(seconds)
        metrics.FORWARD_TOKENS.labels(lb.model_name, lb.service).inc(len(ids))

    def _finish(self, runnable, captured, capture, logits) -> None:
        self._suppress_eos(runnable, logits)
        # every greedy choice of the batch in one device->host transfer
        argmax = logits.argmax(dim=-1).tolist() if logits is not None else []
        offset, row = 0, 0
        verify_commits: list[tuple[int, int]] = []
        for work, n, seq in runnable:
            feats = _select_features(captured, capture, seq.capture_layers, offset, n)
            offset += n
            if work.kind == "prefill":
                row += self._finish_prefill_chunk(work, n, seq, feats, logits, row, argmax)
            else:
                result = self._accept(work.payload, seq, logits[row: row + n],
                                      argmax[row: row + n], feats)
                row += n
                verify_commits.append((seq.state_slot, result.accepted))
                self._resolve(work, result)
        if verify_commits and self.worker.facts.hybrid:
            self.worker.commit_mamba_state(verify_commits)

    def _suppress_eos(self, runnable, logits) -> None:
        """min_tokens: forbid EOS ids in the rows that predict outputs below the minimum."""
        if logits is None:
            return
        row = 0
        for work, n, seq in runnable:
            rows = n if work.kind == "verify" else int(work.done_tokens + n == len(work.payload.token_ids))
            suppress_tokens(logits[row: row + rows], self._eos_ids(seq), seq.suppress_rows(rows))
            row += rows

    def _finish_prefill_chunk(self, work, n, seq, feats, logits, row, argmax) -> int:
        call: PrefillCall = work.payload
        if feats is not None:
            work.state["features"].append(feats.to(call.feature_dtype).cpu())
        work.done_tokens += n
        seq.seq_len = work.done_tokens
        seq.touch()
        if work.done_tokens < len(call.token_ids):
            return 0
        seq.prefilling = False
        token = argmax[row] if seq.sampling.greedy else self._sample(seq, logits[row: row + 1])
        seq.num_generated += 1
        chunks = work.state.pop("features")
        self._resolve(work, PrefillResult(token, torch.cat(chunks) if chunks else None, seq.seq_len))
        return 1

    def _accept(self, tokens: list[int], seq: TargetSequence, logits: torch.Tensor,
                argmax: list[int], feats: torch.Tensor | None) -> VerifyResult:
        """logits [B, V] (EOS already suppressed) and their argmax for block positions
        0..B-1; commits a+1 tokens."""
        drafts = tokens[1:]
        if seq.sampling.greedy:
            acc: Acceptance = greedy_accept(drafts, argmax)
        else:
            acc = rejection_accept(drafts, target_probs(logits, seq.sampling), seq.generator)
        a = acc.accepted
        seq.seq_len += a + 1                    # anchor + accepted drafts now have KV
        seq.num_generated += a + 1
        self.worker.kv_cache.trim(seq.table, seq.seq_len)   # rejected positions' pages go back
        seq.touch()
        self.stats.record_verify(len(drafts), a)
        out_feats = feats[: a + 1].to(seq.feature_dtype).cpu() if feats is not None else None
        return VerifyResult(a, acc.tokens, out_feats, seq.seq_len)

    def _sample(self, seq: TargetSequence, logits: torch.Tensor) -> int:
        """logits [1, V] -> one token drawn with the sequence's generator."""
        probs = target_probs(logits, seq.sampling)
        return int(torch.multinomial(probs[0], 1, generator=seq.generator))

    def _eos_ids(self, seq: TargetSequence) -> list[int]:
        if seq.sampling.min_tokens <= 0:
            return []
        return sorted(set(self.worker.facts.eos_token_ids) | set(seq.sampling.stop_token_ids))

    # -- lifecycle ---------------------------------------------------------------------------
    def _release(self, seq_id: str) -> bool:
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return False
        self.worker.kv_cache.release(seq.table)
        if seq.state_slot is not None:
            self.worker.state_pool.free(seq.state_slot)
        return True

    def _expire_leases(self) -> None:
        if self.leases.sweep(self.seqs):
            self._publish()

    def _resolve(self, work: Work, result: object) -> None:
        """Gauges first: a caller that reads /metrics after its reply sees its own effect."""
        self._publish()
        work.resolve(result)

    def _publish(self) -> None:
        """Gauges of this engine's state (engine thread, after each step and lease check)."""
        lb = metrics.labels()
        metrics.KV_USAGE.labels(lb.model_name, lb.service).set(self.worker.kv_cache.usage())
        metrics.SEQUENCES.labels(lb.model_name, lb.service).set(len(self.seqs))
        if (pool := self.worker.state_pool) is not None:
            metrics.STATE_USAGE.labels(lb.model_name, lb.service).set(pool.usage())


def _select_features(captured: torch.Tensor | None, capture: tuple[int, ...],
                     wanted: tuple[int, ...], offset: int, n: int) -> torch.Tensor | None:
    """Rows [offset, offset+n) of the batch capture, columns of this sequence's layers."""
    if captured is None or not wanted:
        return None
    rows = captured[offset: offset + n]
    if wanted == capture:
        return rows
    h = rows.shape[-1] // len(capture)
    return torch.cat([rows[:, capture.index(layer) * h: (capture.index(layer) + 1) * h]
                      for layer in wanted], dim=-1)


class EngineStats:
    def __init__(self) -> None:
        self.forwards = 0
        self.forward_tokens = 0
        self.forward_seconds = 0.0
        self.verifies = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0

    def record_verify(self, drafts: int, accepted: int) -> None:
        self.verifies += 1
        self.draft_tokens += drafts
        self.accepted_tokens += accepted
