"""One request's link to the target: Prefill and Verify with recovery.

- The target lost the sequence (NOT_FOUND), or went away (UNAVAILABLE: killed, restarting,
  draining) and came back within --upstream-wait: the sequence is prefilled again on prompt +
  committed tokens; nothing sent is lost or repeated. Not back in time: UNAVAILABLE (HTTP 503)
  saying so.
- Its pools are full (RESOURCE_EXHAUSTED): a Prefill is retried with backoff; a Verify gives its
  sequence's pages back (Release) and is prefilled again after a backoff (preemption by
  recompute: no sequence holds pages while it waits for more, so they cannot deadlock), all
  within --pool-wait, then UNAVAILABLE saying so.
- The draft's proposal refused (INVALID_ARGUMENT for a Verify that carried drafts; the target is
  the one place a proposal is validated): ProposalRefused, and the loop verifies the anchor
  alone instead - a draft's fault costs only that step's speculation."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from dflash.v1 import target_pb2
from gateway import background
from gateway.backoff import Backoff
from gateway.config import GatewayConfig
from gateway.request import GenerationRequest
from gateway.route import Route
from gateway.state import GatewayState
from gateway.upstream import Upstream, UpstreamError

log = logging.getLogger("dflash.gateway.loop")

MAX_REBUILDS = 4                    # per request; past it the request stays autoregressive
TARGET_REBUILDS = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE}
WAITABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


class ProposalRefused(UpstreamError):
    """The target refused a Verify's drafts as invalid (nothing was appended)."""


@dataclass
class Rebuilds:
    """Rebuilds of lost soft state one request may make, target and draft together."""
    done: int = 0

    def take(self) -> bool:
        """One more rebuild, if the budget allows (then it counts)."""
        if self.done >= MAX_REBUILDS:
            return False
        self.done += 1
        return True


