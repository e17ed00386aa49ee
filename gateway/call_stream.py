"""The client side of a multiplexed call stream (Target.VerifyStream, Draft.ProposeStream; the
contract is at CallStatus in proto/dflash/v1/common.proto): one long-lived bidirectional stream
per upstream carries every Verify (or Propose) call of the gateway.

One writer task sends the calls (a write is never cancelled half-way: grpc would cancel the whole
stream), one reader task resolves each call's future by call_id. A call whose timeout passes
fails alone (DEADLINE_EXCEEDED); a stream that breaks fails every call in flight on it
(UNAVAILABLE) and is opened again by the next call."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from collections.abc import Callable
from typing import Any

import grpc

log = logging.getLogger("dflash.gateway.upstream")

CANCEL_SETTLE_S = 5.0          # how long a cancelled call waits for the server's CANCELLED

CODES = {code.value[0]: code for code in grpc.StatusCode}


class CallFailed(Exception):
    """One call on the stream failed with this status (as an AioRpcError would say)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class StreamUnsupported(CallFailed):
    """The upstream has no <M>Stream (an older service answers UNIMPLEMENTED); the call was
    not run, so it may be sent again as a unary call."""


class CallStream:
    """Calls on one upstream's <M>Stream. `open_stream()` starts a new bidi call (the stub's
    <M>Stream method); `request_type` is <M>StreamRequest. Event loop only."""

    def __init__(self, name: str, open_stream: Callable[[], Any], request_type: type) -> None:
        self.name = name                       # "target VerifyStream": for messages and logs
        self._open_stream, self._request_type = open_stream, request_type
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)
        self.opened = 0                        # streams opened so far
        self._withdrawals: dict[str, set[asyncio.Task]] = {}   # sequence id -> settling cancels

    async def call(self, request: Any, timeout: float) -> Any:
        """The call's response; CallFailed with the call's (or the stream's) status."""
        stream = self._current()
        call_id = next(self._ids)
        message = self._request_type(call_id=call_id, request=request,
                                     timeout_ms=math.ceil(timeout * 1000))
        future = stream.submit(call_id, message)
        try:
            async with asyncio.timeout(timeout):       # the server stops it too (timeout_ms)
                reply = await future
        except TimeoutError:
            raise CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"Deadline Exceeded: no answer within {timeout:g} s on the "
                             f"{self.name}") from None
        except asyncio.CancelledError:     # the request went away: stop the call on the server
            self._withdraw(stream, call_id, getattr(request, "sequence_id", ""))
            raise
        finally:
            if stream.pending.get(call_id) is future:
                del stream.pending[call_id]
        if reply.status.code:
            raise CallFailed(CODES.get(reply.status.code, grpc.StatusCode.UNKNOWN),
                             reply.status.message)
        return reply.response

    async def settled(self, sequence_id: str) -> None:
        """Returns once the calls of this sequence that were cancelled on this stream are
        answered by the server (or CANCEL_SETTLE_S passed): a Release sent afterwards then
        reaches the service's engine after them, never before a call that would create the
        sequence again."""
        tasks = self._withdrawals.get(sequence_id)
        if tasks:
            await asyncio.wait(set(tasks))

    def _withdraw(self, stream: _Stream, call_id: int, sequence_id: str) -> None:
        """Asks the server to cancel the call and settles it in the background: the caller's
        cancellation completes at once (a client that hangs up may be cancelled again and
        again, as anyio's cancel scopes do), and `settled` is what a Release waits for."""
        settling = stream.withdraw(call_id, self._request_type(call_id=call_id, cancel=True))
        if settling is None:
            return
        task = asyncio.ensure_future(_settle(stream, call_id, settling))
        tasks = self._withdrawals.setdefault(sequence_id, set())
        tasks.add(task)
        task.add_done_callback(lambda t: self._settled(sequence_id, t))

    def _settled(self, sequence_id: str, task: asyncio.Task) -> None:
        tasks = self._withdrawals.get(sequence_id, set())
        tasks.discard(task)
        if not tasks:
            self._withdrawals.pop(sequence_id, None)

    async def close(self, why: str = "the gateway is closing its upstream channel") -> None:
        """Ends the current stream: its calls in flight fail UNAVAILABLE; the next call opens
        another."""
        if self._stream is not None:
            await self._stream.close(why)

    def _current(self) -> _Stream:
        if self._stream is None or self._stream.broken:
            self.opened += 1
            self._stream = _Stream(self.name, self._open_stream())
            log.info("%s opened (stream %d)", self.name, self.opened)
        return self._stream


