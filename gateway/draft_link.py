"""One request's link to the draft: the feed of context it has not received yet, its state, and
the Propose call. Any draft failure only costs speculation, never output.

    state     the draft...                                   next Propose
    OFF       is not configured at all                       never (autoregressive)
    SYNCED    holds the context up to the feed's start       sends the feed
    LOST      has no usable context (NOT_FOUND, a deadline,  after a rebuild: the target is
              a restart, a feed too large to keep)           prefilled again for the features of
                                                             every position, sent from position 0
    PAUSED    has full pools (RESOURCE_EXHAUSTED)            once a backoff passed (the context
                                                             is unchanged: the feed keeps growing)
    DISABLED  failed otherwise, or rebuilds ran out          never again for this request

A draft that is down (UNAVAILABLE, deadline, cancelled) costs the step its drafts; the features
its Verify returns are kept in the feed and sent when it is back. A prompt-lookup draft needs no
features: it gets the token ids again.

Features travel in the messages, or stay in the target's feature plane that the draft attached
(gateway/planes.py): then the feed holds references, and each Verify tells the target which
positions the draft holds (features_consumed) so that it frees them. A draft that cannot read a
reference (DATA_LOSS: stale, or a plane it lost) gets the context again, rebuilt in messages for
the rest of the request. The proposal is checked for its size here (what the
gateway asked for); its tokens and tree shape are checked by the target alone (target_link.py)."""
from __future__ import annotations

import enum
import logging
import random
import time

import grpc

from dflash.v1 import common_pb2, draft_pb2
from gateway import background
from gateway.feed import DraftFeed, answer_chunk
from gateway.state import GatewayState, Speculation
from gateway.target_link import Context, Rebuilds, TargetLink
from gateway.upstream import Upstream, UpstreamError
from runtime.draft_tree import DraftTree

log = logging.getLogger("dflash.gateway.loop")

DRAFT_SKIPS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
               grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
NO_DRAFTS = DraftTree([], [])


class DraftState(enum.Enum):
    OFF = "off"
    SYNCED = "synced"
    LOST = "lost"
    PAUSED = "paused"
    DISABLED = "disabled"