class Recovery:
    """What one call may still spend waiting out failures: a target that is down
    (--upstream-wait) and full pools (--pool-wait, with backoff)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.upstream_wait_s = config.upstream_wait_s
        self.upstream_deadline = time.monotonic() + config.upstream_wait_s
        self.pool = Backoff(config.backoff_initial_s, config.backoff_max_s, config.pool_wait_s)
        self.pool_wait_s = config.pool_wait_s

    @property
    def upstream_left_s(self) -> float:
        return max(0.0, self.upstream_deadline - time.monotonic())

    def gave_up(self, e: UpstreamError) -> UpstreamError:
        """e, its message saying how long was waited."""
        why = (f"the target did not come back within {self.upstream_wait_s:g} s (--upstream-wait)"
               if e.code == grpc.StatusCode.UNAVAILABLE else
               f"its pools stayed full for {self.pool_wait_s:g} s (--pool-wait)")
        return UpstreamError(e.upstream, e.method, e.code, f"{e.details}; {why}")


@dataclass(frozen=True)
class Context:
    """What a rebuild prefills: the positions that have KV (prompt + committed output without
    the anchor), and how many of them are output."""
    token_ids: list[int]
    num_generated: int


class TargetLink:
    def __init__(self, state: GatewayState, seq_id: str, req: GenerationRequest,
                 rebuilds: Rebuilds, route: Route, context: Callable[[], Context],
                 capture: Callable[[], tuple[list[int], str, str]],
                 moved: Callable[[], None]) -> None:
        """route: the request's replicas (the target one is used here); context(): the
        request's committed context now; capture(): the feature layers, dtype and plane the
        draft wants from a Prefill (no layers when it needs no features); moved(): called when
        the request moved to another target replica."""
        self.state, self.config = state, state.config
        self.seq_id, self.req, self.route = seq_id, req, route
        self.rebuilds, self.context, self.capture, self.moved = rebuilds, context, capture, moved
        self.ids = {"request_id": req.request_id, "seq": seq_id}    # log fields
        self.prefills = 0                # Prefills so far: the seed offset of the next
        self.preemptions = 0             # the sequence given back because the pools were full

    async def prefill(self, ids: list[int], num_generated: int,
                      recovery: Recovery | None = None, token_mask: bytes = b"",
                      features_from: int = 0) -> target_pb2.PrefillResponse:
        """A Prefill replaces the sequence, so after a failure that a wait can cure (the target
        down or restarting, its pools full) it is simply sent again. token_mask: structured
        output's allowed first tokens (only the request's first Prefill: a rebuild's next token
        is not used). features_from: the draft holds the positions below it (features of the
        rest only; the target's prefix cache is used below it)."""
        recovery = recovery or Recovery(self.config)
        while True:
            layers, dtype, plane = self.capture()
            req = target_pb2.PrefillRequest(
                sequence_id=self.seq_id, token_ids=ids,
                sampling=self.req.sampling_pb(self.prefills), capture_layers=layers,
                feature_dtype=dtype, num_generated=num_generated, feature_plane=plane,
                token_mask=token_mask, features_from=features_from)
            try:
                target = self.route.target
                resp = await target.call("Prefill", req, self.config.prefill_timeout_s)
            except UpstreamError as e:
                if not await self._wait_out(e, recovery):
                    raise recovery.gave_up(e) if e.code in WAITABLE else e
                continue
            self.prefills += 1
            target.note_load(resp)
            return resp

    async def verify(self, tokens: list[int], parents: list[int], features_consumed: int = 0,
                     token_masks: list[bytes] | None = None) -> target_pb2.VerifyResponse:
        """A Verify is not idempotent (it appends the block), so after a failure that may have
        lost the sequence or the answer, the sequence is rebuilt with a Prefill (which replaces
        it) before Verify is sent again - never the same Verify twice. features_consumed: the
        draft holds the features of the positions below it (the target frees them).
        token_masks: structured output, one per token (gateway/grammar.py)."""
        req = target_pb2.VerifyRequest(sequence_id=self.seq_id, token_ids=tokens, parents=parents,
                                       features_consumed=features_consumed,
                                       token_masks=token_masks or [])
        recovery = Recovery(self.config)
        while True:
            try:
                resp = await self.route.target.call("Verify", req, self.config.step_timeout_s)
                self.route.target.note_load(resp)
                return resp
            except UpstreamError as e:
                if e.code == grpc.StatusCode.INVALID_ARGUMENT and len(tokens) > 1:
                    raise ProposalRefused(e.upstream, e.method, e.code, e.details) from None
                await self._recover(e, recovery)

    async def release(self) -> None:
        await self.route.target.release(self.seq_id, self.config.release_timeout_s)

    def move(self, to: Upstream) -> None:
        """The request leaves its target replica (down, draining, unlike the others or gone from
        the list) for `to`, where the caller's next Prefill builds the sequence. The one left
        is asked to release it, in the background (a dead one's lease frees it)."""
        old = self.route.move_target(to)
        log.info("request moves to target replica %s (from %s: %s)", to.address, old.address,
                 old.status, extra=self.ids)
        background.spawn(old.release(self.seq_id, self.config.release_timeout_s))
        self.moved()

    async def rebuild(self, recovery: Recovery | None = None) -> None:
        """Prefills the committed context again (after a loss or a move); the draft holds (or
        is fed) every committed position's features already: none are needed, so the target
        may take all it has cached of the sequence's own pages."""
        if self.route.target.capabilities is not None and not self.state.admits(self.route):
            raise UpstreamError("target", "Prefill", grpc.StatusCode.UNAVAILABLE,
                                f"the target replica at {self.route.target.address} serves "
                                f"another model now ({self.route.target.capabilities.model_id!r}"
                                f"), and no replica of the one this request began on is "
                                f"usable: its output cannot go on with other weights")
        context = self.context()
        await self.prefill(context.token_ids, context.num_generated, recovery,
                           features_from=len(context.token_ids))

    async def _recover(self, e: UpstreamError, recovery: Recovery) -> None:
        """After a failed Verify: waits out what can be waited out and prefills the committed
        tokens again; raises when it cannot (or may not) recover."""
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            await self.release()
            self.preemptions += 1
            log.info("target pools full: sequence released, to be prefilled again after a "
                     "backoff", extra={**self.ids, "preemptions": self.preemptions})
        elif e.code not in TARGET_REBUILDS or not self.rebuilds.take():
            raise e
        if not await self._wait_out(e, recovery):
            raise recovery.gave_up(e)
        if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            log.info("target lost the sequence (%s); prefilling it again", e.code.name,
                     extra=self.ids)
        await self.rebuild(recovery)

    async def _wait_out(self, e: UpstreamError, recovery: Recovery) -> bool:
        """True when the call may be sent again: the target is back (UNAVAILABLE), a backoff
        passed (RESOURCE_EXHAUSTED), or at once (NOT_FOUND: it lost the sequence)."""
        if e.code == grpc.StatusCode.UNAVAILABLE:
            return await self._target_back(recovery)
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return await recovery.pool.wait()
        return e.code == grpc.StatusCode.NOT_FOUND and e.method == "Verify"

    async def _target_back(self, recovery: Recovery) -> bool:
        """Waits (bounded) for a usable target replica: its own back (a restart), or another
        one, where the request moves."""
        while True:
            if self.route.target.usable and self.state.admits(self.route):
                return True
            if (other := self.state.target_for(self.route)) is not None:
                self.move(other)
                return True
            if recovery.upstream_left_s <= 0:
                return False
            await self.state.wait_changed(recovery.upstream_left_s)