class _Stream:
    """One bidi call: its writer and reader tasks and the calls in flight on it."""

    def __init__(self, name: str, call: Any) -> None:
        self.name, self.call = name, call
        self.pending: dict[int, asyncio.Future] = {}
        self.unsent: set[int] = set()          # calls in the outbox, not written yet
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.broken = ""                       # why it ended; "" while it works
        self.tasks = [asyncio.create_task(self._write(), name=f"{name}-writer"),
                      asyncio.create_task(self._read(), name=f"{name}-reader")]

    def submit(self, call_id: int, message: Any) -> asyncio.Future:
        """Sends a call; its future gets the answer."""
        future = self.pending[call_id] = asyncio.get_running_loop().create_future()
        self.unsent.add(call_id)
        self.outbox.put_nowait(message)
        return future

    def withdraw(self, call_id: int, cancel: Any) -> asyncio.Future | None:
        """The caller gave up on a call. Not written yet: it never will be (None). Else the
        server is asked to cancel it; the future returned gets its answer (CANCELLED, or the
        call's own if it was already being answered): after that, whatever is sent next (a
        Release) reaches the service after the call was dropped or handed to its engine, as
        after a cancelled unary call."""
        if call_id in self.unsent:
            self.unsent.discard(call_id)
            self.pending.pop(call_id, None)
            return None
        if self.broken or call_id not in self.pending:
            return None                        # the stream ended, or the answer came already
        settling = self.pending[call_id] = asyncio.get_running_loop().create_future()
        self.outbox.put_nowait(cancel)
        return settling

    async def close(self, why: str) -> None:
        self._break(why)
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _write(self) -> None:
        try:
            while True:
                message = await self.outbox.get()
                if not message.cancel:
                    if message.call_id not in self.unsent:
                        continue               # withdrawn before it was written
                    self.unsent.discard(message.call_id)
                await self.call.write(message)
        except Exception as e:  # noqa: BLE001 - any write failure ends this stream
            self._break(*_describe(e))

    async def _read(self) -> None:
        try:
            while (reply := await self.call.read()) is not grpc.aio.EOF:
                future = self.pending.pop(reply.call_id, None)
                if future is not None and not future.done():
                    future.set_result(reply)
            self._break("the server ended the stream")
        except Exception as e:  # noqa: BLE001 - any read failure ends this stream
            self._break(*_describe(e))

    def _break(self, why: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        """Ends the stream: every call in flight fails UNAVAILABLE (StreamUnsupported when the
        upstream has no such method); the next call opens another stream."""
        if self.broken:
            return
        self.broken = why
        if self.pending:
            log.info("%s broke with %d calls in flight: %s", self.name, len(self.pending), why)
        details = f"the {self.name} broke: {why}"
        unsupported = code == grpc.StatusCode.UNIMPLEMENTED
        for future in self.pending.values():
            if not future.done():
                future.set_exception(StreamUnsupported(code, details) if unsupported
                                     else CallFailed(grpc.StatusCode.UNAVAILABLE, details))
        self.pending.clear()
        self.call.cancel()
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()


async def _settle(stream: _Stream, call_id: int, settling: asyncio.Future) -> None:
    """Waits (bounded) for a withdrawn call's answer."""
    with contextlib.suppress(TimeoutError, CallFailed):
        async with asyncio.timeout(CANCEL_SETTLE_S):
            await settling
    stream.pending.pop(call_id, None)


def _describe(e: Exception) -> tuple[str, grpc.StatusCode]:
    """(why, the stream's status code) of a failed read or write."""
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details() or ''}", e.code()
    return f"{type(e).__name__}: {e}", grpc.StatusCode.UNAVAILABLE
