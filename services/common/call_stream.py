"""The server side of a multiplexed call stream (Target.VerifyStream, Draft.ProposeStream; the
contract is at CallStatus in proto/dflash/v1/common.proto).

Each request message is one call, run as its own task through the same request -> domain call ->
response function as the unary method, so calls of different sequences proceed (and batch in the
engine) exactly as unary calls do; each answer is written when its call is done, in completion
order. Status mapping, counting and logging are the unary ones (errors.answer)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from dflash.v1 import common_pb2
from services.common import callers
from services.common.errors import DeadlineExceeded, ServiceError, answer, rpc

log = logging.getLogger("dflash.rpc")

Handle = Callable[[Any], Awaitable[Any]]


@dataclass(frozen=True)
class Refused:
    """A call refused before it ran (the guard, while draining): answered with `error`."""
    message: Any                     # the <M>StreamRequest
    error: ServiceError
    cancel = False                   # as the message's own field: a call, not a cancellation

    @property
    def call_id(self) -> int:
        return self.message.call_id


def unary_and_stream(method: str, path: str, response_type: type) -> tuple[Callable, Callable]:
    """The servicer methods `<method>` (unary) and `<method>Stream` (multiplexed), both through
    the servicer's one coroutine `path(request, owner) -> response` (owner: the caller's owner
    tag, services/common/callers.py - a stream's, for each of its calls):

        Verify, VerifyStream = unary_and_stream("Verify", "verify", VerifyStreamResponse)"""
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await getattr(self, path)(request, callers.owner(context))

    async def stream(self: Any, requests: AsyncIterable, context: grpc.aio.ServicerContext) -> None:
        handler, owner = getattr(self, path), callers.owner(context)

        async def handle(request: Any) -> Any:
            return await handler(request, owner)
        await serve(requests, context, method, handle, response_type)

    unary.__name__, stream.__name__ = method, f"{method}Stream"
    stream.__doc__ = f"{method} calls multiplexed on one stream (CallStatus in common.proto)."
    return rpc(unary), stream


async def serve(requests: AsyncIterable, context: grpc.aio.ServicerContext, method: str,
                handle: Handle, response_type: type) -> None:
    """Serves one <M>Stream: `handle(request)` per call; the answers are `response_type`
    (<M>StreamResponse); a `cancel` message cancels its call. Half-closed by the client: the
    calls already sent are answered, then it ends. Ended any other way (cancelled, connection
    lost, server stopping): the calls in flight are cancelled - nobody is left to read their
    answers."""
    stream = _Stream(context, method, handle, response_type)
    try:
        async for message in requests:
            if message.cancel:
                stream.cancel_call(message.call_id)
            else:
                stream.start(message)
        await stream.wait()
    finally:
        await stream.cancel()


class _Stream:
    def __init__(self, context: grpc.aio.ServicerContext, method: str, handle: Handle,
                 response_type: type) -> None:
        self.context, self.method, self.handle = context, method, handle
        self.response_type = response_type
        self.tasks: set[asyncio.Task] = set()            # every call not finished
        self.running: dict[int, asyncio.Task] = {}     # call_id -> a call not answered yet
        self.withdrawn: set[int] = set()               # cancelled by the client
        self.write_lock = asyncio.Lock()     # grpc allows one write at a time per call

    def start(self, message: Any) -> None:
        task = asyncio.create_task(self._call(message))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.running[message.call_id] = task

    def cancel_call(self, call_id: int) -> None:
        """The client gave up on this call (as it would cancel a unary one): it is cancelled and
        answered CANCELLED, so the client knows its next calls come after it. A call whose
        answer is being written is left to finish (that answer tells the client as much)."""
        task = self.running.pop(call_id, None)
        if task is not None:
            self.withdrawn.add(call_id)
            task.cancel()

    async def wait(self) -> None:
        if self.tasks:
            await asyncio.wait(set(self.tasks))

    async def cancel(self) -> None:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _call(self, message: Any) -> None:
        handle = self.handle
        if isinstance(message, Refused):
            message, handle = message.message, _raising(message.error)
        elif message.timeout_ms:
            handle = _with_deadline(handle, self.method, message.timeout_ms)
        try:
            response, code, details = await answer(self.method, message.request, handle)
        except asyncio.CancelledError:
            if message.call_id not in self.withdrawn:
                raise                        # the stream ended: nobody to answer
            self.withdrawn.discard(message.call_id)
            asyncio.current_task().uncancel()
            response, code, details = None, grpc.StatusCode.CANCELLED, "cancelled by the client"
        if self.running.get(message.call_id) is asyncio.current_task():
            del self.running[message.call_id]    # answered: no longer cancellable
        if response is not None:
            reply = self.response_type(call_id=message.call_id, response=response)
        else:
            reply = self.response_type(call_id=message.call_id, status=common_pb2.CallStatus(
                code=code.value[0], message=details))
        try:
            async with self.write_lock:
                await self.context.write(reply)
        except Exception as e:  # noqa: BLE001 - the stream is gone; its end is handled by serve
            log.debug("answer to call %d not written: %s", message.call_id, e)


def _raising(error: ServiceError) -> Handle:
    async def refuse(request: Any) -> Any:
        raise error
    return refuse


def _with_deadline(handle: Handle, method: str, timeout_ms: int) -> Handle:
    """The call's own deadline (timeout_ms from its arrival): cancelled past it, as gRPC cancels
    a unary handler whose deadline passed, and answered DEADLINE_EXCEEDED."""
    async def timed(request: Any) -> Any:
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                return await handle(request)
        except TimeoutError:
            raise DeadlineExceeded(f"{method} did not finish within its deadline of "
                                   f"{timeout_ms} ms") from None
    return timed
