"""--wire socket: a call stream (gateway/call_stream.py) carried by a service's unix call socket
(services/common/call_socket.py: the protocol) instead of a gRPC <M>Stream, when the service
advertises one in its capabilities and it opens from this host as that same process; else the
gRPC stream.

SocketCall is what CallStream needs of a gRPC bidirectional call: write, read (grpc.aio.EOF at
the end), cancel. It connects on first use; a refused or failed connection fails the calls in
flight like a broken stream (UNAVAILABLE), and the upstream's next stream goes over gRPC."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.call_stream import CODES, CallFailed
from services.common.call_socket import HELLO_MAX_BYTES, LENGTH, frame, read_frame


@dataclass(frozen=True)
class SocketTarget:
    """A service's call socket as its capabilities give it, and what to open it with."""
    path: str
    socket_id: str                        # what its hello must answer (call_socket_id)
    method: str                           # "Verify" | "Propose"
    metadata: tuple[tuple[str, str], ...]  # the internal token and the caller key


async def _open(to: SocketTarget, limit: int
                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that passed the hello; CallFailed (with the refusal's code, UNAVAILABLE for
    a socket that does not open or is another process's) otherwise."""
    try:
        reader, writer = await asyncio.open_unix_connection(to.path, limit=limit + LENGTH.size)
    except OSError as e:
        raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"{type(e).__name__}: {e}") from None
    try:
        hello = {"method": to.method, "metadata": [list(m) for m in to.metadata]}
        writer.write(frame(json.dumps(hello).encode()))
        answer = json.loads(await read_frame(reader, HELLO_MAX_BYTES))
        if answer.get("code"):
            raise CallFailed(CODES.get(answer["code"], grpc.StatusCode.UNKNOWN),
                             str(answer.get("message", "")))
        if answer.get("id") != to.socket_id:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE,
                             f"{to.path} answers as another process (id {answer.get('id')!r}, "
                             f"the service's is {to.socket_id!r}): a path of a service on "
                             "another host?")
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        writer.close()
        raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"{type(e).__name__}: {e}") from None
    except CallFailed:
        writer.close()
        raise
    return reader, writer


async def probe(to: SocketTarget, timeout: float) -> str:
    """Whether the call socket opens from here as the service and takes this gateway's calls:
    "" if so, else why not (checked when the service turns SERVING, before a call uses it)."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await _open(to, HELLO_MAX_BYTES)
    except TimeoutError:
        return f"no hello answer within {timeout:g} s"
    except CallFailed as e:
        return f"{e.code.name}: {e.details}"
    writer.close()
    return ""


class SocketCall:
    def __init__(self, to: SocketTarget, response_type: type, max_bytes: int,
                 on_failure: Callable[[str], None]) -> None:
        """on_failure(why): the socket could not be used (the upstream goes back to gRPC)."""
        self.to, self.response_type, self.max_bytes = to, response_type, max_bytes
        self.on_failure = on_failure
        self._writer: asyncio.StreamWriter | None = None
        self._opened = asyncio.ensure_future(self._connect())

    async def _connect(self) -> asyncio.StreamReader:
        try:
            reader, self._writer = await _open(self.to, self.max_bytes)
        except CallFailed as e:
            self.on_failure(f"{e.code.name}: {e.details}")
            raise
        return reader

    async def write(self, message: Any) -> None:
        await self._opened
        self._writer.write(frame(message.SerializeToString()))
        await self._writer.drain()

    async def read(self) -> Any:
        reader = await self._opened
        try:
            data = await read_frame(reader, self.max_bytes)
        except asyncio.IncompleteReadError:
            return grpc.aio.EOF
        return self.response_type.FromString(data)

    def cancel(self) -> None:
        self._opened.cancel()
        if self._writer is not None:
            self._writer.close()
