"""The per-request speculative loop (docs/architecture.md, "The loop").

    prefill: t0 = target.Prefill(seq, prompt, sampling, capture_layers)   features of the prompt
    step:    d  = draft.Propose(seq, features not sent yet, anchor, B)      B-1 draft tokens
             v  = target.Verify(seq, [anchor] + d)                           a, [d1..da, bonus]
             (with --spec-tree-nodes N: d is a tree of N drafts with parents, and Verify
              commits the path of the target's own greedy choices in it, or for a sampled
              request the path recursive rejection sampling accepts)
    end:     Release on both services (finished, failed or cancelled)

The gateway owns the request: its prompt and committed output (the OutputProcessor) are the
truth, and the committed length is derived from them. The services hold soft state that the
links rebuild when it is lost: target_link.py (Prefill / Verify with recovery), draft_link.py
(the draft's state, its feed, Propose)."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dflash.v1 import common_pb2, target_pb2
from gateway import background
from gateway.admission import Admission
from gateway.draft_link import NO_DRAFTS, DraftLink
from gateway.feed import answer_chunk, chunk_nbytes
from gateway.grammar import GrammarMatcher
from gateway.output import OutputProcessor
from gateway.request import GenerationRequest
from gateway.speculation_policy import Limits, Shape, SpeculationPolicy
from gateway.state import GatewayState, Speculation
from gateway.target_link import Context, ProposalRefused, Rebuilds, TargetLink
from gateway.telemetry import RequestTelemetry
from runtime.draft_tree import DraftTree

log = logging.getLogger("dflash.gateway.loop")


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0           # prompt tokens whose KV the target had cached
    verify_steps: int = 0
    draft_steps: int = 0             # verify steps that carried at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafting steps (vLLM's definition; 1.0 when nothing was drafted)."""
        return 1.0 + self.accepted_tokens / self.draft_steps if self.draft_steps else 1.0

    def record_step(self, drafts: int, accepted: int) -> None:
        self.verify_steps += 1
        if drafts:
            self.draft_steps += 1
            self.draft_tokens += drafts
            self.accepted_tokens += accepted


@dataclass(frozen=True)
class Event:
    token_ids: list[int]
    text: str
    accepted: int                    # drafts accepted in this step
    finish_reason: str | None = None
    usage: Usage | None = None       # on the last event
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)  # one per token_ids
                                     # entry when the request asked for them, else empty


