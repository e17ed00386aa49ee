"""dflash.v1.Gateway servicer: protobuf <-> GenerationRequest / events; nothing else."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import grpc

from dflash.v1 import gateway_pb2, gateway_pb2_grpc
from gateway.errors import classify
from gateway.generation import Event, Usage
from gateway.grammar import GrammarSpec
from gateway.request import GenerationRequest, RequestError
from gateway.service import GatewayService
from services.common import metrics
from services.common.errors import log_rpc, rpc

SERVICE_NAME = "dflash.v1.Gateway"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, service: GatewayService) -> None:
        self.service = service

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        arrival = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            events = await self.service.open(lambda: self._from_proto(request), arrival)
            async with contextlib.aclosing(events):
                async for event in events:
                    yield _to_proto(event)
        except grpc.aio.AbortError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as e:  # noqa: BLE001 - CancelledError (client gone) is not an Exception
            err = classify(e)
            code = err.code
            if err.retry_after:
                context.set_trailing_metadata((("retry-after", err.retry_after),))
            await context.abort(err.code, err.message)
        finally:                # counted like the unary RPCs (services/common/errors.py:rpc)
            seconds = time.perf_counter() - arrival
            metrics.observe_rpc("Generate", code.name, seconds)
            log_rpc("Generate", code, seconds, request_id=request.request_id)

    @rpc
    async def GetModelInfo(self, request, context) -> gateway_pb2.ModelInfo:
        return self.service.model_info()

    def _from_proto(self, msg: gateway_pb2.GenerateRequest) -> GenerationRequest:
        which = msg.WhichOneof("prompt")
        if which is None:
            raise RequestError("the prompt is missing: set text or token_ids", "prompt")
        if which == "text":
            if not msg.text:
                raise RequestError("the prompt text is empty", "prompt")
            ids = self.service.prompts.encode(msg.text, add_special_tokens=True)
        else:
            ids = list(msg.token_ids.ids)
        s = msg.sampling
        return GenerationRequest(
            prompt_ids=tuple(ids), max_tokens=msg.max_tokens or None,
            temperature=s.temperature, top_p=s.top_p if s.HasField("top_p") else 1.0,
            top_k=s.top_k, seed=s.seed if s.HasField("seed") else None,
            min_tokens=s.min_tokens, stop=tuple(msg.stop), stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=msg.ignore_eos, block_size=msg.block_size,
            skip_special_tokens=msg.skip_special_tokens, logprobs=s.logprobs,
            top_logprobs=s.top_logprobs, processed_logprobs=s.processed_logprobs,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            grammar=_grammar(msg.structured) if msg.HasField("structured") else None,
            request_id=msg.request_id)


def _grammar(so: gateway_pb2.StructuredOutput) -> GrammarSpec | None:
    """StructuredOutput -> the grammar it names (json_object false: none)."""
    kind = so.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not so.json_object):
        return None
    if kind == "choice":
        return GrammarSpec("choice", json.dumps(list(so.choice.choices)))
    return GrammarSpec(kind, "" if kind == "json_object" else getattr(so, kind))


def _to_proto(event: Event) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        token_ids=event.token_ids, text=event.text, finish_reason=event.finish_reason or "",
        accepted=event.accepted, usage=_usage(event.usage) if event.usage else None,
        logprobs=event.logprobs)


def _usage(u: Usage) -> gateway_pb2.Usage:
    return gateway_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                             verify_steps=u.verify_steps, accepted_tokens=u.accepted_tokens,
                             draft_steps=u.draft_steps, draft_tokens=u.draft_tokens,
                             cached_tokens=u.cached_tokens)


def add_to_server(servicer: GatewayServicer, server: grpc.aio.Server) -> list[str]:
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    return [SERVICE_NAME]
