"""The target engine: one batched forward per iteration over prefill chunks and verify blocks.

Per iteration (engine thread): the scheduler admits works (scheduler.py), the batch plan lays
them out (batch.py), one forward and the LM head run, acceptance and sampling are decided on the
device for the whole batch and read back in one transfer (runtime/acceptance.py), each sequence
commits what it accepted, and the features of every committed row reach the host in one
transfer (features.py). The sequence table, leases and gauges: SequenceEngine."""
from __future__ import annotations

import time

import torch

from runtime.acceptance import (
    Acceptance,
    BatchDecisions,
    Decided,
    chain_acceptance,
    sampled_tree_acceptance,
    tree_acceptance,
)
from runtime.draft_tree import DraftTree
from runtime.kv_cache import OutOfPages
from runtime.logprobs import LogprobBatch, TokenLogprobs, processed_logprobs
from services.common import metrics
from services.common.callers import external
from services.common.engine_loop import Work
from services.common.errors import Internal
from services.common.feature_plane import PlaneRef, Publication
from services.common.sequence_engine import SequenceEngine
from services.target.batch import BatchPlan, Part, Scheduled
from services.target.calls import PrefillCall, PrefillResult, VerifyCall, VerifyResult
from services.target.features import Destination, FeatureFetch, to_device_index
from services.target.publisher import FeaturePublisher, plane_transports
from services.target.scheduler import TargetScheduler
from services.target.sequence import TargetSequence
from services.target.worker import TargetWorker

__all__ = ["PrefillCall", "PrefillResult", "TargetEngine", "VerifyCall", "VerifyResult"]


