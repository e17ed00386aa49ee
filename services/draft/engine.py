"""The draft engine: each iteration appends the new context of every Propose in it and drafts all
their blocks in one forward (through the drafter). At most one work per sequence runs per
iteration (a second one waits for the next), so Propose and Release of a sequence keep their
order. With draft-ahead, the target's commit notices run as "ahead" works: a sequence's next
block drafted before its Propose comes (see `ahead`). The sequence table, leases and gauges:
SequenceEngine."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from runtime.kv_cache import OutOfPages
from services.common import metrics
from services.common.callers import external
from services.common.engine_loop import Work
from services.common.errors import InvalidArgument, NotFound, ResourceExhausted, ServiceError
from services.common.sequence_engine import SequenceEngine
from services.draft.config import DraftConfig
from services.draft.drafter import Drafter, ProposeItem
from services.draft.sequence import Ahead, DraftSequence


@dataclass(frozen=True)
class ProposeCall:
    """A validated Propose: positions are start..start+num_new-1 (consecutive)."""
    seq_id: str
    start: int
    num_new: int
    features: torch.Tensor | None        # [num_new, K*H] CPU, or None (prompt lookup / no rows)
    token_ids: list[int]
    anchor: int
    block_size: int
    tree_nodes: int = 0                  # > 0: a tree of that many drafts (checked by the caller)
    source: tuple = ()                   # the features' plane refs, (plane, publication, offset,
                                         # rows) each; () = features in the message (or none)


@dataclass(frozen=True)
class ProposeResult:
    draft_tokens: list[int]
    context_len: int
    draft_parents: list[int] = field(default_factory=list)   # a tree's; empty for a chain
    batch_rows: int = 0                 # the forward it ran in: every sequence's rows ...
    batch_seconds: float = 0.0          # ... and its time
    queue_seconds: float = 0.0          # its wait in the engine before that forward


class DraftEngine(SequenceEngine[DraftSequence]):
    def __init__(self, drafter: Drafter, config: DraftConfig) -> None:
        super().__init__(config.token_budget, config.lease_seconds, "draft-engine")
        self.drafter = drafter
        self.config = config

    # -- API used by the servicer (awaitable) ------------------------------------------------
    async def propose(self, call: ProposeCall) -> ProposeResult:
        return await self._submit(Work("propose", call.seq_id, call,
                                       cost=call.num_new + call.block_size))

    def ahead(self, call: ProposeCall) -> None:
        """Draft-ahead (any thread): the target committed call's positions (a commit notice) and
        the gateway's Propose for them is on its way. When the call continues its sequence and
        no Propose waits in the engine's iteration (idle time only), its context is appended
        and the next block drafted now, at the sequence's last Propose's size (block_size and
        tree_nodes of `call` are ignored); the Propose then takes the drafts, or redrafts at its
        own size, or - not continuing it - undoes the context."""
        self.loop.post(Work("ahead", call.seq_id, call, cost=call.num_new, detached=True))

    async def open(self, seq_id: str, token_ids: list[int]) -> int:
        """A new sequence (replacing one of that id) holding the context of the prompt's
        longest cached prefix; returns the positions it holds (prefix caching)."""
        return await self._submit(Work("open", seq_id, token_ids, cost=0))

    # -- engine thread -------------------------------------------------------------------------
    def _step(self, batch: list[tuple[Work, int]]) -> None:
        self._sweep_leases()
        seen: set[str] = set()
        admitted: list[tuple[Work, ProposeItem]] = []
        # draft-ahead uses idle time only: beside a Propose that waits, an ahead block would
        # lengthen its forward (measured on an H100: 0.53-0.82x at 32 requests at once)
        busy = any(work.kind == "propose" for work, _ in batch)
        for work, _ in batch:
            if work.kind == "ahead":        # runs now or never (stale behind other work)
                work.resolve(None)          # finished: leaves the queue (nobody awaits it)
                if busy:
                    metrics.record_ahead("skipped")
                elif work.seq_id not in seen and (item := self._ahead_item(work.payload)):
                    seen.add(work.seq_id)
                    admitted.append((work, item))
                continue
            if work.seq_id in seen:
                continue                    # stays queued: runs next iteration, in order
            seen.add(work.seq_id)
            if work.kind == "release":
                work.resolve(self._release_work(work))
                continue
            if work.kind == "open":
                work.resolve(self._open(work.seq_id, work.payload))
                continue
            try:
                call = self._from_ahead(work.payload)
                if isinstance(call, ProposeResult):
                    work.resolve(call)
                    continue
                admitted.append((work, self._admit(call)))
                work.state["seq"] = admitted[-1][1].seq     # what an abandoned work releases
            except ServiceError as e:
                work.fail(e)
        if admitted:
            self._run(admitted)
        self._publish()

    def _admit(self, call: ProposeCall) -> ProposeItem:
        """Checks that the call continues its sequence (or starts one at position 0), then
        reserves its memory. Raises NotFound / InvalidArgument / ResourceExhausted."""
        seq = self.seqs.get(call.seq_id)
        created = seq is None or (call.num_new > 0 and call.start == 0 and seq.context_len > 0)
        if seq is None and (call.num_new == 0 or call.start != 0):
            raise NotFound(f"unknown sequence {external(call.seq_id)!r}: never proposed, released, or its "
                           f"lease expired; send its whole context again from position 0")
        if created:
            if seq is not None:             # position 0 again: the gateway restarts it
                self._release(call.seq_id)
            seq = self.seqs[call.seq_id] = DraftSequence(call.seq_id)
        elif call.num_new > 0 and call.start != seq.context_len:
            raise InvalidArgument(
                f"positions must continue the sequence's context: expected the first position "
                f"to be {seq.context_len} (or 0 to restart), got {call.start}")
        item = ProposeItem(seq, seq.context_len, call.num_new, call.features, call.token_ids,
                           call.anchor, call.block_size, call.tree_nodes)
        try:
            self._check_context(item)
            self.drafter.reserve(item)
        except OutOfPages as e:
            self._drop_if(created, call.seq_id)
            raise ResourceExhausted(f"draft {e}") from None
        except ServiceError:
            self._drop_if(created, call.seq_id)
            raise
        return item

    # -- draft-ahead ---------------------------------------------------------------------------
    def _ahead_item(self, call: ProposeCall) -> ProposeItem | None:
        """A commit notice's item when it continues a sequence that drafted before (its last
        size is the guess) and holds no ahead block yet; None: nothing to do."""
        seq = self.seqs.get(call.seq_id)
        if seq is None or seq.shape is None or seq.ahead is not None \
                or call.start != seq.context_len or call.num_new == 0:
            return None
        block, nodes = seq.shape
        item = ProposeItem(seq, call.start, call.num_new, call.features, call.token_ids,
                           call.anchor, block, nodes)
        try:
            self._check_context(item)
            self.drafter.reserve(item)
        except (OutOfPages, ServiceError):
            return None                     # the Propose will say so, if it still applies
        return item

    def _from_ahead(self, call: ProposeCall) -> ProposeCall | ProposeResult:
        """A Propose meeting its sequence's ahead block: the block's result when the Propose
        asks for exactly it; the call without its new positions when only the size differs
        (their context is in); else the ahead context is undone and the call runs as sent."""
        seq = self.seqs.get(call.seq_id)
        ahead = seq.ahead if seq is not None else None
        if ahead is None:
            return call
        seq.ahead, notice = None, ahead.notice
        if (call.start, call.num_new, call.source) != (notice.start, notice.num_new, notice.source) \
                or call.token_ids and call.token_ids != notice.token_ids:
            seq.context_len = notice.start        # (a notice's source is never empty)
            del seq.tokens[notice.start:]
            metrics.record_ahead("undone")
            return call
        seq.shape = (call.block_size, call.tree_nodes)
        seq.touch()
        if (call.anchor, call.block_size, call.tree_nodes) == (notice.anchor, ahead.block_size,
                                                               ahead.tree_nodes):
            metrics.record_ahead("used")
            tree = ahead.drafts
            return ProposeResult(tree.tokens, seq.context_len, [] if tree.is_chain else tree.parents,
                                 ahead.rows, ahead.seconds, 0.0)
        metrics.record_ahead("reshaped")
        return replace(call, start=seq.context_len, num_new=0, features=None, token_ids=[])

    def _open(self, seq_id: str, token_ids: list[int]) -> int:
        if seq_id in self.seqs:
            self._release(seq_id)
        seq = self.seqs[seq_id] = DraftSequence(seq_id)
        seq.context_len = self.drafter.attach_prefix(seq, token_ids)
        metrics.record_prefix_lookup(len(token_ids), seq.context_len)
        self._publish()
        return seq.context_len

    def _drop_if(self, created: bool, seq_id: str) -> None:
        if created:
            self._release(seq_id)

    def _check_context(self, item: ProposeItem) -> None:
        limit = self.drafter.facts.max_context
        if item.context_len + item.block_size > limit:
            raise InvalidArgument(
                f"context of {item.context_len} positions plus a block of {item.block_size} "
                f"passes the drafter's max context {limit}; at most "
                f"{max(0, limit - item.context_len)} block positions fit")

    def _run(self, admitted: list[tuple[Work, ProposeItem]]) -> None:
        started = time.monotonic()                # Work.enqueued_at's clock
        t0 = time.perf_counter()
        items = [item for _, item in admitted]
        drafts = self.drafter.propose(items)      # token lists: the device is done
        seconds = time.perf_counter() - t0
        rows = sum(i.num_new + i.block_size for i in items)
        for (work, item), tree in zip(admitted, drafts):
            item.seq.context_len = item.context_len
            if work.kind == "ahead":
                item.seq.ahead = Ahead(work.payload, item.block_size, item.tree_nodes, tree, rows,
                                       seconds)
                continue
            item.seq.shape = (item.block_size, item.tree_nodes)
            item.seq.touch()
            parents = [] if tree.is_chain else tree.parents
            work.resolve(ProposeResult(tree.tokens, item.context_len, parents, rows, seconds,
                                       max(0.0, started - work.enqueued_at)))
        self.stats.record_forward(len(items), rows, seconds)

    # -- SequenceEngine --------------------------------------------------------------------------
    def _free(self, seq: DraftSequence) -> None:
        if seq.ahead is not None:
            metrics.record_ahead("unused")
        self.drafter.release(seq)

    def kv_usage(self) -> float:
        return self.drafter.kv_usage()

    def prefix_cached_pages(self) -> int:
        return self.drafter.prefix_cached_pages()
