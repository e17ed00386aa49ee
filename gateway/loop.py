"""The per-request speculative loop (DESIGN §3).

    prefill: t0 = target.Prefill(seq, prompt, sampling, capture_layers)   features of the prompt
    step:    d  = draft.Propose(seq, features not sent yet, anchor, B)      B-1 draft tokens
             v  = target.Verify(seq, [anchor] + d)                           a, [d1..da, bonus]
             (greedy requests with --spec-tree-nodes N: d is a tree of N drafts with parents,
              and Verify commits the longest path of the target's own greedy choices in it)
    end:     Release on both services (finished, failed or cancelled)

The gateway owns the request (prompt, committed output); the services hold soft state.
- Draft down (UNAVAILABLE, deadline) or absent: Verify of the anchor alone (autoregressive);
  the features it returns are kept in the feed and sent when the draft is back.
- Draft lost the sequence (NOT_FOUND, restart, changed capabilities): its context is rebuilt
  by prefilling the target again on prompt + committed tokens, which returns the features of
  every position (the gateway keeps no feature history: at K*H*2 bytes per token that is
  40 KB/token for an 8B target), then Propose starts again from position 0. A prompt-lookup
  draft needs no features: it gets the token ids again.
- Target lost the sequence (NOT_FOUND), or went away (UNAVAILABLE: killed, restarting,
  draining) and came back within --upstream-wait: prefilled again the same way; nothing sent is
  lost or repeated. Not back in time: UNAVAILABLE (HTTP 503) saying so.
- A service's pools are full (RESOURCE_EXHAUSTED): a Prefill is retried with backoff; a Verify
  gives its sequence's pages back (Release) and is prefilled again after a backoff (preemption
  by recompute: no sequence holds pages while it waits for more, so they cannot deadlock), all
  within --pool-wait, then UNAVAILABLE saying so; a Propose pauses speculation for a backoff.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from dflash.v1 import common_pb2, draft_pb2, target_pb2
from gateway.admission import Admission
from gateway.backoff import Backoff
from gateway.config import GatewayConfig
from gateway.feed import DraftFeed
from gateway.output import OutputProcessor
from gateway.request import GenerationRequest
from gateway.state import GatewayState, Speculation
from gateway.telemetry import RequestTelemetry
from gateway.upstream import Upstream, UpstreamError
from runtime.draft_tree import DraftTree, tree_problem

log = logging.getLogger("dflash.gateway.loop")

MAX_REBUILDS = 4                    # per request; past it the request stays autoregressive
DRAFT_SKIPS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
               grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}
TARGET_REBUILDS = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE}
WAITABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
_background: set[asyncio.Task] = set()


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


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    verify_steps: int = 0
    draft_steps: int = 0             # verify steps that carried at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafting steps (vLLM's definition; 1.0 when nothing was drafted)."""
        return 1.0 + self.accepted_tokens / self.draft_steps if self.draft_steps else 1.0


@dataclass(frozen=True)
class Event:
    token_ids: list[int]
    text: str
    accepted: int                    # drafts accepted in this step
    finish_reason: str | None = None
    usage: Usage | None = None       # on the last event


