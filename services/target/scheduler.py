"""Which of an engine iteration's works run in its forward, with what memory (engine thread).

Waiting: at most one forward per sequence per iteration (two Verify calls of one sequence would
write the same KV positions), no Verify before its Prefill has finished, and no Release of a
sequence whose forward this iteration already holds (it would free the pages that forward reads
and writes). Those works stay queued for the next iteration.
Admission: a Release runs at once; a Prefill creates its sequence (replacing an earlier one of
the same id), takes the cached pages of its prompt's longest cached prefix (prefix caching: the
forward starts after them) and reserves the pages of the rest before any forward; a Verify must find
its sequence, fit the context and have the recurrent states it needs (hybrid models). A work that fails admission is answered with its error and
leaves no half-built sequence behind. Leases are swept by the engine (SequenceEngine)."""
from __future__ import annotations

import random
from collections.abc import Callable

import torch

from runtime.kv_cache import OutOfPages
from runtime.penalties import PenaltyState
from runtime.prefix_cache import prompt_keys
from runtime.state_pool import OutOfStateSlots
from services.common import metrics
from services.common.callers import external
from services.common.engine_loop import Work
from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
)
from services.target.batch import Scheduled
from services.target.calls import PrefillCall, VerifyCall
from services.target.sequence import TargetSequence
from services.target.worker import TargetWorker