class DraftLink:
    def __init__(self, state: GatewayState, target: TargetLink, rebuilds: Rebuilds) -> None:
        self.gw, self.config, self.target, self.rebuilds = state, state.config, target, rebuilds
        self.seq_id, self.ids, self.route = target.seq_id, target.ids, target.route
        self.state = DraftState.OFF if self.route.draft is None else DraftState.SYNCED
        self.feed = DraftFeed()
        self.appended = 0               # positions the last Propose appended to the draft's context
        # the last Propose's draft forward: (rows, seconds, its wait in the draft's engine)
        self.last_forward = (0, 0.0, 0.0)
        self.feed_limit = self.config.pending_feature_mib * 1024 * 1024
        self.capture_layers: list[int] = []      # what the target captures for it ...
        self.feature_dtype = ""                  # ... and in which dtype
        self.plane_failed = False                # the draft could not read this request's refs
        self.generation = 0                      # the draft's capabilities generation it is for
        self.paused_until = 0.0
        self.pause_s = self.config.backoff_initial_s
        self.touched = False                     # it was sent a Propose (Release it at the end)
        self.absorbed = False                    # it took the prompt without drafting (absorb)

    def _to(self, new: DraftState, why: str = "") -> None:
        """Every change of state passes here."""
        if new != self.state:
            log.debug("draft link %s -> %s %s", self.state.value, new.value, why, extra=self.ids)
        if new == DraftState.PAUSED:
            self.paused_until = time.monotonic() + self.pause_s * random.uniform(0.5, 1)
            self.pause_s = min(self.pause_s * 2, self.config.backoff_max_s)
        elif new == DraftState.SYNCED:
            self.pause_s = self.config.backoff_initial_s
        if new in (DraftState.LOST, DraftState.DISABLED):
            self.feed.reset()
        self.state = new

    @property
    def keeps_context(self) -> bool:
        """Whether the features of committed tokens are worth keeping for it."""
        return self.state not in (DraftState.OFF, DraftState.DISABLED)

    def can_draft(self, spec: Speculation) -> bool:
        """Whether this step may Propose (a usable draft, not paused or given up)."""
        if spec.draft is None or not self.keeps_context:
            return False
        if self.state == DraftState.PAUSED:
            if time.monotonic() < self.paused_until:
                return False
            self._to(DraftState.SYNCED, "pause over")
        return True

    # -- context ---------------------------------------------------------------------------------
    def choose_capture(self, spec: Speculation) -> None:
        """Before the first Prefill: the features to capture for the draft it has now, or for
        the one it knew (briefly down); with none known, a rebuild comes before its Propose."""
        draft = spec.draft or self.gw.known_draft(self.route)
        self.capture_layers = list(draft.target_layer_ids) if draft and draft.needs_features else []
        self.feature_dtype = draft.feature_dtype if draft else ""
        if self.keeps_context:
            self.generation = self.route.draft.generation
            if draft is None:
                self._to(DraftState.LOST, "no draft known at prefill")

    async def open(self, spec: Speculation, prompt: list[int]) -> int:
        """Before a Prefill that gives the draft its context (the request's first, a rebuild's):
        a draft with prefix caching opens the sequence with the context it has cached of
        `prompt`; returns the positions it holds (the feed starts there, and the target
        computes features from there on). 0 when it has none, needs no features, or fails
        (then its first Propose sends everything, as without the cache)."""
        if (not self.keeps_context or spec.draft is None or not spec.draft.prefix_caching
                or not self.capture_layers or len(prompt) <= spec.draft.page_size):
            return 0                    # (a prompt within one page has no cached prefix)
        self.touched = True             # before the call: a request cancelled while it is in
        try:                            # flight still Releases what the draft opened
            resp = await self.route.draft.call(
                "OpenSequence", draft_pb2.OpenSequenceRequest(sequence_id=self.seq_id,
                                                              token_ids=prompt),
                self.config.step_timeout_s)
        except UpstreamError as e:
            log.debug("draft OpenSequence failed (%s); its context starts at 0", e.code.name,
                      extra=self.ids)
            return 0
        self.feed = DraftFeed(resp.cached_tokens)
        return resp.cached_tokens

    def capture(self) -> tuple[list[int], str, str]:
        """What a Prefill captures for the draft: layers, dtype, and the feature plane that the
        draft reads now ("" = in the answer)."""
        choice = self.gw.plane(self.route)
        plane = ("" if self.plane_failed or not self.capture_layers or choice is None
                 else choice.plane_id)
        return self.capture_layers, self.feature_dtype, plane

    def keep(self, chunk: common_pb2.FeatureChunk | None, token_ids: list[int]) -> None:
        """The features of newly committed positions (the prompt's, or a verify's)."""
        if not self.keeps_context:
            return
        self.feed.append(chunk if self.capture_layers else None, token_ids)
        if self.feed.nbytes > self.feed_limit:
            self._to(DraftState.LOST, "feed over --pending-feature-mib")

    def backlog(self, committed_len: int) -> int:
        """Positions the next Propose appends to the draft's context: the feed, or the whole
        context when it must be rebuilt."""
        return committed_len if self.state == DraftState.LOST else len(self.feed.token_ids)

    def consumed(self, committed_len: int) -> int:
        """For a Verify: the positions whose features the target may free - those the draft
        holds, or all when none are kept for it."""
        keeping = self.keeps_context and self.state != DraftState.LOST
        return self.feed.start if keeping else committed_len

    async def absorb(self, spec: Speculation, anchor: int) -> None:
        """Before a step that drafts nothing (auto at a load where drafting does not pay, or a
        request asking for block 1), once per request: the draft takes the prompt's context now
        - a Propose of block 1, no drafts - and caches its pages. With prefix caching the
        target reuses a cached prefix only as far as the draft holds it (it computes the
        features of the rest), so a request that never drafts would leave the draft without
        the prefix, and the next turn behind it would miss on the target as well."""
        if (self.absorbed or not self.can_draft(spec) or self._stale(spec)
                or not spec.draft.prefix_caching or not self.capture_layers
                or len(self.feed.token_ids) < spec.draft.page_size):
            return
        self.absorbed = True
        await self.propose(spec, 1, 0, anchor)

    # -- Propose -----------------------------------------------------------------------------------
    async def propose(self, spec: Speculation, block: int, tree_nodes: int, anchor: int
                      ) -> DraftTree:
        """B - 1 drafts (a chain), or a tree of up to tree_nodes drafts; none when the draft
        cannot give them now."""
        for _ in range(2):               # a lost draft context is rebuilt once per step
            if self._stale(spec) and not await self._rebuild(spec):
                return NO_DRAFTS
            try:
                resp = await self.route.draft.call(
                    "Propose", self._request(block, tree_nodes, anchor), self.config.step_timeout_s)
            except UpstreamError as e:
                if not self._on_error(e):
                    return NO_DRAFTS
                continue
            self.route.draft.note_load(resp)
            self.feed.sent()
            self._to(DraftState.SYNCED)
            # a draft that does not say: this request's own rows, and the round trip is timed
            self.last_forward = ((resp.batch_rows, resp.batch_seconds, resp.queue_seconds)
                                 if resp.batch_rows else (self.appended + block, 0.0, 0.0))
            return self._proposal(resp, block, tree_nodes)
        return NO_DRAFTS

    def _request(self, block: int, tree_nodes: int, anchor: int) -> draft_pb2.ProposeRequest:
        self.touched = True
        self.appended = len(self.feed.token_ids)
        return draft_pb2.ProposeRequest(
            sequence_id=self.seq_id, feature_chunks=self.feed.chunks,
            positions=self.feed.positions, new_token_ids=self.feed.token_ids,
            anchor=anchor, block_size=block, tree_nodes=tree_nodes)

    def _stale(self, spec: Speculation) -> bool:
        return (self.state == DraftState.LOST or spec.generation != self.generation
                or spec.capture_layers != self.capture_layers)

    def _on_error(self, e: UpstreamError) -> bool:
        """True: retry after a rebuild."""
        if e.code == grpc.StatusCode.NOT_FOUND:
            self._to(DraftState.LOST, "NOT_FOUND")
            return True
        if e.code == grpc.StatusCode.DATA_LOSS:
            log.warning("draft cannot read the features: %s; its context is sent again in "
                        "messages", e.details, extra=self.ids)
            self.plane_failed = True
            if (choice := self.gw.plane(self.route)) is not None:
                choice.failed()
            self._to(DraftState.LOST, "DATA_LOSS")
            return True
        if e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self._to(DraftState.LOST, "deadline: it may have taken the features")
        elif e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._to(DraftState.PAUSED, "pools full")
        elif e.code not in DRAFT_SKIPS:
            log.warning("draft failed; this request continues autoregressively: %s", e,
                        extra=self.ids)
            self._to(DraftState.DISABLED, e.code.name)
        return False

    async def _rebuild(self, spec: Speculation) -> bool:
        """Give the draft the whole context again (from what it has cached of it, else from
        position 0)."""
        if not self.rebuilds.take():
            self._to(DraftState.DISABLED, "rebuilds ran out")
            return False
        log.info("rebuilding the draft context", extra={**self.ids, "rebuild": self.rebuilds.done})
        await self.release()
        self.capture_layers = spec.capture_layers
        self.feature_dtype = spec.draft.feature_dtype
        context: Context = self.target.context()
        self.feed.reset()
        held = await self.open(spec, context.token_ids)       # its own cache, after the release
        chunk = None
        if self.capture_layers:
            chunk = answer_chunk(await self.target.prefill(
                context.token_ids, context.num_generated, features_from=held))
        self.feed.append(chunk, context.token_ids[held:])
        self.generation = spec.generation
        self._to(DraftState.SYNCED, "rebuilt")
        return True

    def _proposal(self, resp: draft_pb2.ProposeResponse, block: int, nodes: int) -> DraftTree:
        """The draft's answer, at most the size asked for: a chain is cut to block - 1 drafts; a
        tree with more nodes than asked, or parents that do not match its tokens, is dropped
        (that step verifies no drafts). Token ids and the tree's shape: the target checks."""
        tokens = [int(t) for t in resp.draft_tokens]
        if not resp.draft_parents:
            return DraftTree.chain(tokens[: block - 1])
        if len(tokens) > nodes or len(resp.draft_parents) != len(tokens):
            log.warning("draft sent a tree of %d tokens and %d parents for %d nodes asked; this "
                        "step verifies no drafts", len(tokens), len(resp.draft_parents), nodes,
                        extra=self.ids)
            return NO_DRAFTS
        return DraftTree(tokens, [int(p) for p in resp.draft_parents])

    async def release(self) -> None:
        if self.touched and self.route.draft is not None:
            await self.route.draft.release(self.seq_id, self.config.release_timeout_s)

    # -- replicas -----------------------------------------------------------------------------------
    def move(self, to: Upstream) -> None:
        """The request leaves its draft replica (down, draining, unlike the others or gone from
        the list) for `to`: the context is rebuilt there at the next Propose; the one left is
        asked to release it, in the background."""
        old = self.route.move_draft(to)
        log.info("request moves to draft replica %s (from %s: %s)", to.address,
                 old.address if old else "-", old.status if old else "-", extra=self.ids)
        if self.touched and old is not None:
            background.spawn(old.release(self.seq_id, self.config.release_timeout_s))
        self.touched = False
        if self.keeps_context:
            self._to(DraftState.LOST, "moved to another draft replica")

    def target_moved(self) -> None:
        """The request moved to another target replica: features still waiting in that one's
        plane may be gone with it, so a feed holding references is rebuilt (inline features
        and token ids stay good: replicas serve the same model)."""
        if self.keeps_context and any(c.HasField("ref") for c in self.feed.chunks):
            self._to(DraftState.LOST, "target moved; its plane's references are stale")