class Generation:
    """One request. Iterate `events()` inside `contextlib.aclosing` so that cancellation runs
    the release."""

    def __init__(self, state: GatewayState, req: GenerationRequest, arrival: float,
                 admission: Admission) -> None:
        caps = state.target_caps
        self.state, self.req = state, req
        self.admission = admission       # its running count decides whether to draft (load rule)
        self.seq_id = f"gw-{uuid.uuid4().hex[:24]}"
        self.out = OutputProcessor(req, list(caps.eos_token_ids), state.tokenizer)
        self.usage = Usage(prompt_tokens=len(req.prompt_ids))
        self.telemetry = RequestTelemetry(state.metrics_model, arrival)
        self.feed = DraftFeed()
        self.feed_limit = state.config.pending_feature_mib * 1024 * 1024
        self.capture_layers: list[int] = []
        self.feature_dtype = ""
        self.target_len = 0              # positions with target KV (the anchor is not among them)
        self.anchor = 0
        self.rebuilds = 0
        self.prefills = 0                # target Prefills so far: the seed offset of the next
        self.preemptions = 0             # sequences given back because the target's pools were full
        self.draft_paused_until = 0.0    # the draft's pools were full: no Propose before this
        self.draft_pause_s = state.config.backoff_initial_s
        self.draft_generation = 0        # the draft's capabilities generation this feed is for
        self.draft_lost = False          # the draft has no usable context: rebuild before Propose
        self.draft_disabled = state.draft is None
        self.draft_touched = False

    # -- the loop ------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        reason = "error"
        log.debug("request started", extra=self._ids(prompt_tokens=len(self.req.prompt_ids),
                                                      max_tokens=self.req.max_tokens))
        try:
            yield await self._prefill()
            while self.out.finish_reason is None:
                yield await self._step()
            reason = self.out.finish_reason
        except (asyncio.CancelledError, GeneratorExit):
            reason = self.out.finish_reason or "abort"
            raise
        except Exception as e:
            log.warning("request failed: %s", e, extra=self._ids())
            raise
        finally:
            self.telemetry.finished(reason, self.usage.prompt_tokens, self.usage.completion_tokens)
            self._log_finished(reason)
            await _shielded(self._release())

    def _ids(self, **fields) -> dict:
        """Log fields naming this request: its request id and the sequence id of its upstreams."""
        return {"request_id": self.req.request_id, "seq": self.seq_id, **fields}

    def _log_finished(self, reason: str) -> None:
        u = self.usage
        log.info("request finished", extra=self._ids(
            finish_reason=reason, prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens, verify_steps=u.verify_steps,
            draft_steps=u.draft_steps, accepted_tokens=u.accepted_tokens,
            acceptance_length=round(u.mean_acceptance_length, 4), rebuilds=self.rebuilds,
            preemptions=self.preemptions,
            seconds=round(time.perf_counter() - self.telemetry.arrival, 3)))

    async def _prefill(self) -> Event:
        spec = self.state.speculation()
        draft = spec.draft or self.state.known_draft()
        self.capture_layers = list(draft.target_layer_ids) if draft and draft.needs_features else []
        self.feature_dtype = draft.feature_dtype if draft else ""
        resp = await self._prefill_target(list(self.req.prompt_ids), 0)
        self.telemetry.prefill_done(len(resp.features.data) if self.capture_layers else None)
        if not self.draft_disabled:
            self.feed.append(resp.features if self.capture_layers else None,
                             range(len(self.req.prompt_ids)), self.req.prompt_ids)
            self.draft_generation = self.state.draft.generation
            self.draft_lost = draft is None
        self.anchor = resp.next_token
        self.target_len = resp.seq_len
        return self._deliver([resp.next_token], accepted=0)

    async def _step(self) -> Event:
        spec = self.state.speculation()
        block = self._block_size(spec)
        drafts = DraftTree([], [])
        t0 = time.perf_counter()
        if block > 1:
            drafts = await self._propose(spec, block, self._tree_nodes(spec))
        t1 = time.perf_counter()
        resp = await self._verify([self.anchor] + drafts.tokens,
                                  [] if drafts.is_chain else drafts.parents)
        t2 = time.perf_counter()
        a = resp.accepted
        committed = list(resp.committed_tokens)
        if not self.draft_disabled:
            self._keep_features(resp.features, [self.anchor] + committed[:-1])
        self.target_len = resp.seq_len
        n = len(drafts.tokens)
        self._count_step(n, a)
        event = self._deliver(committed, accepted=a)
        self.telemetry.step(t1 - t0 if block > 1 else None, t2 - t1, n, a)
        return event

    def _block_size(self, spec: Speculation) -> int:
        """B = min(requested or default, max block, tokens still allowed, room in the context);
        1 (no drafting; the feed keeps the features) without a draft, or above
        --spec-disable-batch-size running requests, where batched one-token verifies are worth
        more than drafts on hardware that is compute-bound at large batches."""
        if spec.draft is None or self.draft_disabled or time.monotonic() < self.draft_paused_until:
            return 1
        limit = self.state.config.spec_disable_batch_size
        if limit and self.admission.running > limit:
            return 1
        room = self.state.target_caps.max_context - self.target_len
        wanted = self.req.block_size or spec.block_size
        return max(1, min(wanted, spec.max_block_size, self.out.remaining, room))

    def _tree_nodes(self, spec: Speculation) -> int:
        """Drafts per tree for this step: greedy requests only (a tree's exactness is the
        target's greedy path), within the context's room; 0 = a chain."""
        if not spec.tree_nodes or self.req.temperature > 0:
            return 0
        room = self.state.target_caps.max_context - self.target_len - 1
        return max(0, min(spec.tree_nodes, room))

    # -- draft ---------------------------------------------------------------------------------
    async def _propose(self, spec: Speculation, block: int, tree_nodes: int) -> DraftTree:
        none = DraftTree([], [])
        for _ in range(2):               # a lost draft context is rebuilt once per step
            if self._draft_context_stale(spec) and not await self._rebuild_draft(spec):
                return none
            try:
                resp = await self.state.draft.call(
                    "Propose", self._propose_request(block, tree_nodes),
                    self.state.config.step_timeout_s)
            except UpstreamError as e:
                if not self._on_draft_error(e):
                    return none
                continue
            self.feed.clear()
            self.draft_pause_s = self.state.config.backoff_initial_s
            if resp.draft_parents:
                return self._valid_tree(resp, block, tree_nodes)
            return DraftTree.chain(self._valid_drafts(resp.draft_tokens, block))
        return none

    def _propose_request(self, block: int, tree_nodes: int) -> draft_pb2.ProposeRequest:
        self.draft_touched = True
        return draft_pb2.ProposeRequest(
            sequence_id=self.seq_id, new_features=self.feed.features(),
            positions=self.feed.positions, new_token_ids=self.feed.token_ids,
            anchor=self.anchor, block_size=block, tree_nodes=tree_nodes)

    def _draft_context_stale(self, spec: Speculation) -> bool:
        return (self.draft_lost or spec.generation != self.draft_generation
                or spec.capture_layers != self.capture_layers)

    def _on_draft_error(self, e: UpstreamError) -> bool:
        """True: retry after a rebuild. Any draft failure only costs speculation, never output."""
        if e.code == grpc.StatusCode.NOT_FOUND:
            self.draft_lost = True
            return True
        if e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self.draft_lost = True       # it may have taken the features: its context is unknown
        elif e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._pause_draft()          # its context is unchanged; the features stay in the feed
        elif e.code not in DRAFT_SKIPS:
            log.warning("draft failed; this request continues autoregressively: %s", e,
                        extra=self._ids())
            self.draft_disabled = True
        return False

    def _pause_draft(self) -> None:
        """The draft's pools are full: autoregressive steps for a backoff (doubling, jittered)."""
        cfg = self.state.config
        self.draft_paused_until = time.monotonic() + self.draft_pause_s * random.uniform(0.5, 1)
        self.draft_pause_s = min(self.draft_pause_s * 2, cfg.backoff_max_s)

    async def _rebuild_draft(self, spec: Speculation) -> bool:
        """Give the draft the whole context again, from position 0."""
        if self.rebuilds >= MAX_REBUILDS:
            self.draft_disabled = True
            self.feed.clear()
            return False
        self.rebuilds += 1
        log.info("rebuilding the draft context", extra=self._ids(rebuild=self.rebuilds))
        await _release(self.state.draft, self.seq_id, self.state.config.release_timeout_s)
        self.capture_layers = spec.capture_layers
        self.feature_dtype = spec.draft.feature_dtype
        context = self._context_ids()
        self.feed.clear()
        features = None
        if self.capture_layers:
            features = (await self._prefill_target(context, len(self.out.output) - 1)).features
        self.feed.append(features, range(len(context)), context)
        self.draft_generation, self.draft_lost = spec.generation, False
        return True

    def _valid_drafts(self, tokens, block: int) -> list[int]:
        vocab = self.state.target_caps.vocab_size
        out = []
        for t in list(tokens)[:block - 1]:
            if t >= vocab:
                break
            out.append(int(t))
        return out

    def _valid_tree(self, resp: draft_pb2.ProposeResponse, block: int, nodes: int) -> DraftTree:
        """The draft's tree when it is one the target accepts (within the size asked for, ids in
        the vocabulary, parents before children, at most block - 1 deep); else no drafts this
        step - a draft's fault only costs speculation."""
        tree = DraftTree([int(t) for t in resp.draft_tokens], [int(p) for p in resp.draft_parents])
        problem = tree_problem(tree, nodes, block - 1)
        if problem is None and any(t >= self.state.target_caps.vocab_size for t in tree.tokens):
            problem = "a draft token outside the vocabulary"
        if problem is not None:
            log.warning("draft sent an unusable tree (%s); this step verifies no drafts", problem,
                        extra=self._ids())
            return DraftTree([], [])
        return tree

    def _keep_features(self, features: common_pb2.TensorData, token_ids: list[int]) -> None:
        start = self.target_len
        self.feed.append(features if self.capture_layers else None,
                         range(start, start + len(token_ids)), token_ids)
        if self.feed.nbytes > self.feed_limit:
            self.feed.clear()            # too much to keep: rebuild when the draft is back
            self.draft_lost = True

    # -- target --------------------------------------------------------------------------------
    async def _prefill_target(self, ids: list[int], num_generated: int,
                              recovery: Recovery | None = None) -> target_pb2.PrefillResponse:
        """A Prefill replaces the sequence, so after a failure that a wait can cure (the target
        down or restarting, its pools full) it is simply sent again."""
        recovery = recovery or Recovery(self.state.config)
        while True:
            req = target_pb2.PrefillRequest(
                sequence_id=self.seq_id, token_ids=ids,
                sampling=self.req.sampling_pb(self.prefills), capture_layers=self.capture_layers,
                feature_dtype=self.feature_dtype, num_generated=num_generated)
            try:
                resp = await self.state.target.call("Prefill", req,
                                                    self.state.config.prefill_timeout_s)
            except UpstreamError as e:
                if not await self._wait_out(e, recovery):
                    raise recovery.gave_up(e) if e.code in WAITABLE else e
                continue
            self.prefills += 1
            return resp

    async def _verify(self, tokens: list[int], parents: list[int]) -> target_pb2.VerifyResponse:
        """A Verify is not idempotent (it appends the block), so after a failure that may have
        lost the sequence or the answer, the sequence is rebuilt with a Prefill (which replaces
        it) before Verify is sent again - never the same Verify twice."""
        req = target_pb2.VerifyRequest(sequence_id=self.seq_id, token_ids=tokens, parents=parents)
        recovery = Recovery(self.state.config)
        while True:
            try:
                return await self.state.target.call("Verify", req,
                                                    self.state.config.step_timeout_s)
            except UpstreamError as e:
                await self._recover_sequence(e, recovery)

    async def _recover_sequence(self, e: UpstreamError, recovery: Recovery) -> None:
        """After a failed Verify: waits out what can be waited out and prefills the committed
        tokens again; raises when it cannot (or may not) recover."""
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            await _release(self.state.target, self.seq_id, self.state.config.release_timeout_s)
            self.preemptions += 1
            log.info("target pools full: sequence released, to be prefilled again after a "
                     "backoff", extra=self._ids(preemptions=self.preemptions))
        elif e.code not in TARGET_REBUILDS or self.rebuilds >= MAX_REBUILDS:
            raise e
        else:
            self.rebuilds += 1
        if not await self._wait_out(e, recovery):
            raise recovery.gave_up(e)
        if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            log.info("target lost the sequence (%s); prefilling it again", e.code.name,
                     extra=self._ids())
        await self._prefill_target(self._context_ids(), len(self.out.output) - 1, recovery)

    async def _wait_out(self, e: UpstreamError, recovery: Recovery) -> bool:
        """True when the call may be sent again: the target is back (UNAVAILABLE), a backoff
        passed (RESOURCE_EXHAUSTED), or at once (NOT_FOUND: it lost the sequence)."""
        if e.code == grpc.StatusCode.UNAVAILABLE:
            return await self._target_back(recovery)
        if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return await recovery.pool.wait()
        return e.code == grpc.StatusCode.NOT_FOUND and e.method == "Verify"

    async def _target_back(self, recovery: Recovery) -> bool:
        """Waits (bounded) for the target to be SERVING and compatible again (a restart)."""
        try:
            await asyncio.wait_for(self.state.upstreams_event.wait(), recovery.upstream_left_s)
        except asyncio.TimeoutError:
            return False
        return self.state.target.serving

    def _context_ids(self) -> list[int]:
        """Prompt + committed output without the anchor: the positions that have KV."""
        return list(self.req.prompt_ids) + self.out.output[:-1]

    # -- output ----------------------------------------------------------------------------------
    def _deliver(self, tokens: list[int], accepted: int) -> Event:
        d = self.out.add(tokens)
        self.anchor = tokens[-1]
        self.usage.completion_tokens = len(self.out.output)
        self.telemetry.emitted(len(d.token_ids))
        usage = self.usage if d.finish_reason else None
        return Event(d.token_ids, d.text, accepted, d.finish_reason, usage)

    def _count_step(self, drafts: int, accepted: int) -> None:
        u = self.usage
        u.verify_steps += 1
        if drafts:
            u.draft_steps += 1
            u.draft_tokens += drafts
            u.accepted_tokens += accepted

    async def _release(self) -> None:
        timeout = self.state.config.release_timeout_s
        calls = [_release(self.state.target, self.seq_id, timeout)]
        if self.draft_touched and self.state.draft is not None:
            calls.append(_release(self.state.draft, self.seq_id, timeout))
        await asyncio.gather(*calls)


async def _release(upstream: Upstream, seq_id: str, timeout: float) -> None:
    """Best effort: a service that is down has lost the sequence, or its lease frees it. Sent
    after the sequence's cancelled calls were answered, so that none of them runs after it."""
    await upstream.settled(seq_id)
    try:
        await upstream.stub.Release(common_pb2.ReleaseRequest(sequence_id=seq_id), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        upstream.count_error(e.code())
        log.debug("release on %s failed: %s", upstream.role, e.code().name)


async def drain_releases(timeout: float) -> None:
    """At shutdown: let the releases of cancelled requests reach the services."""
    if _background:
        await asyncio.wait(set(_background), timeout=timeout)


async def _shielded(coro) -> None:
    """Runs coro to the end even if the caller is cancelled again meanwhile."""
    task = asyncio.ensure_future(coro)
    _background.add(task)
    task.add_done_callback(_background.discard)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        pass
