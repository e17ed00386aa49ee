"""The per-step call streams (Target.VerifyStream, Draft.ProposeStream) on a unix socket of this
host (`--call-socket PATH`): the same messages and the same server-side plumbing as the gRPC
<M>Stream (services/common/call_stream.py serves both), without gRPC's transport. On one host a
gRPC message crosses grpc's own threads and its completion-queue poller before asyncio sees it;
here it is one read on the event loop (docs/benchmarks.md, "Per-step wire").

Protocol, per connection (every frame: a little-endian uint32 length, then that many bytes):

    client -> hello     JSON {"method": "Verify", "metadata": [[key, value], ...]}: the stream's
                        method and what a gRPC call would carry (the internal token, the
                        caller key)
    server -> answer    JSON {"code": 0, "id": ...} (then the calls; id: this process's random
                        id, which its capabilities give as call_socket_id), or {"code": N,
                        "message": ...} (a gRPC status code: UNAUTHENTICATED, UNIMPLEMENTED)
                        and the connection ends
    client -> calls     <M>StreamRequest messages; server -> <M>StreamResponse messages

A frame that is not a valid <M>StreamRequest (or longer than --max-message-mib) ends the
connection (it carries no call_id to answer); the client's calls in flight then fail UNAVAILABLE,
as on a broken gRPC stream. While the service drains, calls that would start new work are
answered UNAVAILABLE, as the guard answers them on gRPC. The socket is made readable by this
user only; a service with TLS does not open one (callers' identities come from certificates)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common import internal_auth
from services.common.call_stream import Refused
from services.common.errors import Unavailable
from services.common.guard import Drain

log = logging.getLogger("dflash.call_socket")

LENGTH = struct.Struct("<I")
HELLO_MAX_BYTES = 64 * 1024


def frame(data: bytes) -> bytes:
    return LENGTH.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    """The next frame's bytes; IncompleteReadError at the end of the connection, ValueError
    past `limit` bytes."""
    (n,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if n > limit:
        raise ValueError(f"a frame of {n} bytes passes the limit of {limit}")
    return await reader.readexactly(n)


@dataclass(frozen=True)
class SocketMethod:
    """One <M>Stream served on the socket: its handler (the servicer's <M>Stream method:
    (requests, context) -> None) and its request type (<M>StreamRequest)."""
    handler: Callable[[AsyncIterator, Any], Any]
    request_type: type


class _Context:
    """What call_stream.serve and callers.owner read of a gRPC ServicerContext."""

    def __init__(self, writer: asyncio.StreamWriter, metadata: tuple[tuple[str, str], ...]):
        self.writer, self.metadata = writer, metadata

    async def write(self, reply: Any) -> None:
        self.writer.write(frame(reply.SerializeToString()))
        await self.writer.drain()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def auth_context(self) -> dict:
        return {}                       # no certificates on a unix socket


class CallSocket:
    """Listens on `path` (replacing a stale socket file) and serves each connection's calls."""

    def __init__(self, path: str, methods: dict[str, SocketMethod], token: str,
                 drain: Drain | None, max_bytes: int) -> None:
        """methods: by call name ("Verify"); drain: the service's (its refusals, as the guard
        answers them on gRPC)."""
        self.path, self.methods, self.token = path, methods, token
        self.drain, self.max_bytes = drain, max_bytes
        self.id = secrets.token_hex(8)         # answered in every hello (call_socket_id)
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._server = await asyncio.start_unix_server(self._serve, self.path,
                                                       limit=self.max_bytes + LENGTH.size)
        os.chmod(self.path, 0o600)
        log.info("per-step calls also on unix socket %s", self.path)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        try:
            opened = await self._hello(reader, writer)
            if opened is not None:
                name, metadata = opened
                method = self.methods[name]
                await method.handler(self._requests(reader, method.request_type, name),
                                     _Context(writer, metadata))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass                                   # the client went away
        except asyncio.CancelledError:             # close(): the connection's task ends here
            pass                                   # (asyncio logs a cancelled handler task)
        except ValueError as e:                    # an undecodable or oversized frame
            log.warning("call socket connection ended: %s", e)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                     ) -> tuple[str, tuple[tuple[str, str], ...]] | None:
        """(method, metadata) once the hello is accepted; None after answering a refusal."""
        try:
            hello = json.loads(await read_frame(reader, HELLO_MAX_BYTES))
            name = str(hello["method"])
            metadata = tuple((str(k), str(v)) for k, v in hello.get("metadata", []))
        except (ValueError, KeyError, TypeError) as e:
            return await self._refuse(writer, grpc.StatusCode.INVALID_ARGUMENT,
                                      f"the hello is not {{\"method\": ..., \"metadata\": ...}} "
                                      f"JSON ({e})")
        if name not in self.methods:
            return await self._refuse(writer, grpc.StatusCode.UNIMPLEMENTED,
                                      f"no {name!r} calls on this socket; it carries "
                                      f"{sorted(self.methods)}")
        if not internal_auth.allowed(self.token, metadata):
            return await self._refuse(writer, grpc.StatusCode.UNAUTHENTICATED,
                                      f"{name} needs this service's internal token (metadata "
                                      f"{internal_auth.HEADER})")
        writer.write(frame(json.dumps({"code": 0, "id": self.id}).encode()))
        return name, metadata

    async def _refuse(self, writer: asyncio.StreamWriter, code: grpc.StatusCode,
                      message: str) -> None:
        writer.write(frame(json.dumps({"code": code.value[0], "message": message}).encode()))
        await writer.drain()

    async def _requests(self, reader: asyncio.StreamReader, request_type: type, name: str
                        ) -> AsyncIterator:
        """The connection's calls until it ends (each one the drain refuses as a Refused)."""
        while True:
            try:
                data = await read_frame(reader, self.max_bytes)
            except asyncio.IncompleteReadError:
                return
            try:
                message = request_type.FromString(data)
            except Exception as e:  # noqa: BLE001 - any parse failure is the client's bad input
                raise ValueError(f"a frame is not a valid {request_type.DESCRIPTOR.full_name} "
                                 f"({type(e).__name__})") from None
            why = (None if message.cancel or self.drain is None
                   else self.drain.refusal(name, message.request))
            yield message if why is None else Refused(message, Unavailable(why))
