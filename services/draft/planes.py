"""The target feature planes a draft has attached (Draft.AttachPlane), by plane id: shared memory
and CUDA IPC planes are mapped here (PlaneReader), a `stream` plane is a subscription to the
target's FeatureStream (StreamReader). A Propose's refs are awaited (a stream's rows may still be
on the way), then read as tensors; a ref no attached plane can give is DataLoss. With draft-ahead
on, every attached plane's commit notices are subscribed to as well (a stream plane's on its own
subscription, a mapped plane's on one of their own) and handed to `on_commit`."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import torch

from dflash.v1 import common_pb2
from services.common import internal_auth
from services.common.errors import DataLoss
from services.common.feature_plane import (
    TRANSPORTS,
    PlaneInfo,
    PlaneReader,
    PlaneRef,
    PlaneUnreachable,
)
from services.common.feature_stream import StreamReader
from services.common.tls import ClientTls

log = logging.getLogger("dflash.draft.planes")


class AttachedPlanes:
    def __init__(self, device: torch.device, stream_tls: ClientTls | None = None,
                 internal_token: str = "") -> None:
        self.device = device
        self.stream_tls = stream_tls or ClientTls()    # how a stream plane's target is reached
        self.internal_token = internal_token           # ... and what it must carry
        self.readers: dict[str, PlaneReader | StreamReader] = {}
        # draft-ahead: each attached plane's commit notices go here (None: not subscribed)
        self.on_commit: Callable[[common_pb2.CommitNotice], None] | None = None
        self.notices: dict[str, StreamReader] = {}      # a mapped plane's notice subscription

    @property
    def transports(self) -> list[str]:
        """What it can read: shared memory and streams always; CUDA IPC on a CUDA device."""
        return [t for t in TRANSPORTS if t != "cuda-ipc" or self.device.type == "cuda"]

    async def attach(self, info: PlaneInfo) -> str:
        """"" when attached (or already), else why not."""
        if info.plane_id in self.readers:
            return ""
        if info.transport not in self.transports:
            return f"transport {info.transport!r} not readable here (readable: {self.transports})"
        try:
            if info.transport == "stream":
                reader = self._stream_reader(info, self.readers, self.on_commit)
                await reader.open()
            else:
                reader = await asyncio.to_thread(PlaneReader, info, self.device)
        except (PlaneUnreachable, OSError, ValueError) as e:
            return str(e)
        self.readers[info.plane_id] = reader
        log.info("feature plane attached", extra={"plane": info.plane_id,
                                                 "transport": info.transport})
        if self.on_commit is not None:
            if info.transport == "stream":
                log.info("draft-ahead: commit notices subscribed", extra={"plane": info.plane_id})
            else:
                await self._subscribe_commits(info)
        return ""

    async def _subscribe_commits(self, info: PlaneInfo) -> None:
        """Draft-ahead on a mapped plane: its commit notices come over the target's
        FeatureStream. Not reached (no address, an older target): no draft-ahead, nothing else."""
        try:
            sub = self._stream_reader(info, self.notices, self.on_commit)
            await sub.open()
        except (PlaneUnreachable, OSError, ValueError) as e:
            log.warning("no draft-ahead on feature plane %s: %s", info.plane_id, e)
            return
        self.notices[info.plane_id] = sub
        log.info("draft-ahead: commit notices subscribed", extra={"plane": info.plane_id})

    def _stream_reader(self, info: PlaneInfo, table: dict, on_commit) -> StreamReader:
        tls = self.stream_tls

        def lost(why: str) -> None:                     # the stream ended: detached
            table.pop(info.plane_id, None)

        return StreamReader(info, tls.credentials() if tls.enabled else None,
                            tls.channel_options(), on_broken=lost,
                            metadata=internal_auth.metadata(self.internal_token),
                            on_commit=on_commit)

    async def arrive(self, refs: Iterable[PlaneRef]) -> None:
        """Until every ref of a stream plane is here (DataLoss when one will not be)."""
        for ref in refs:
            reader = self.readers.get(ref.plane)
            if isinstance(reader, StreamReader):
                await reader.wait(ref)

    def read(self, ref: PlaneRef) -> torch.Tensor:
        reader = self.readers.get(ref.plane)
        if reader is None:
            raise DataLoss(f"feature plane {ref.plane!r} is not attached here (attached: "
                           f"{sorted(self.readers) or 'none'}); send the features in the message")
        return reader.read(ref)