class Generation:
    """One request. Iterate `events()` inside `contextlib.aclosing` so that cancellation runs
    the release."""

    def __init__(self, state: GatewayState, req: GenerationRequest, arrival: float,
                 admission: Admission, grammar: GrammarMatcher | None = None) -> None:
        """grammar: structured output's matcher (gateway/grammar.py), None for free text."""
        self.state, self.req, self.grammar = state, req, grammar
        self.admission = admission       # its running count decides whether to draft (load rule)
        self.out = OutputProcessor(req, list(state.target_caps.eos_token_ids), state.tokenizer)
        self.usage = Usage(prompt_tokens=len(req.prompt_ids))
        self.telemetry = RequestTelemetry(state.metrics_model, arrival)
        rebuilds = Rebuilds()
        self.key = f"gw-{uuid.uuid4().hex[:24]}"
        self.acceptance = state.policy.model()   # --speculation auto: this request's acceptance
        self.route = state.place(req.prompt_ids)  # its replicas (gateway/route.py)
        self.target = TargetLink(state, self.key, req, rebuilds, self.route, self.context,
                                 lambda: self.draft.capture(), lambda: self.draft.target_moved())
        self.draft = DraftLink(state, self.target, rebuilds)

    # -- the loop ------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[Event]:
        reason = "error"
        log.debug("request started", extra={**self.target.ids, "max_tokens": self.req.max_tokens,
                                            "prompt_tokens": len(self.req.prompt_ids)})
        try:
            yield await self._prefill()
            while self.out.finish_reason is None:
                yield await self._step()
            reason = self.out.finish_reason
        except (asyncio.CancelledError, GeneratorExit):
            reason = self.out.finish_reason or "abort"
            raise
        except Exception as e:
            log.warning("request failed: %s", e, extra=self.target.ids)
            raise
        finally:
            self.telemetry.finished(reason, self.usage, self.target.ids,
                                    rebuilds=self.target.rebuilds.done,
                                    preemptions=self.target.preemptions)
            await _shielded(self._release())

    async def _prefill(self) -> Event:
        self.draft.choose_capture(self.state.speculation(self.route))
        prompt = list(self.req.prompt_ids)
        mask = self.grammar.mask() if self.grammar is not None else b""
        held = await self.draft.open(self.state.speculation(self.route), prompt)
        resp = await self.target.prefill(prompt, 0, token_mask=mask, features_from=held)
        self.usage.cached_tokens = resp.cached_tokens
        if self.grammar is not None:
            self.grammar.accept([resp.next_token])
        chunk = answer_chunk(resp)
        self.telemetry.prefill_done(chunk_nbytes(chunk) if chunk is not None else None)
        self.draft.keep(chunk, prompt[held:])
        return self._deliver([resp.next_token], 0, [resp.logprobs] if resp.HasField("logprobs")
                             else [])

    async def _step(self) -> Event:
        await self._follow()
        spec = self.state.speculation(self.route)
        policy = self.state.speculation_policy()
        block, nodes, shape = self._shape(spec, policy)
        anchor = self.out.output[-1]
        if block <= 1:
            await self.draft.absorb(spec, anchor)      # the prompt's context, for the caches
        t0 = time.perf_counter()
        drafts = await self.draft.propose(spec, block, nodes, anchor) if block > 1 else NO_DRAFTS
        drafts, masks = await self._constrained(drafts)
        t1 = time.perf_counter()
        try:
            resp = await self.target.verify([anchor] + drafts.tokens,
                                            [] if drafts.is_chain else drafts.parents,
                                            self.draft.consumed(self.committed_len), masks)
        except ProposalRefused as e:     # a draft's fault costs only this step's speculation
            log.warning("the target refused the draft's proposal (%s); this step verifies no "
                        "drafts", e.details, extra=self.target.ids)
            drafts = NO_DRAFTS
            resp = await self.target.verify([anchor], [], self.draft.consumed(self.committed_len),
                                            masks[:1] if masks else None)
        t2 = time.perf_counter()
        committed = list(resp.committed_tokens)
        if self.grammar is not None:
            self.grammar.accept(committed)
        self.draft.keep(answer_chunk(resp), [anchor] + committed[:-1])
        n = len(drafts.tokens)
        self.usage.record_step(n, resp.accepted)
        event = self._deliver(committed, resp.accepted, list(resp.logprobs))
        self.telemetry.step(t1 - t0 if block > 1 else None, t2 - t1, n, resp.accepted)
        if policy is not None:
            self._learn(policy, shape, drafts, resp, t1 - t0 if block > 1 else None, t2 - t1,
                        t2 - t0)
        return event

    async def _follow(self) -> None:
        """A replica of the request's route that is no longer usable (down, draining, unlike
        the others, gone from the list) while another one is: the request moves now, its
        sequence rebuilt there (the target's at once, the draft's at its next Propose)."""
        if (target := self.state.target_for(self.route)) is not None:
            self.target.move(target)
            await self.target.rebuild()
        if (draft := self.state.draft_for(self.route)) is not None:
            self.draft.move(draft)

    def _shape(self, spec: Speculation, policy: SpeculationPolicy | None
               ) -> tuple[int, int, Shape | None]:
        """This step's (verify block, tree nodes; 0 = a chain, and the auto choice). Fixed:
        the block and tree size configured (or asked by the request; or a seeded sampled
        request); auto: the policy's choice within them."""
        block, room = self._block_size(spec), self._room()
        if policy is None or self.req.block_size or self._seeded:
            return block, spec.tree_for(room - 1), None
        limits = Limits(max_chain=block - 1, tree_depth=block - 1,
                        max_tree=min(spec.max_tree_nodes, room - 1) if block > 1 else 0,
                        backlog=self.draft.backlog(self.committed_len),
                        remaining=self.out.remaining)
        shape = policy.decide(self.key, self.acceptance, limits, self.admission.running)
        if limits.max_chain or limits.max_tree:          # a choice (not a step that cannot draft)
            policy.record(self.state.metrics_model, shape)
        return (block, shape.drafts, shape) if shape.tree else (shape.tokens, 0, shape)

    @property
    def _seeded(self) -> bool:
        """Seeded sampling: the same seed must give the same output, and the random draws a
        step makes depend on what it verifies - so fixed sizes, not auto's (they follow load
        and learning)."""
        return self.req.seed is not None and not self.req.greedy

    def _learn(self, policy: SpeculationPolicy, shape: Shape | None, drafts: DraftTree,
               resp: target_pb2.VerifyResponse, propose_s: float | None, verify_s: float,
               period_s: float) -> None:
        """--speculation auto: what this step says about acceptance and cost (period_s: the
        whole step, Propose to the Verify's answer)."""
        if shape is not None and drafts.tokens:
            depth = len(drafts.tokens) if drafts.is_chain else max(drafts.depths)
            policy.observe(self.acceptance, shape, depth, resp.accepted)
            if not drafts.is_chain and self.req.greedy:
                policy.observe_chain_in_tree(self.acceptance, drafts,
                                             list(resp.committed_tokens))
        policy.cost.observe_verify(resp.batch_tokens, resp.batch_seconds, verify_s,
                                   resp.queue_seconds, tree=not drafts.is_chain,
                                   unit=0 if drafts.is_chain else len(drafts.tokens) + 1)
        if propose_s is not None and drafts.tokens:     # by the rows of its forward
            rows, forward_s, queue_s = self.draft.last_forward
            policy.cost.observe_propose(propose_s, rows, not drafts.is_chain, forward_s,
                                        busy=self.admission.running > 1, queue_s=queue_s)
        if shape is not None and (drafts.tokens or not shape.drafts):   # it ran as priced
            policy.observe_period(self.key, shape, period_s)
        policy.export(self.state.metrics_model)

    async def _constrained(self, drafts: DraftTree) -> tuple[DraftTree, list[bytes] | None]:
        """Structured output: the drafts the grammar allows (a chain cut before its first
        refused token, a tree without each refused node's subtree) and the allowed tokens at
        each block row, on a worker thread (about 0.8 ms for 15 drafts on the CPU; llguidance
        drops the GIL); free text: as they are, no masks."""
        if self.grammar is None:
            return drafts, None
        return await asyncio.to_thread(self.grammar.plan, drafts)

    def context(self) -> Context:
        """Prompt + committed output without the anchor: the positions that have KV."""
        return Context(list(self.req.prompt_ids) + self.out.output[:-1], len(self.out.output) - 1)

    @property
    def committed_len(self) -> int:
        """Positions with target KV (the anchor is not among them)."""
        return len(self.req.prompt_ids) + len(self.out.output) - 1

    def _block_size(self, spec: Speculation) -> int:
        """1 (no drafting; the draft link keeps the features) when the draft cannot draft now,
        or above --spec-disable-batch-size running requests, where batched one-token verifies
        are worth more than drafts on hardware that is compute-bound at large batches."""
        limit = self.state.config.spec_disable_batch_size
        if not self.draft.can_draft(spec) or (limit and self.admission.running > limit):
            return 1
        return spec.block_for(self.req.block_size, self.out.remaining, self._room())

    def _room(self) -> int:
        """Positions left in the context after the committed ones."""
        return self.state.target_caps.max_context - self.committed_len

    # -- output ----------------------------------------------------------------------------------
    def _deliver(self, tokens: list[int], accepted: int,
                 logprobs: list[common_pb2.TokenLogprobs]) -> Event:
        """logprobs: one per token (the target's), or none when the request did not ask."""
        d = self.out.add(tokens)
        self.usage.completion_tokens = len(self.out.output)
        self.telemetry.emitted(len(d.token_ids))
        usage = self.usage if d.finish_reason else None
        return Event(d.token_ids, d.text, accepted, d.finish_reason, usage,
                     logprobs[: len(d.token_ids)])

    async def _release(self) -> None:
        self.state.policy.forget(self.key)
        try:
            await asyncio.gather(self.target.release(), self.draft.release())
        finally:
            self.route.close()


async def _shielded(coro) -> None:
    """Runs coro to the end even if the caller is cancelled again meanwhile."""
    try:
        await asyncio.shield(background.spawn(coro))
    except asyncio.CancelledError:
        pass