class TargetScheduler:
    def __init__(self, worker: TargetWorker, seqs: dict[str, TargetSequence],
                 release: Callable[[str], bool], release_work: Callable[[Work], bool],
                 answer: Callable[[Work, object], None],
                 refuse: Callable[[Work, ServiceError], None]) -> None:
        """release(seq_id) frees a sequence, release_work(work) runs a release work (a Release,
        or an abandoned work's: SequenceEngine); answer / refuse settle a work (gauges first)."""
        self.worker, self.seqs = worker, seqs
        self.release, self.release_work = release, release_work
        self.answer, self.refuse = answer, refuse

    def admit(self, batch: list[tuple[Work, int]]) -> list[Scheduled]:
        """The works of `batch` that run in this iteration's forward (the others are answered
        or wait)."""
        runnable: list[Scheduled] = []
        busy: set[str] = set()
        for work, n in batch:
            if self._must_wait(work, busy):
                continue
            try:
                item = self._admit(work, n)
            except ServiceError as e:
                self._drop_failed_prefill(work)
                self.refuse(work, e)
                continue
            if item is not None:
                runnable.append(item)
                busy.add(work.seq_id)
        return runnable

    def _must_wait(self, work: Work, busy: set[str]) -> bool:
        if work.seq_id in busy:
            return True
        if work.kind == "release":
            return False
        seq = self.seqs.get(work.seq_id)
        return work.kind == "verify" and seq is not None and seq.prefilling

    def _admit(self, work: Work, n: int) -> Scheduled | None:
        """Per-work checks and memory; None when the work finished without a forward."""
        if work.kind == "release":
            self.answer(work, self.release_work(work))
            return None
        if work.kind == "prefill":
            seq = self._prefill_sequence(work)
            return Scheduled(work, self._prefill_tokens(work, n), seq)
        seq = self.seqs.get(work.seq_id)
        if seq is None:
            raise NotFound(f"unknown sequence {external(work.seq_id)!r}: never prefilled, released, or its "
                           f"lease expired; Prefill it again")
        self._check_verify(seq, work.payload, n)
        self._ensure_pages(seq, seq.seq_len + n)
        return Scheduled(work, n, seq)

    def _prefill_sequence(self, work: Work) -> TargetSequence:
        if "seq" not in work.state:
            seq = self._start_prefill(work.payload)
            work.state.update(seq=seq, features=[])
            work.done_tokens = seq.seq_len = work.state["cached"] = self._attach_prefix(
                seq, work.payload)
            # all pages of the prompt at once: a prompt that does not fit fails before any
            # forward, instead of in a later chunk after others were slowed down by it
            self._ensure_pages(seq, len(work.payload.token_ids))
            return seq
        seq = work.state["seq"]
        if self.seqs.get(work.seq_id) is not seq:
            raise NotFound(f"sequence {external(work.seq_id)!r} was released or replaced during its prefill")
        return seq

    def _attach_prefix(self, seq: TargetSequence, call: PrefillCall) -> int:
        """The positions of the prompt whose KV comes from the prefix cache: its longest cached
        prefix of full pages, short of its last token (whose forward gives the first output)
        and, when the draft needs features, of call.features_from (cached positions compute
        none)."""
        kv = self.worker.kv_cache
        if kv.prefix_cache is None:
            return 0
        keys = prompt_keys(call.token_ids, kv.page_size,
                           call.features_from if seq.capture_layers else None)
        checkpoints = self.worker.state_checkpoints
        if checkpoints is not None:     # hybrid: only as deep as a recurrent state was kept
            keys = keys[: checkpoints.deepest(keys[: len(kv.prefix_cache.match(keys))])]
        hit = kv.attach_prefix(seq.table, keys)
        if hit and checkpoints is not None:
            checkpoints.restore(keys[hit // kv.page_size - 1], seq.state_slot)
        metrics.record_prefix_lookup(len(call.token_ids), hit)
        return hit

    def _prefill_tokens(self, work: Work, n: int) -> int:
        """The tokens of a prompt that run in this forward: at most what is left of it, and on
        a hybrid model with state checkpoints, a chunk that would pass the prompt's last full
        page boundary ends there (its recurrent state is kept: runtime/state_checkpoints.py)."""
        total, start = len(work.payload.token_ids), work.done_tokens
        n = min(n, total - start)
        if self.worker.state_checkpoints is not None:
            page = self.worker.kv_cache.page_size
            boundary = (total - 1) // page * page
            if start < boundary < start + n:
                n = boundary - start
        return n

    def _check_verify(self, seq: TargetSequence, call: VerifyCall, n: int) -> None:
        max_ctx = self.worker.facts.max_context
        if seq.seq_len + n > max_ctx:
            raise InvalidArgument(f"verify of {n} tokens at position {seq.seq_len} passes the "
                                  f"max context {max_ctx}; at most {max_ctx - seq.seq_len} fit")
        pool = self.worker.state_pool
        if n > 1 and seq.state_slot is not None and pool.verify_slot(seq.state_slot) is None:
            raise FailedPrecondition(
                f"sequence {external(seq.seq_id)!r} holds no verify states (all {pool.num_verify_slots} "
                f"verify state slots were taken when it was prefilled), so only 1-token blocks "
                f"can be verified, not {n}; Release and Prefill it again when a slot is free, or "
                f"start the target with more --verify-state-slots")

    def _start_prefill(self, call: PrefillCall) -> TargetSequence:
        if call.seq_id in self.seqs:            # a Prefill replaces the sequence
            self.release(call.seq_id)
        seed = call.sampling.seed if call.sampling.seed is not None else random.getrandbits(63)
        generator = None
        if not call.sampling.greedy:
            generator = torch.Generator(device=self.worker.device)
            generator.manual_seed(seed)
        seq = TargetSequence(call.seq_id, call.sampling, call.capture_layers, call.feature_dtype,
                             generator, num_generated=call.num_generated,
                             feature_plane=call.feature_plane, tokens=list(call.token_ids))
        if call.sampling.penalties.active:
            seq.penalties = PenaltyState.start(call.token_ids, call.num_generated,
                                               self.worker.facts.vocab_size, self.worker.device)
        if self.worker.facts.hybrid:
            try:
                seq.state_slot = self.worker.state_pool.allocate(call.seq_id)
            except OutOfStateSlots as e:
                raise ResourceExhausted(str(e)) from None
        self.seqs[call.seq_id] = seq
        return seq

    def _ensure_pages(self, seq: TargetSequence, num_tokens: int) -> None:
        try:
            self.worker.kv_cache.ensure(seq.table, num_tokens)
        except OutOfPages as e:
            raise ResourceExhausted(str(e)) from None

    def _drop_failed_prefill(self, work: Work) -> None:
        """A prefill that failed leaves no half-built sequence behind."""
        seq = work.state.get("seq")
        if work.kind == "prefill" and seq is not None and self.seqs.get(work.seq_id) is seq:
            self.release(work.seq_id)
