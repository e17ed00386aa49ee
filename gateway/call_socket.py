"""--wire socket: a call stream (gateway/call_stream.py) carried by a service's unix call socket
(services/common/call_socket.py: the protocol) instead of a gRPC <M>Stream, when the service
advertises one in its capabilities and it opens from this host; else the gRPC stream.

SocketCall is what CallStream needs of a gRPC bidirectional call: write, read (grpc.aio.EOF at
the end), cancel. It connects on first use; a refused or failed connection fails the calls in
flight like a broken stream (UNAVAILABLE), and the upstream's next stream goes over gRPC."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import grpc

from gateway.call_stream import CODES, CallFailed
from services.common.call_socket import HELLO_MAX_BYTES, frame, read_frame


class SocketCall:
    def __init__(self, path: str, method: str, metadata: tuple[tuple[str, str], ...],
                 response_type: type, max_bytes: int, on_failure: Callable[[str], None]) -> None:
        """on_failure(why): the socket could not be used (the upstream goes back to gRPC)."""
        self.path, self.method, self.metadata = path, method, metadata
        self.response_type, self.max_bytes, self.on_failure = response_type, max_bytes, on_failure
        self._writer: asyncio.StreamWriter | None = None
        self._opened = asyncio.ensure_future(self._open())

    async def _open(self) -> asyncio.StreamReader:
        try:
            reader, self._writer = await asyncio.open_unix_connection(
                self.path, limit=self.max_bytes + 4)
            hello = {"method": self.method, "metadata": [list(m) for m in self.metadata]}
            self._writer.write(frame(json.dumps(hello).encode()))
            answer = json.loads(await read_frame(reader, HELLO_MAX_BYTES))
        except (OSError, ValueError, asyncio.IncompleteReadError) as e:
            self.on_failure(f"{type(e).__name__}: {e}")
            raise CallFailed(grpc.StatusCode.UNAVAILABLE,
                             f"call socket {self.path} did not open: {e}") from None
        if answer.get("code"):
            code = CODES.get(answer["code"], grpc.StatusCode.UNKNOWN)
            self.on_failure(f"{code.name}: {answer.get('message', '')}")
            raise CallFailed(code, answer.get("message", ""))
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


async def probe(path: str, method: str, metadata: tuple[tuple[str, str], ...],
                timeout: float) -> str:
    """Whether the call socket opens from here and takes this gateway's calls: "" if so, else
    why not (checked when the service turns SERVING, before any call is sent on it)."""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(path)
            hello = {"method": method, "metadata": [list(m) for m in metadata]}
            writer.write(frame(json.dumps(hello).encode()))
            answer = json.loads(await read_frame(reader, HELLO_MAX_BYTES))
    except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    if answer.get("code"):
        code = CODES.get(answer["code"], grpc.StatusCode.UNKNOWN)
        return f"{code.name}: {answer.get('message', '')}"
    return ""
