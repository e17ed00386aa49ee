"""What both APIs call: admission (gateway/admission.py), the readiness gate, validation, the
loop. `open()` is the one way in:

    admission  queue full -> RESOURCE_EXHAUSTED / 429 at once
    readiness  draining or never ready -> UNAVAILABLE at once; ready before (an upstream is
               down or restarting) -> wait for it up to --upstream-wait, then UNAVAILABLE
    build()    the API's request -> GenerationRequest (chat template and tokenizing on a worker
               thread: gateway/prompts.py), validated (INVALID_ARGUMENT); its structured-output
               grammar compiled (cached, on a worker thread; a bad one is INVALID_ARGUMENT)
    stream     waits for a running slot, then the loop; cancelling it releases the sequences"""
from __future__ import annotations

import asyncio
import contextlib
import time
import weakref
from collections.abc import AsyncIterator, Callable

from dflash.v1 import gateway_pb2
from gateway.admission import Admission, Ticket
from gateway.generation import Event, Generation
from gateway.grammar import GrammarError, GrammarMatcher, GrammarSpec
from gateway.prompts import PromptTokenizer
from gateway.request import GenerationRequest, Limits, RequestError, validate
from gateway.state import GatewayState
from services.common import metrics
from services.common.errors import Unavailable


class GatewayService:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        cfg = state.config
        self.admission = Admission(cfg.max_running, cfg.max_waiting, cfg.retry_after_s,
                                   self._publish_load)
        self.draining = False
        self._drain_started = asyncio.Event()
        self.prompts = PromptTokenizer(state.tokenizer, self._max_prompt_tokens)

    # -- the way in ------------------------------------------------------------------------------
    async def open(self, build: Callable[[], GenerationRequest], arrival: float | None = None
                   ) -> AsyncIterator[Event]:
        """The event stream of one request; it owns its admission ticket (iterate it inside
        `contextlib.aclosing`; one that is dropped unstarted gives the ticket back)."""
        arrival = time.perf_counter() if arrival is None else arrival
        ticket = self.admission.reserve()
        try:
            await self.wait_ready()
            req = self.prepare(await asyncio.to_thread(build))
            grammar = await self._matcher(req.grammar) if req.grammar is not None else None
        except BaseException:
            ticket.close()
            raise
        events = self._generate(req, ticket, arrival, grammar)
        weakref.finalize(events, ticket.close)
        return events

    def require_ready(self) -> None:
        if self.draining:
            raise Unavailable("the gateway is shutting down: requests in flight are finishing, "
                              "new ones are refused; retry on another replica or when it is back")
        if not self.state.ready or self.state.target_caps is None:
            raise Unavailable(f"the gateway is not ready: {self.state.reason}")

    async def wait_ready(self) -> None:
        """Ready now; or, once it was ready (an upstream went away), within --upstream-wait."""
        s = self.state
        if s.ready or self.draining or not s.ready_once or s.reason.startswith(
                ("target refused", "draft refused")):
            return self.require_ready()
        await _first_of(s.ready_event, self._drain_started, timeout=s.config.upstream_wait_s)
        if not s.ready and not self.draining:
            raise Unavailable(f"the gateway is not ready after waiting "
                              f"{s.config.upstream_wait_s:g} s (--upstream-wait): {s.reason}")
        self.require_ready()

    def limits(self) -> Limits:
        caps, cfg = self.state.target_caps, self.state.config
        return Limits(vocab_size=caps.vocab_size, max_context=caps.max_context,
                      max_prompt_tokens=cfg.max_prompt_tokens,
                      max_new_tokens=cfg.max_tokens_limit)

    def _max_prompt_tokens(self) -> int:
        limits = self.limits()
        room = limits.max_context - 1                  # one position at least to generate
        return min(room, limits.max_prompt_tokens) if limits.max_prompt_tokens else room

    def prepare(self, req: GenerationRequest) -> GenerationRequest:
        """Readiness first (UNAVAILABLE), then the request's own checks (INVALID_ARGUMENT)."""
        self.require_ready()
        return validate(req, self.limits())

    async def _matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher of the request's grammar, compiled once per distinct spec."""
        try:
            compiler = await self.state.grammar_compiler()
            return GrammarMatcher(await asyncio.to_thread(compiler.compile, spec))
        except GrammarError as e:
            raise RequestError(f"structured output ({spec.kind}): {e}", "response_format") from None

    async def _generate(self, req: GenerationRequest, ticket: Ticket, arrival: float,
                        grammar: GrammarMatcher | None) -> AsyncIterator[Event]:
        try:
            await ticket.run()
            gen = Generation(self.state, req, arrival, self.admission, grammar)
            try:
                async with contextlib.aclosing(gen.events()) as events:
                    async for event in events:
                        yield event
            finally:
                gen.route.close()        # (also when its events never started)
        finally:
            ticket.close()

    def _publish_load(self, running: int, waiting: int) -> None:
        model = self.state.metrics_model
        metrics.RUNNING.labels(model, "gateway").set(running)
        metrics.WAITING.labels(model, "gateway").set(waiting)

    # -- draining --------------------------------------------------------------------------------
    def start_draining(self) -> None:
        self.draining = True
        self._drain_started.set()
        self.state.start_closing()

    @property
    def idle(self) -> bool:
        return self.admission.active == 0

    def model_info(self) -> gateway_pb2.ModelInfo:
        self.require_ready()
        caps, spec = self.state.target_caps, self.state.speculation()
        draft = spec.draft
        return gateway_pb2.ModelInfo(
            model_id=self.state.model_name, vocab_size=caps.vocab_size,
            max_context=caps.max_context, eos_token_ids=list(caps.eos_token_ids),
            drafter_kind=draft.drafter_kind if draft is not None else "",
            block_size=spec.block_size, speculative=spec.draft is not None,
            target_architecture=caps.architecture, hybrid=caps.hybrid,
            mamba_verify_commit=caps.mamba_verify_commit)


async def _first_of(*events: asyncio.Event, timeout: float) -> None:
    """Until one of the events is set, or timeout."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
