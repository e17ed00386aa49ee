"""The `stream` feature plane: a target's publications pushed to a draft on another host through
one server-streaming RPC (Target.FeatureStream), instead of through the gateway inside messages.

The target keeps a private host plane (PlaneWriter "stream": the same regions and records as a
shared-memory plane, in memory nobody else maps). Its engine thread reports what it wrote and
freed (StreamFeed.written / .freed) and, once the rows are on the host (after the step's sync),
flushes those events to every subscriber; the RPC handler reads the rows from the plane and sends
them in messages of about CHUNK_BYTES (several publications to a message; a prompt's rows chunk
by chunk while its prefill still runs). gRPC's flow control paces the sender; a draft that falls behind only keeps regions
reserved longer, and a full plane sends features in the answers instead (never an error).

The draft (StreamReader) mirrors the live publications: rows are copied into one host buffer per
publication as they arrive, dropped when the target frees the publication. A Propose whose ref
is not complete yet waits for it (the target answered after flushing, so its rows are already
on the way); a ref the stream cannot deliver - freed, never published, or the stream broke - is
DataLoss and the gateway sends the context again in messages.

Ordering: a publication's rows are sent in order, and its first rows after the first rows of
every publication with a smaller id (a step flushes in id order, and a publication is reserved
in the step that writes its first rows). So a ref to an id at or below the highest id seen that
is not held was freed: DataLoss at once, without waiting."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from dflash.v1 import common_pb2, target_pb2_grpc
from services.common.errors import DataLoss
from services.common.feature_plane import (
    PlaneInfo,
    PlaneRef,
    PlaneUnreachable,
    PlaneWriter,
    Publication,
)

log = logging.getLogger("dflash.feature_stream")

CHUNK_BYTES = 1 << 20               # rows per message: about this many bytes (at least one row)
ARRIVAL_TIMEOUT_S = 10.0            # a ref the stream has not started delivering: DataLoss after
OPEN_TIMEOUT_S = 10.0               # the target's first (empty) message must come within this
MAX_MESSAGE_BYTES = 64 << 20        # the draft's receive limit on the stream


# -- the target's side ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Rows:
    ref: PlaneRef
    first_row: int
    rows: int


class StreamFeed:
    """One plane's events, fanned out to its subscribers: a `stream` plane's rows and freed
    publications; any plane's commit notices (draft-ahead), to the subscribers that asked for
    them. written/freed/committed/flush: the engine thread; subscribe: the server's event loop."""

    def __init__(self, writer: PlaneWriter) -> None:
        self.writer = writer
        self.carries_rows = writer.transport == "stream"
        self._pending: list[_Rows | int] = []          # engine thread only
        self._commits: list[common_pb2.CommitNotice] = []
        self._subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, bool]] = []
        self._lock = threading.Lock()                  # guards _subscribers
        self.commit_subscribers = 0                    # read by the engine thread without the lock

    @property
    def plane_id(self) -> str:
        return self.writer.plane_id

    def written(self, pub: Publication, first_row: int, rows: int) -> None:
        if self.carries_rows:
            self._pending.append(_Rows(pub.ref, first_row, rows))

    def freed(self, pub: Publication) -> None:
        if self.carries_rows:
            self._pending.append(pub.ref.publication)

    def committed(self, notice: common_pb2.CommitNotice) -> None:
        """A Verify's commit, for the subscribers that asked (none: nothing is kept)."""
        if self.commit_subscribers:
            self._commits.append(notice)

    def flush(self) -> None:
        """After the rows written are on the host: every subscriber gets the events, rows in
        publication order (see the module's note on ordering), then the commit notices."""
        if not self._pending and not self._commits:
            return
        events = sorted(self._pending, key=lambda e: e.ref.publication if isinstance(e, _Rows)
                        else -1)
        commits, self._pending, self._commits = self._commits, [], []
        with self._lock:
            subscribers = list(self._subscribers)
        for loop, queue, wants_commits in subscribers:
            batch = (events, commits if wants_commits else [])
            if not batch[0] and not batch[1]:
                continue
            try:
                loop.call_soon_threadsafe(queue.put_nowait, batch)
            except RuntimeError:                       # its loop closed: the server is stopping
                pass

    async def subscribe(self, commits: bool = False
                        ) -> AsyncIterator[common_pb2.FeatureStreamMessage]:
        """The messages of one subscription: an empty one first (subscribed), then the events
        from now on, until the caller stops iterating. A large batch (a prompt's chunk) is
        copied into messages on a worker thread, so the server's loop keeps answering."""
        entry = (asyncio.get_running_loop(), asyncio.Queue(), commits)
        with self._lock:
            self._subscribers.append(entry)
            self.commit_subscribers += commits
        try:
            yield common_pb2.FeatureStreamMessage()
            while True:
                events, notices = await entry[1].get()
                big = sum(e.rows * e.ref.width * e.ref.dtype.itemsize
                          for e in events if isinstance(e, _Rows)) > CHUNK_BYTES
                messages = await asyncio.to_thread(self._messages, events) if big \
                    else self._messages(events)
                messages[-1].commits.extend(notices)
                for msg in messages:
                    yield msg
        finally:
            with self._lock:
                self._subscribers.remove(entry)
                self.commit_subscribers -= commits

    def _messages(self, events: list[_Rows | int]) -> list[common_pb2.FeatureStreamMessage]:
        """One flush's events in as few messages as fit about CHUNK_BYTES of rows each."""
        out = [common_pb2.FeatureStreamMessage()]
        size = 0
        for event in events:
            if isinstance(event, int):
                out[-1].freed.append(event)
                continue
            ref = event.ref
            row_bytes = ref.width * ref.dtype.itemsize
            first, end = event.first_row, event.first_row + event.rows
            while first < end:
                if size >= CHUNK_BYTES:
                    out.append(common_pb2.FeatureStreamMessage())
                    size = 0
                n = min(end - first, max(1, (CHUNK_BYTES - size) // row_bytes))
                data = self.writer.read_rows(ref, first, n)
                if data is None:                       # freed meanwhile: its `freed` follows
                    break
                out[-1].rows.add(ref=ref.to_pb(), first_row=first, data=data)
                size += len(data)
                first += n
        return out

# -- the draft's side ----------------------------------------------------------------------------
@dataclass
class _Incoming:
    """A publication as it arrives: rows [0, received) of buf are filled."""
    ref: PlaneRef | None = None                         # None: awaited, nothing arrived yet
    buf: torch.Tensor | None = None                     # uint8 [rows * width * itemsize]
    received: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: str = ""


class StreamReader:
    """An attached `stream` plane: a subscription to the target's FeatureStream."""

    def __init__(self, info: PlaneInfo, credentials: grpc.ChannelCredentials | None = None,
                 options: list[tuple[str, object]] | None = None,
                 on_broken: Callable[[str], None] | None = None,
                 metadata: tuple[tuple[str, str], ...] = (),
                 on_commit: Callable[[common_pb2.CommitNotice], None] | None = None) -> None:
        """on_commit: also subscribe to the plane's commit notices (draft-ahead), each handed
        to it on the event loop as it arrives (after the rows it refers to)."""
        if not info.address:
            raise PlaneUnreachable("a feature stream (a stream plane's rows, any plane's commit "
                                   "notices) needs the target's address")
        self.info = info
        self.on_broken = on_broken
        self.on_commit = on_commit
        self.metadata = metadata                       # the internal token, if any
        opts = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), *(options or [])]
        self.channel = (grpc.aio.secure_channel(info.address, credentials, options=opts)
                        if credentials is not None
                        else grpc.aio.insecure_channel(info.address, options=opts))
        self.pubs: dict[int, _Incoming] = {}
        self.seen = 0                                  # the highest publication id seen
        self.broken = ""                               # why the stream ended ("" = running)
        self._call = None
        self._task: asyncio.Task | None = None

    async def open(self) -> None:
        """Subscribes; raises PlaneUnreachable when the target does not answer as expected."""
        stub = target_pb2_grpc.TargetStub(self.channel)
        self._call = stub.FeatureStream(
            common_pb2.FeatureStreamRequest(plane_id=self.info.plane_id,
                                            commits=self.on_commit is not None),
            metadata=self.metadata)
        try:
            first = await asyncio.wait_for(self._call.read(), OPEN_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            await self.close()
            raise PlaneUnreachable(f"the target at {self.info.address} refused the feature "
                                   f"stream: {e.code().name} {e.details()}") from None
        except asyncio.TimeoutError:
            await self.close()
            raise PlaneUnreachable(f"the target at {self.info.address} did not open the feature "
                                   f"stream within {OPEN_TIMEOUT_S:.0f} s") from None
        if first is grpc.aio.EOF or first.rows or first.freed or first.commits:
            await self.close()
            raise PlaneUnreachable(f"the target at {self.info.address} did not open the feature "
                                   f"stream as expected")
        self._task = asyncio.get_running_loop().create_task(self._pump())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._call is not None:
            self._call.cancel()
        await self.channel.close()

    async def _pump(self) -> None:
        why = "the target closed the feature stream"
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:   # read(), as open()
                self._take(msg)
        except grpc.aio.AioRpcError as e:
            why = f"the feature stream from {self.info.address} broke: {e.code().name}"
        except Exception as e:
            log.exception("feature stream reader failed")
            why = f"the feature stream reader failed: {type(e).__name__}: {e}"
        except asyncio.CancelledError:
            self._break("the feature stream was closed")
            raise
        self._break(why)
        await self.channel.close()

    def _break(self, why: str) -> None:
        self.broken = why
        for entry in self.pubs.values():
            if not entry.done.is_set():
                entry.error = why
                entry.done.set()
        log.warning("feature stream ended: %s", why, extra={"plane": self.info.plane_id})
        if self.on_broken is not None:
            self.on_broken(why)

    def _take(self, msg: common_pb2.FeatureStreamMessage) -> None:
        for rows in msg.rows:
            self._take_rows(rows)
        for pub in msg.freed:
            entry = self.pubs.pop(pub, None)
            if entry is not None and not entry.done.is_set():
                entry.error = f"publication {pub} was freed before it was complete"
                entry.done.set()
        for notice in msg.commits if self.on_commit is not None else ():
            self.on_commit(notice)

    def _take_rows(self, piece: common_pb2.FeatureRows) -> None:
        ref = PlaneRef.from_pb(piece.ref)
        if ref.publication > self.seen:
            self.seen = ref.publication
            self._fail_skipped()
        entry = self.pubs.setdefault(ref.publication, _Incoming())
        if entry.buf is None:
            entry.ref = ref
            entry.buf = torch.empty(ref.nbytes, dtype=torch.uint8)
        row_bytes = ref.width * ref.dtype.itemsize
        start = piece.first_row * row_bytes
        if piece.first_row != entry.received or start + len(piece.data) > ref.nbytes:
            entry.error = (f"publication {ref.publication}: rows from {piece.first_row} arrived "
                           f"after {entry.received}")
            entry.done.set()
            return
        entry.buf[start: start + len(piece.data)].numpy()[:] = np.frombuffer(piece.data, np.uint8)
        entry.received += len(piece.data) // row_bytes
        if entry.received == ref.rows:
            entry.done.set()

    def _fail_skipped(self) -> None:
        """Awaited publications below the highest id seen that never started arriving: they
        will not (see the module's note on ordering)."""
        for pub, entry in list(self.pubs.items()):
            if entry.ref is None and pub < self.seen:
                del self.pubs[pub]
                entry.error = f"publication {pub} was freed (or never published)"
                entry.done.set()

    async def wait(self, ref: PlaneRef) -> None:
        """Until the ref's rows are all here; DataLoss when they will not be."""
        entry = self.pubs.get(ref.publication)
        if entry is None:
            if self.broken:
                raise DataLoss(f"feature plane {ref.plane}: {self.broken}")
            if ref.publication <= self.seen:
                raise DataLoss(self._stale(ref))
            entry = self.pubs[ref.publication] = _Incoming()
        try:
            await asyncio.wait_for(entry.done.wait(), ARRIVAL_TIMEOUT_S)
        except asyncio.TimeoutError:
            if entry.ref is None:                      # nothing arrived: forget the waiter
                self.pubs.pop(ref.publication, None)
                raise DataLoss(f"feature ref {ref.publication} of plane {ref.plane} did not "
                               f"arrive on the feature stream within {ARRIVAL_TIMEOUT_S:.0f} s"
                               ) from None
            await entry.done.wait()                    # arriving: until complete or broken
        if entry.error:
            raise DataLoss(f"feature plane {ref.plane}: {entry.error}")

    def read(self, ref: PlaneRef) -> torch.Tensor:
        """The rows of a ref that wait() saw complete, as [rows, width]."""
        entry = self.pubs.get(ref.publication)
        if entry is None or entry.ref is None or not entry.done.is_set() or entry.error:
            raise DataLoss(self._stale(ref))
        if entry.ref != ref:
            raise DataLoss(f"feature ref {ref.publication} in plane {ref.plane} does not match "
                           f"the publication the target sent ({entry.ref.rows} rows of "
                           f"{entry.ref.width} {entry.ref.dtype} at offset {entry.ref.offset})")
        return entry.buf.view(ref.dtype).view(ref.rows, ref.width)

    @staticmethod
    def _stale(ref: PlaneRef) -> str:
        return (f"feature ref {ref.publication} in plane {ref.plane} is stale: the target freed "
                f"it (or never published it); send these positions' features in the message")
