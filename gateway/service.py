"""What both APIs call: readiness gate, validation, admission (running/waiting), the loop."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from dflash.v1 import gateway_pb2
from gateway.loop import Event, Generation
from gateway.request import GenerationRequest, Limits, validate
from gateway.state import GatewayState
from services.common import metrics
from services.common.errors import Unavailable


class GatewayService:
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self._slots = asyncio.Semaphore(state.config.max_running)

    def require_ready(self) -> None:
        if not self.state.ready or self.state.target_caps is None:
            raise Unavailable(f"the gateway is not ready: {self.state.reason}")

    def limits(self) -> Limits:
        caps = self.state.target_caps
        return Limits(vocab_size=caps.vocab_size, max_context=caps.max_context)

    def prepare(self, req: GenerationRequest) -> GenerationRequest:
        """Readiness first (UNAVAILABLE), then the request's own checks (INVALID_ARGUMENT)."""
        self.require_ready()
        return validate(req, self.limits())

    async def generate(self, req: GenerationRequest, arrival: float | None = None
                       ) -> AsyncIterator[Event]:
        """req must come from prepare(). Cancelling the consumer releases the sequences."""
        arrival = time.perf_counter() if arrival is None else arrival
        async with self._admitted():
            gen = Generation(self.state, req, arrival)
            async with contextlib.aclosing(gen.events()) as events:
                async for event in events:
                    yield event

    @contextlib.asynccontextmanager
    async def _admitted(self):
        model = self.state.metrics_model
        waiting = metrics.WAITING.labels(model, "gateway")
        running = metrics.RUNNING.labels(model, "gateway")
        waiting.inc()
        try:
            await self._slots.acquire()
        finally:
            waiting.dec()
        running.inc()
        try:
            yield
        finally:
            running.dec()
            self._slots.release()

    def model_info(self) -> gateway_pb2.ModelInfo:
        self.require_ready()
        caps, spec = self.state.target_caps, self.state.speculation()
        draft = self.state.draft.capabilities if self.state.draft is not None else None
        return gateway_pb2.ModelInfo(
            model_id=self.state.model_name, vocab_size=caps.vocab_size,
            max_context=caps.max_context, eos_token_ids=list(caps.eos_token_ids),
            drafter_kind=draft.drafter_kind if draft is not None else "",
            block_size=spec.block_size, speculative=spec.draft is not None,
            target_architecture=caps.architecture, hybrid=caps.hybrid,
            mamba_verify_commit=caps.mamba_verify_commit)
