"""The target engine: sequence table, leases, and the batched step over prefill chunks and
verify blocks. All sequence state is touched only on the engine thread."""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime import bench_switches, threads
from runtime.attention.metadata import SeqSlice
from runtime.bench_switches import ForcedAcceptance
from runtime.draft_tree import DraftTree
from runtime.kv_cache import OutOfPages
from runtime.sampling import (
    Acceptance,
    SamplingConfig,
    greedy_accept_batch,
    rejection_accept_device,
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
class VerifyCall:
    tokens: list[int]                   # [anchor, d1..dn]
    tree: DraftTree | None = None       # the drafts' parents; None = a chain

    @property
    def depths(self) -> Sequence[int]:
        """Each block row's offset from the anchor's position (0..n for a chain)."""
        return self.tree.depths if self.tree is not None else range(len(self.tokens))


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
                               on_idle=self._expire_leases, on_start=threads.parallel)
        self.leases = LeaseSweeper(worker.config.lease_seconds, self._release)
        self.stats = EngineStats()
        tau = bench_switches.forced_tau()       # benchmark-only; never a service flag
        self.forced = ForcedAcceptance(tau) if tau is not None else None

    def start(self) -> None:
        metrics.watch_queue(self.loop)          # running/waiting, read at scrape time
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    # -- API used by the servicer (awaitable) ------------------------------------------------
    async def prefill(self, call: PrefillCall) -> PrefillResult:
        return await self.loop.submit(Work("prefill", call.seq_id, call, cost=len(call.token_ids),
                                           splittable=True))

    async def verify(self, seq_id: str, tokens: list[int],
                     parents: list[int] | None = None) -> VerifyResult:
        """parents (checked by the caller, runtime.draft_tree.parents_problem): a tree of
        drafts; None or a chain's parents: a chain."""
        tree = DraftTree(tokens[1:], parents) if parents else None
        call = VerifyCall(tokens, tree if tree is not None and not tree.is_chain else None)
        return await self.loop.submit(Work("verify", seq_id, call, cost=len(tokens)))

    async def release(self, seq_id: str) -> bool:
        return await self.loop.submit(Work("release", seq_id, None, cost=0, detached=True))

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
        would write the same KV positions), no Verify before its Prefill has finished, and no
        Release of a sequence whose forward this iteration already holds (it would free the
        pages that forward reads and writes)."""
        if work.seq_id in busy:
            return True
        if work.kind == "release":
            return False
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
        if work.payload.tree is not None and not seq.sampling.greedy:
            raise InvalidArgument(
                f"a tree of drafts can only be verified for a greedy sequence (temperature 0); "
                f"{seq.seq_id!r} samples at temperature {seq.sampling.temperature:g}: send a chain "
                f"(no parents)")
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
            if work.kind == "prefill":
                start = work.done_tokens
                ids.extend(work.payload.token_ids[start: start + n])
                positions.extend(range(start, start + n))
                slices.append(SeqSlice(seq.table, start, n))
            else:                               # a tree's nodes run at their depth's position
                call: VerifyCall = work.payload
                ids.extend(call.tokens)
                positions.extend(seq.seq_len + d for d in call.depths)
                tree = call.tree.ancestor_mask() if call.tree is not None else None
                slices.append(SeqSlice(seq.table, seq.seq_len, n, tree))
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
        logits = self.worker.logits(_rows(out.hidden, rows)) if rows else None
        self._finish(runnable, out.captured, capture, logits)
        seconds = time.perf_counter() - t0
        self.stats.forwards += 1
        self.stats.forward_tokens += len(ids)
        self.stats.forward_seconds += seconds
        lb = metrics.labels()
        metrics.FORWARD_SECONDS.labels(lb.model_name, lb.service).observe(seconds)
        metrics.FORWARD_TOKENS.labels(lb.model_name, lb.service).inc(len(ids))

    def _finish(self, runnable, captured, capture, logits) -> None:
        """Acceptance and sampling are decided on the device for the whole batch, their results
        reach the host in one small transfer, then the features of every sequence in one
        (pinned) transfer."""
        self._suppress_eos(runnable, logits)
        choices = self._choose(runnable, logits)
        feats = FeatureFetch(captured, capture)
        outcomes: list[tuple[Work, TargetSequence, object]] = []
        offset = 0
        for (work, n, seq), choice in zip(runnable, choices):
            if work.kind == "prefill":
                done = work.done_tokens + n == len(work.payload.token_ids)
                feats.add(seq, offset, range(n))
                outcomes.append((work, seq, ("prefill", n, choice if done else None)))
            else:
                acc, rows = self._accept(work.payload, seq, choice)
                feats.add(seq, offset, rows)
                outcomes.append((work, seq, ("verify", n, acc)))
            offset += n
        fetched = feats.fetch()
        verify_commits: list[tuple[int, int]] = []
        for (work, seq, (kind, n, choice)), f in zip(outcomes, fetched):
            if kind == "prefill":
                self._finish_prefill_chunk(work, n, seq, f, choice)
            else:
                verify_commits.append((seq.state_slot, choice.accepted))
                self._resolve(work, VerifyResult(choice.accepted, choice.tokens, f, seq.seq_len))
        if verify_commits and self.worker.facts.hybrid:
            self.worker.commit_mamba_state(verify_commits)

    def _choose(self, runnable, logits) -> list:
        """Per runnable work, decided on the device and read back in one transfer:
        verify -> (a, bonus, argmax of its block rows); a finishing prefill chunk -> its next
        token; other prefill chunks -> None. Read-back layout: [argmax of every row, (a, bonus)
        of the greedy verifies, then one part per sampled verify / sampled prefill token]."""
        if logits is None:
            return [None] * len(runnable)
        dev = logits.device
        argmax = logits.argmax(dim=-1)                          # [R]
        greedy_rows: list[tuple[list[int], int, int]] = []      # (drafts, first row, block size)
        sampled: list[torch.Tensor] = []
        readers = []                                            # per work: values -> choice
        row = 0
        for work, n, seq in runnable:
            if work.kind == "verify":
                if work.payload.tree is not None:           # walked on the host (_accept)
                    readers.append(lambda v, r=row, n=n: (None, None, v[0][r: r + n]))
                elif seq.sampling.greedy:
                    k = len(greedy_rows)
                    greedy_rows.append((work.payload.tokens[1:], row, n))
                    readers.append(lambda v, k=k, r=row, n=n: (*v[1][2 * k: 2 * k + 2], v[0][r: r + n]))
                else:
                    drafts = torch.tensor(work.payload.tokens[1:], dtype=torch.int64).to(
                        dev, non_blocking=True)
                    probs = target_probs(logits[row: row + n], seq.sampling)
                    sampled.append(rejection_accept_device(drafts, probs, seq.generator))
                    j = 1 + len(sampled)
                    readers.append(lambda v, j=j, r=row, n=n: (*v[j], v[0][r: r + n]))
                row += n
            elif work.done_tokens + n == len(work.payload.token_ids):
                if seq.sampling.greedy:
                    readers.append(lambda v, r=row: v[0][r])
                else:
                    sampled.append(self._sample(seq, logits[row: row + 1]))
                    j = 1 + len(sampled)
                    readers.append(lambda v, j=j: v[j][0])
                row += 1
            else:
                readers.append(lambda v: None)
        greedy = (_greedy_batch(greedy_rows, argmax).flatten() if greedy_rows
                  else argmax.new_empty(0))
        parts = [argmax, greedy, *sampled]
        values = _split_host(torch.cat(parts).tolist(), [p.numel() for p in parts])
        return [read(values) for read in readers]

    def _suppress_eos(self, runnable, logits) -> None:
        """min_tokens: forbid EOS ids in the rows that predict outputs below the minimum."""
        if logits is None:
            return
        row = 0
        for work, n, seq in runnable:
            if work.kind == "verify":           # block row i predicts output num_generated + depth
                below, tree = seq.suppress_rows(n), work.payload.tree
                if tree is None:
                    suppress_tokens(logits[row: row + n], self._eos_ids(seq), below)
                elif below > 0:
                    for i, depth in enumerate(tree.depths):
                        if depth < below:
                            suppress_tokens(logits[row + i: row + i + 1], self._eos_ids(seq), 1)
                row += n
            else:
                rows = int(work.done_tokens + n == len(work.payload.token_ids))
                suppress_tokens(logits[row: row + rows], self._eos_ids(seq), seq.suppress_rows(rows))
                row += rows

    def _finish_prefill_chunk(self, work, n, seq, feats, token) -> None:
        call: PrefillCall = work.payload
        if feats is not None:
            work.state["features"].append(feats)
        work.done_tokens += n
        seq.seq_len = work.done_tokens
        seq.touch()
        if work.done_tokens < len(call.token_ids):
            return
        seq.prefilling = False
        seq.num_generated += 1
        chunks = work.state.pop("features")
        self._resolve(work, PrefillResult(token, torch.cat(chunks) if chunks else None, seq.seq_len))

    def _accept(self, call: VerifyCall, seq: TargetSequence, choice
                ) -> tuple[Acceptance, Sequence[int]]:
        """choice = (a, bonus, argmax of block rows 0..B-1) decided on the device (a tree: the
        argmax alone, walked here); commits a+1 tokens. Returns the acceptance and the block
        rows committed (the anchor's, then the accepted drafts'). A forced acceptance
        (benchmark-only switch) overrides a chain's a."""
        drafts = call.tokens[1:]
        a, bonus, argmax = choice
        if call.tree is not None:
            path, bonus = call.tree.greedy_path(argmax)
            a = len(path)
            self._compact_path(seq, path)
        else:
            if self.forced is not None:
                a = self.forced.accepted(len(drafts))
                bonus = argmax[a]
            path = list(range(1, a + 1))
        seq.seq_len += a + 1                    # anchor + accepted drafts now have KV
        seq.num_generated += a + 1
        self.worker.kv_cache.trim(seq.table, seq.seq_len)   # rejected positions' pages go back
        seq.touch()
        self.stats.record_verify(len(drafts), a)
        rows = [0] + path if call.tree is not None else range(a + 1)
        return Acceptance(a, [drafts[i - 1] for i in path] + [bonus]), rows

    def _compact_path(self, seq: TargetSequence, path: list[int]) -> None:
        """A tree's accepted nodes 1..a wrote their K/V at block rows `path`; the committed
        positions seq_len+1..seq_len+a need them in order (a no-op when the path is 1..a)."""
        moved = [(row, j) for j, row in enumerate(path, start=1) if row != j]
        if moved:
            start = seq.seq_len
            self.worker.kv_cache.copy_positions(seq.table, [start + r for r, _ in moved],
                                                [start + j for _, j in moved])

    def _sample(self, seq: TargetSequence, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] -> int64 [1]: one token drawn with the sequence's generator (device)."""
        probs = target_probs(logits, seq.sampling)
        return torch.multinomial(probs[0], 1, generator=seq.generator)

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


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] without an index transfer when the rows are all of t (a verify-only batch)."""
    if len(rows) == t.shape[0] and rows[0] == 0 and rows[-1] == len(rows) - 1:
        return t
    return t[torch.tensor(rows, device=t.device)]


def _greedy_batch(rows: list[tuple[list[int], int, int]], argmax: torch.Tensor) -> torch.Tensor:
    """rows: (drafts, first logits row, block size) per greedy verify; argmax [R] on the device.
    Returns int64 [S, 2] (a, bonus) decided on the device."""
    width = max(len(d) for d, _, _ in rows)
    drafts = torch.full((len(rows), width), -1, dtype=torch.int64)
    index = torch.empty((len(rows), width + 1), dtype=torch.int64)
    for i, (d, first, n) in enumerate(rows):
        drafts[i, : len(d)] = torch.tensor(d, dtype=torch.int64)
        index[i] = first + torch.arange(width + 1).clamp(max=n - 1)
    both = torch.cat([drafts, index], dim=1).to(argmax.device)     # one host->device copy
    return greedy_accept_batch(both[:, :width], argmax[both[:, width:]])


def _split_host(flat: list[int], sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in sizes:
        out.append(flat[start: start + n])
        start += n
    return out


class FeatureFetch:
    """Collects (sequence, first row, rows) requests over one forward's captured features
    [T, K*H] and brings them to the host together: one gather and one pinned device->host
    copy per distinct (layers, dtype) group - one in the usual case where every sequence asks
    for the same layers - instead of one transfer per sequence."""

    def __init__(self, captured: torch.Tensor | None, capture: tuple[int, ...]) -> None:
        self.captured, self.capture = captured, capture
        # (layers, dtype, first row of the sequence's part, its rows wanted) per request
        self.requests: list[tuple[tuple[int, ...], torch.dtype, int, Sequence[int]] | None] = []

    def add(self, seq: TargetSequence, first: int, rows: Sequence[int]) -> None:
        """rows: of the sequence's part of the forward, which starts at row `first`."""
        if self.captured is None or not seq.capture_layers:
            self.requests.append(None)
        else:
            self.requests.append((seq.capture_layers, seq.feature_dtype, first, rows))

    def fetch(self) -> list[torch.Tensor | None]:
        """Per request, a host tensor [rows, len(layers)*H] in its dtype (None: none asked)."""
        out: list[torch.Tensor | None] = [None] * len(self.requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(self.requests):
            if r is not None:
                groups.setdefault(r[:2], []).append(i)
        for (layers, dtype), members in groups.items():
            rows = self._columns(self._rows(members), layers).to(dtype)
            host = _to_host(rows)
            start = 0
            for i in members:
                n = len(self.requests[i][3])
                out[i] = host[start: start + n]
                start += n
        return out

    def _rows(self, members: list[int]) -> torch.Tensor:
        """The requested rows of the members, in order (a slice when they are one range)."""
        spans = [(self.requests[i][2], self.requests[i][3]) for i in members]
        if len(spans) == 1 and isinstance(spans[0][1], range) and spans[0][1].step == 1:
            first, rows = spans[0]
            return self.captured[first + rows.start: first + rows.stop]
        index = torch.cat([torch.arange(first + rows.start, first + rows.stop)
                           if isinstance(rows, range) and rows.step == 1
                           else torch.tensor([first + r for r in rows], dtype=torch.int64)
                           for first, rows in spans])
        return self.captured.index_select(0, index.to(self.captured.device))

    def _columns(self, rows: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
        """The columns of `layers` (a subset of the batch's captured layers, in their order)."""
        if layers == self.capture:
            return rows
        h = rows.shape[-1] // len(self.capture)
        return torch.cat([rows[:, self.capture.index(layer) * h: (self.capture.index(layer) + 1) * h]
                          for layer in layers], dim=-1)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """One device->host copy into pinned memory (torch's caching host allocator reuses the
    block once the returned tensor is freed); CPU tensors are returned as they are."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


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