class TargetEngine(SequenceEngine[TargetSequence]):
    def __init__(self, worker: TargetWorker) -> None:
        super().__init__(worker.config.token_budget, worker.config.lease_seconds, "target-engine")
        self.worker = worker
        self.scheduler = TargetScheduler(worker, self.seqs, self._release, self._release_work,
                                         self._answer, self._refuse)
        self.forced = worker.hooks.forced_acceptance     # benchmarks only (TargetHooks)
        self.loop.prompts_apart = worker.prompts_apart     # where graphs would be lost to mixing
        self.loop.prompt_sequences = worker.config.prompt_batch
        cfg = worker.config
        self.publisher = FeaturePublisher(plane_transports(cfg.feature_plane, worker.device),
                                          cfg.feature_plane_mib << 20, worker.device)

    def stop(self) -> None:
        """The engine thread stops, then the tensor-parallel followers (none: nothing more)."""
        super().stop()
        if self.worker.ranks is not None:
            self.worker.ranks.stop()

    # -- API used by the servicer (awaitable) ------------------------------------------------
    async def prefill(self, call: PrefillCall) -> PrefillResult:
        return await self._submit(Work("prefill", call.seq_id, call, cost=len(call.token_ids),
                                       splittable=True))

    async def verify(self, seq_id: str, tokens: list[int], tree: DraftTree | None = None,
                     features_consumed: int = 0, token_masks: tuple[bytes, ...] = ()
                     ) -> VerifyResult:
        """tokens [anchor, d1..dn]; tree: their parents, checked by the caller
        (runtime.draft_tree.tree_problem); None or a chain's parents: a chain.
        features_consumed: the draft holds the features of positions below it.
        token_masks: the allowed tokens after each block row (checked by the caller)."""
        call = VerifyCall(tokens, tree if tree is not None and not tree.is_chain else None,
                          features_consumed, token_masks)
        return await self._submit(Work("verify", seq_id, call, cost=len(tokens)))

    # -- engine thread -------------------------------------------------------------------------
    def _step(self, batch: list[tuple[Work, int]]) -> None:
        self._sweep_leases()
        items = self.scheduler.admit(batch)
        if items:
            self._run(BatchPlan.build(items, self._padding(items)))
        self._publish()

    def _padding(self, items: list[Scheduled]) -> int:
        """The block every item of a chain-verify batch is padded to, so that the batch runs as
        one captured graph instead of eagerly (0: as it is). A request's last steps verify short
        blocks (its remaining tokens), and one short block used to send its whole batch down
        the eager path. A lone prompt chunk likewise (eagerly on an H200, SmolLM2's 24-token
        prefill behind a cached prefix took 30 ms and its 1 941-token prompt 90 ms in four
        chunks: launches, not compute); not a hybrid model's, whose recurrent state would run
        the padding."""
        if len(items) == 1 and not items[0].is_verify:
            item = items[0]
            pad = 0 if self.worker.facts.hybrid else self.worker.prefill_block(
                item.n, BatchPlan.capture_of(items))
            return pad if pad > item.n and self._room_for(items, pad) else 0
        if not all(i.is_verify and i.verify.tree is None for i in items):
            return 0
        longest = max(i.n for i in items)
        pad = self.worker.padded_block(len(items), longest, BatchPlan.capture_of(items))
        if pad <= longest and all(i.n == longest for i in items):
            return 0                                   # runs as one graph already (or none fits)
        return pad if self._room_for(items, pad) else 0

    def _room_for(self, items: list[Scheduled], pad: int) -> bool:
        """Whether every item can run `pad` rows from its start: room in the context, and the
        padded positions' pages (taken from the free pool; a verify's trimmed with its rejected
        drafts', a prompt's once its last chunk ran)."""
        kv, max_ctx = self.worker.kv_cache, self.worker.facts.max_context
        if any(i.start + pad > max_ctx for i in items):
            return False
        try:
            for i in items:
                kv.ensure(i.seq.table, i.start + pad)
        except OutOfPages:
            return False               # the pages taken stay until that trim
        return True

    @torch.inference_mode()           # acceptance edits the (inference-mode) logits in place
    def _run(self, plan: BatchPlan) -> None:
        t0, started = time.perf_counter(), time.monotonic()
        items = [p.item for p in plan.parts]
        out = self.worker.forward(
            plan.slices, torch.tensor(plan.ids), torch.tensor(plan.positions), plan.capture,
            [i.seq.state_slot for i in items], verify=[i.is_verify for i in items])
        logits = self.worker.logits(_rows(out.hidden, plan.logit_rows)) if plan.logit_rows else None
        raw: dict[int, torch.Tensor] = {}
        if logits is not None:
            raw = _raw_rows(plan, logits)
            plan.apply_penalties(logits)
            plan.apply_token_masks(logits)
            plan.suppress_stop_tokens(logits, list(self.worker.facts.eos_token_ids))
            self._poison(plan, logits)
        decided = self._decide(plan, logits)
        forward_s = time.perf_counter() - t0      # the read-back synchronised the device
        parts = [p for p, d in zip(plan.parts, decided) if not self._failed(p.item, d)]
        decided = [d for d in decided if not d.failed]
        accepted = [self._accept(p.item, d) if p.item.is_verify else None
                    for p, d in zip(parts, decided)]
        logprobs = _logprobs(parts, decided, accepted, logits, raw)
        features = self._features(parts, plan.capture, out.captured, accepted)
        for part, d, acc, f, lp in zip(parts, decided, accepted, features, logprobs):
            if acc is None:
                self._prefill_chunk_done(part.item, f, d.token, lp[0] if lp else None)
            else:
                if isinstance(f, Publication):
                    self._notify(part.item, acc, f)
                self._answer(part.item.work, VerifyResult(
                    acc.accepted, acc.tokens, _ref(f), part.item.seq.seq_len, lp,
                    len(plan.ids), forward_s, max(0.0, started - part.item.work.enqueued_at)))
        self._commit_mamba_states(parts, accepted)
        self._checkpoint_states(parts, accepted)
        self.stats.record_forward(len(items), len(plan.ids), time.perf_counter() - t0)

    def _decide(self, plan: BatchPlan, logits: torch.Tensor | None) -> list[Decided]:
        """Per part, what the device decided (one read-back for the whole batch)."""
        decisions = BatchDecisions(logits)
        for part in plan.parts:
            item, seq = part.item, part.item.seq
            if item.is_verify and item.verify.tree is not None:
                decisions.tree(part.logit_row, item.verify.tree, seq.sampling, seq.generator)
            elif item.is_verify:
                decisions.chain(part.logit_row, item.verify.drafts, seq.sampling, seq.generator)
            elif item.finishes:
                decisions.next_token(part.logit_row, seq.sampling, seq.generator)
            else:
                decisions.nothing()
        return decisions.read()

    def _failed(self, item: Scheduled, decided: Decided) -> bool:
        """A work whose rows could not be decided fails alone (INTERNAL, saying why): a verify
        commits nothing (its block's pages go back), a prefill leaves no sequence."""
        if not decided.failed:
            return False
        seq = item.seq
        if item.is_verify:
            self.worker.kv_cache.trim(seq.table, seq.seq_len)
        else:
            self._release(seq.seq_id)
        self._refuse(item.work, Internal(
            f"{'Verify' if item.is_verify else 'Prefill'} of sequence {external(seq.seq_id)!r} failed: "
            f"{decided.failed}; the other sequences of its batch were not affected"))
        return True

    def _poison(self, plan: BatchPlan, logits: torch.Tensor) -> None:
        """Tests only (TargetHooks.nan_logits_for): NaN logits for some sequences."""
        prefix = self.worker.hooks.nan_logits_for
        for part in plan.parts if prefix else ():
            if external(part.item.seq.seq_id).startswith(prefix) and part.item.logit_rows:
                logits[part.logit_row: part.logit_row + part.item.logit_rows] = float("nan")

    def _accept(self, item: Scheduled, decided: Decided) -> Acceptance:
        """Commits a verified block: the anchor and the accepted drafts now have KV (a tree's
        accepted nodes moved into place), rejected positions' pages go back."""
        call, seq = item.verify, item.seq
        if call.tree is not None and not seq.sampling.greedy:
            acc = sampled_tree_acceptance(call.tree, decided.path, decided.token)
            self._compact_path(seq, acc.rows[1:])
        elif call.tree is not None:
            acc = tree_acceptance(call.tree, decided.argmax)
            self._compact_path(seq, acc.rows[1:])
        elif self.forced is not None:                   # benchmarks: forced acceptance
            a = self.forced.accepted(len(call.drafts))
            acc = chain_acceptance(call.drafts, a, decided.argmax[a])
        else:
            acc = chain_acceptance(call.drafts, decided.accepted, decided.token)
        committed = [call.tokens[r] for r in acc.rows]  # the anchor and the accepted drafts
        seq.commit(committed)
        if seq.penalties is not None:
            seq.penalties.add(committed)
        self.publisher.consumed(seq, call.features_consumed)
        kv = self.worker.kv_cache
        kv.trim(seq.table, seq.seq_len)
        kv.cache_full_pages(seq.table, seq.tokens, seq.seq_len)
        self.stats.record_verify(len(call.drafts), acc.accepted)
        return acc

    def _notify(self, item: Scheduled, acc: Acceptance, pub: Publication) -> None:
        """Draft-ahead: the plane's commit subscribers hear what this Verify committed (the
        anchor and the accepted drafts at positions start.., and the next anchor)."""
        seq = item.seq
        tokens = [item.verify.tokens[0]] + list(acc.tokens[:-1])
        self.publisher.committed(seq, seq.seq_len - len(tokens), tokens, acc.tokens[-1], pub)

    def _compact_path(self, seq: TargetSequence, path: list[int]) -> None:
        """A tree's accepted nodes 1..a wrote their K/V at block rows `path`; the committed
        positions seq_len+1..seq_len+a need them in order (a no-op when the path is 1..a)."""
        moved = [(row, j) for j, row in enumerate(path, start=1) if row != j]
        if moved:
            start = seq.seq_len
            self.worker.copy_positions(seq.table, [start + r for r, _ in moved],
                                       [start + j for _, j in moved])

    def _features(self, parts: list[Part], capture: tuple[int, ...], captured: torch.Tensor | None,
                  accepted: list[Acceptance | None]) -> list[torch.Tensor | Publication | None]:
        """Every part's committed rows of the tapped layers: on the host (one transfer), or
        written to the sequence's plane (then synchronized: the draft reads them next)."""
        fetch = FeatureFetch(captured, capture, self.publisher)
        for part, acc in zip(parts, accepted):
            item = part.item
            # a prompt chunk: its rows at or past features_from (the draft holds those before)
            rows = acc.rows if acc is not None else range(
                min(item.n, max(0, item.prefill.features_from - item.start)), item.n)
            fetch.add(item.seq, part.row, rows, self._destination(item, len(rows)))
        features = fetch.fetch()
        self.publisher.sync(self.worker.device)
        return features

    def _destination(self, item: Scheduled, rows: int) -> Destination:
        """Where a part's committed rows go when its sequence publishes them (None: the answer):
        a Verify's rows as a publication of their own; a prompt's chunks into one publication of
        the whole prompt, reserved at its first chunk."""
        seq = item.seq
        if not seq.feature_plane or not seq.capture_layers:
            return None
        width = len(seq.capture_layers) * self.worker.facts.hidden_size
        if item.is_verify:
            pub = self.publisher.reserve(seq, rows, width, seq.seq_len)
            return (pub, 0) if pub is not None else None
        call = item.prefill
        if "publication" not in item.work.state:
            total = len(call.token_ids)
            item.work.state["publication"] = self.publisher.reserve(
                seq, total - call.features_from, width, total) if total > call.features_from \
                else None
        pub = item.work.state["publication"]
        return (pub, max(0, item.start - call.features_from)) if pub is not None else None

    def _prefill_chunk_done(self, item: Scheduled, features: torch.Tensor | Publication | None,
                            token: int | None, logprobs: TokenLogprobs | None) -> None:
        work, seq, finished = item.work, item.seq, item.finishes
        if isinstance(features, torch.Tensor):
            work.state["features"].append(features)
        work.done_tokens += item.n
        seq.seq_len = work.done_tokens
        seq.touch()
        self.worker.kv_cache.trim(seq.table, len(item.prefill.token_ids))  # a padded chunk's extra
        self.worker.kv_cache.cache_full_pages(seq.table, seq.tokens, seq.seq_len)
        if not finished:
            return
        seq.prefilling = False
        seq.num_generated += 1
        chunks, pub = work.state.pop("features"), work.state.get("publication")
        features = pub.ref if pub is not None else torch.cat(chunks) if chunks else None
        self._answer(work, PrefillResult(token, features, seq.seq_len, logprobs,
                                         work.state.get("cached", 0)))

    def _commit_mamba_states(self, parts: list[Part], accepted: list[Acceptance | None]) -> None:
        """Hybrid models: each verified sequence keeps the recurrent state of its last
        committed block row (docs/architecture.md §6)."""
        commits = [(p.item.seq.state_slot, last_row(acc))
                   for p, acc in zip(parts, accepted) if acc is not None]
        if commits and self.worker.facts.hybrid:
            self.worker.commit_mamba_state(commits)

    def _checkpoint_states(self, parts: list[Part], accepted: list[Acceptance | None]) -> None:
        """Hybrid prefix caching: the recurrent state at every page boundary a part's committed
        rows reached (runtime/state_checkpoints.py) - a prompt chunk's end (the live state), a
        verify's boundaries (the live state at its last committed row, the verify slot's states
        before it). After the commit: the live state is at the committed length."""
        checkpoints = self.worker.state_checkpoints
        if checkpoints is None:
            return
        page = self.worker.kv_cache.page_size
        for part, acc in zip(parts, accepted):
            seq = part.item.seq
            end = seq.seq_len
            # a prompt chunk's states inside it are gone: only its end counts
            start = end - (acc.accepted + 1) if acc is not None else end - 1
            for boundary in range(start // page * page + page, end + 1, page):
                key = seq.table.keys[boundary // page - 1]
                if boundary == end:
                    checkpoints.save_live(key, seq.state_slot)
                else:
                    checkpoints.save_verified(key, self.worker.state_pool.verify_slot(
                        seq.state_slot), committed_row(acc, boundary - 1 - start))

    # -- SequenceEngine --------------------------------------------------------------------------
    def _free(self, seq: TargetSequence) -> None:
        self.publisher.drop(seq)
        self.worker.kv_cache.release(seq.table)
        if seq.state_slot is not None:
            self.worker.state_pool.free(seq.state_slot)

    def kv_usage(self) -> float:
        return self.worker.kv_cache.usage()

    def prefix_cached_pages(self) -> int:
        return self.worker.kv_cache.cached_pages

    def _publish_more(self) -> None:
        """Also the stream planes' events: before every answer (a ref's rows are on their way
        before the ref is) and after every step."""
        self.publisher.flush()
        lb = metrics.labels()
        metrics.FEATURE_PLANE_USAGE.labels(lb.model_name, lb.service).set(self.publisher.usage())
        if (pool := self.worker.state_pool) is not None:
            metrics.STATE_USAGE.labels(lb.model_name, lb.service).set(pool.usage())


def _raw_rows(plan: BatchPlan, logits: torch.Tensor) -> dict[int, torch.Tensor]:
    """The logits rows of the parts that asked for raw logprobs, copied before masks and
    suppression change them: part's first logits row -> [its rows, V]."""
    out = {}
    for part in plan.parts:
        cfg, n = part.item.seq.sampling, part.item.logit_rows
        if cfg.logprobs and not cfg.processed_logprobs and n:
            out[part.logit_row] = logits[part.logit_row: part.logit_row + n].clone()
    return out


def _logprobs(parts: list[Part], decided: list[Decided], accepted: list[Acceptance | None],
              logits: torch.Tensor | None, raw: dict[int, torch.Tensor]
              ) -> list[list[TokenLogprobs] | None]:
    """Per part, the logprobs of the tokens it commits (None: not asked, or nothing committed):
    a verify's committed rows (acc.rows), a finished prefill's last row; one read-back."""
    batch, asked = LogprobBatch(), []
    for part, d, acc in zip(parts, decided, accepted):
        cfg, item = part.item.seq.sampling, part.item
        if logits is None or not cfg.logprobs or (acc is None and not item.finishes):
            asked.append(False)
            continue
        rows, tokens = (list(acc.rows), acc.tokens) if acc is not None else ([0], [d.token])
        source = raw.get(part.logit_row)
        if source is None:
            source = logits[part.logit_row: part.logit_row + item.logit_rows]
        picked = source.index_select(0, to_device_index(torch.tensor(rows), source.device))
        batch.add(torch.log_softmax(picked.float(), -1) if part.logit_row in raw
                  else processed_logprobs(picked, cfg), tokens, cfg.top_logprobs)
        asked.append(True)
    read = iter(batch.read())
    return [next(read) if a else None for a in asked]


def _ref(features: torch.Tensor | Publication | None) -> torch.Tensor | PlaneRef | None:
    return features.ref if isinstance(features, Publication) else features


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] without an index transfer when the rows are all of t (a verify-only batch)."""
    if len(rows) == t.shape[0] and rows[0] == 0 and rows[-1] == len(rows) - 1:
        return t
    return t.index_select(0, to_device_index(torch.tensor(rows), t.device))


def last_row(acc: Acceptance) -> int:
    """The block row of a verify's last committed position (a chain: its accepted count; a
    tree: the accepted path's last node)."""
    return committed_row(acc, acc.accepted)


def committed_row(acc: Acceptance, k: int) -> int:
    """The block row of a verify's k-th committed position (0: the anchor)."""
    return acc.rows[k] if acc.rows else k
