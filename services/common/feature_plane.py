"""Feature planes: memory in which a target publishes the features of committed positions, so
that a draft on the same host (`shm`, shared memory) or GPU (`cuda-ipc`) reads them there instead
of receiving them through the gateway inside messages (docs/architecture.md §3).

The target owns a plane (PlaneWriter): per publication (one Prefill, or one Verify's committed
rows) it reserves a region, writes the rows, and frees the region once the gateway says the draft
holds them (VerifyRequest.features_consumed) or the sequence goes. A draft attaches a plane
(PlaneReader) when the gateway asks (Draft.AttachPlane) and reads a FeatureRef as a view: no copy
until its forward consumes the rows. Ordering needs no signal of its own: a ref reaches the draft
only through the gateway, after the target answered, and the target answers after the rows are
written (a CUDA plane: after its stream synchronized).

Layout of a shm plane: a 64-byte header (magic, plane id), then regions. Each region starts with
a 64-byte record (magic, publication id, rows, width, itemsize) that the reader checks against
the ref, and that the writer clears when it frees the region: a stale or foreign ref is a clear
DataLoss, never wrong features. A CUDA plane's regions carry no record (checking one would cost
a device sync); its refs are checked against the plane's bounds."""
from __future__ import annotations

import base64
import json
import logging
import mmap
import os
import struct
import uuid
from dataclasses import dataclass

import torch

from dflash.v1 import common_pb2
from services.common.errors import DataLoss
from services.common.tensor_codec import WIRE_DTYPES, wire_dtype

log = logging.getLogger("dflash.feature_plane")

TRANSPORTS = ("cuda-ipc", "shm", "stream")    # in the order a gateway prefers them
SHM_DIR = "/dev/shm"
PREFIX = "dflash-features-"
ALIGN = 256                               # region alignment (bytes)
HEADER = 64                               # plane header, and each shm region's record
_MAGIC = b"DFLASHFP"
_RECORD = struct.Struct("<8sQIII")        # magic, publication, rows, width, itemsize
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}


class PlaneUnreachable(Exception):
    """A draft cannot attach a plane (not this host, not a reachable GPU, gone)."""


@dataclass(frozen=True)
class PlaneInfo:
    """What a target offers in its capabilities (FeaturePlane)."""
    transport: str
    plane_id: str
    size_bytes: int
    handle: bytes = b""                  # cuda-ipc: the buffer's IPC handle
    device_uuid: str = ""
    address: str = ""                    # stream: the target's HOST:PORT (the gateway fills it)

    def to_pb(self) -> common_pb2.FeaturePlane:
        return common_pb2.FeaturePlane(transport=self.transport, plane_id=self.plane_id,
                                       size_bytes=self.size_bytes, handle=self.handle,
                                       device_uuid=self.device_uuid, address=self.address)

    @staticmethod
    def from_pb(msg: common_pb2.FeaturePlane) -> PlaneInfo:
        return PlaneInfo(msg.transport, msg.plane_id, msg.size_bytes, msg.handle, msg.device_uuid,
                         msg.address)


@dataclass(frozen=True)
class PlaneRef:
    """Rows [rows, width] of `dtype` at `offset` bytes in plane `plane` (FeatureRef)."""
    plane: str
    publication: int
    offset: int
    rows: int
    width: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * self.dtype.itemsize

    def to_pb(self) -> common_pb2.FeatureRef:
        return common_pb2.FeatureRef(plane=self.plane, publication=self.publication,
                                     offset=self.offset, rows=self.rows, width=self.width,
                                     dtype=_DTYPE_NAMES[self.dtype])

    @staticmethod
    def from_pb(msg: common_pb2.FeatureRef) -> PlaneRef:
        return PlaneRef(msg.plane, msg.publication, msg.offset, msg.rows, msg.width,
                        wire_dtype(msg.dtype))


# -- allocation --------------------------------------------------------------------------------
class Extents:
    """First-fit allocation of ALIGN-aligned byte ranges in [start, end); frees coalesce."""

    def __init__(self, start: int, end: int) -> None:
        self.free: list[tuple[int, int]] = [(start, end - start)]     # (offset, size), sorted
        self.used = 0

    def alloc(self, nbytes: int) -> int | None:
        n = -(-nbytes // ALIGN) * ALIGN
        for i, (off, size) in enumerate(self.free):
            if size >= n:
                self.free[i:i + 1] = [(off + n, size - n)] if size > n else []
                self.used += n
                return off
        return None

    def release(self, offset: int, nbytes: int) -> None:
        n = -(-nbytes // ALIGN) * ALIGN
        self.used -= n
        i = next((k for k, (off, _) in enumerate(self.free) if off > offset), len(self.free))
        self.free.insert(i, (offset, n))
        for k in (i, i - 1):                    # merge with the next, then the previous
            if 0 <= k < len(self.free) - 1:
                (a, sa), (b, sb) = self.free[k], self.free[k + 1]
                if a + sa == b:
                    self.free[k:k + 2] = [(a, sa + sb)]


# -- backings ------------------------------------------------------------------------------------
class _ShmBacking:
    """A file in /dev/shm, mapped; `data` is a uint8 tensor over all of it."""
    transport, record = "shm", HEADER

    def __init__(self, path: str, size: int, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.size = path, size
        self.data = torch.frombuffer(self.map, dtype=torch.uint8)

    def info(self, plane_id: str) -> PlaneInfo:
        return PlaneInfo(self.transport, plane_id, self.size)


def pin_for(data: torch.Tensor, device: torch.device) -> bool:
    """Registers host memory `data` (a mapped plane) with CUDA as page-locked, so that copies
    between it and `device` are one DMA each way, without the driver's staging through a pinned
    bounce buffer or a CPU copy. For the process's life (planes stay mapped until exit). False:
    not a CUDA device, or the driver refused (e.g. the locked-memory limit): pageable copies."""
    if device.type != "cuda" or data.numel() == 0:
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel(), 0)
        ok = int(getattr(err, "value", err)) == 0 and data.is_pinned()
    except (RuntimeError, AttributeError, TypeError) as e:
        log.warning("could not register the feature plane with CUDA: %s", e)
        return False
    if not ok:
        log.warning("CUDA refused to register the feature plane (%s bytes): %s; copies to and "
                    "from it are staged", data.numel(), err)
    return ok


class _PrivateBacking:
    """Host memory only this process maps (a `stream` plane: its FeatureStream sends the rows);
    laid out as a shared-memory plane, records included (the sender checks them)."""
    transport, record = "stream", HEADER

    def __init__(self, size: int) -> None:
        self.data = torch.empty(size, dtype=torch.uint8)   # pages are taken as rows are written
        self.size = size

    def info(self, plane_id: str) -> PlaneInfo:
        return PlaneInfo(self.transport, plane_id, self.size)


class _CudaBacking:
    """One device buffer shared through CUDA IPC (torch's storage sharing)."""
    transport, record = "cuda-ipc", 0

    def __init__(self, size: int, device: torch.device) -> None:
        self.data = torch.empty(size, dtype=torch.uint8, device=device)
        self.size = size

    def info(self, plane_id: str) -> PlaneInfo:
        shared = self.data.untyped_storage()._share_cuda_()
        handle = json.dumps([base64.b64encode(x).decode() if isinstance(x, bytes) else x
                             for x in shared]).encode()
        uuid_ = str(torch.cuda.get_device_properties(self.data.device).uuid)
        return PlaneInfo(self.transport, plane_id, self.size, handle, uuid_)


def _open_cuda(info: PlaneInfo, device: torch.device) -> torch.Tensor:
    """The target's buffer as a uint8 tensor in this process (raises PlaneUnreachable)."""
    if device.type != "cuda":
        raise PlaneUnreachable("a cuda-ipc plane needs a draft on a CUDA device")
    try:
        fields = [base64.b64decode(x) if isinstance(x, str) else x
                  for x in json.loads(info.handle.decode())]
        torch.cuda.init()                # opening a handle in a process without a context crashes
        with torch.cuda.device(int(fields[0])):
            storage = torch.UntypedStorage._new_shared_cuda(*fields)
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
            storage, 0, (info.size_bytes,), (1,))
    except (RuntimeError, ValueError, TypeError) as e:   # another host's or GPU's handle, garbage
        raise PlaneUnreachable(f"cannot open the CUDA IPC handle: {type(e).__name__}: {e}") from None


def remove_stale_shm() -> None:
    """Planes left in /dev/shm by targets that died (kill -9): their pid is in the name."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _record(data: torch.Tensor, ref: PlaneRef) -> tuple:
    """The record before a ref's region in a plane with records (shm, stream), unpacked."""
    raw = data[ref.offset - HEADER: ref.offset - HEADER + _RECORD.size].numpy().tobytes()
    return _RECORD.unpack(raw)


def _expected_record(ref: PlaneRef) -> tuple:
    return (_MAGIC, ref.publication, ref.rows, ref.width, ref.dtype.itemsize)


# -- the target's side ---------------------------------------------------------------------------
@dataclass
class Publication:
    """A reserved region: the ref the draft gets, and the bytes it holds (record included)."""
    ref: PlaneRef
    region: int                          # the region's first byte (its record, for shm)
    nbytes: int


class PlaneWriter:
    """A plane the target publishes in (engine thread only)."""

    def __init__(self, transport: str, size_bytes: int, device: torch.device) -> None:
        self.plane_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.dma = False            # host memory registered with the CUDA device (pin_for)
        if transport == "shm":
            remove_stale_shm()
            self.backing = _ShmBacking(os.path.join(SHM_DIR, PREFIX + self.plane_id),
                                       size_bytes, create=True)
            self.backing.data[:HEADER].copy_(torch.frombuffer(
                bytearray(_MAGIC + self.plane_id.encode().ljust(HEADER - 8, b"\0")),
                dtype=torch.uint8))
            self.extents = Extents(ALIGN, size_bytes)       # the plane header: the first ALIGN bytes
            self.dma = pin_for(self.backing.data, device)
        elif transport == "stream":
            self.backing = _PrivateBacking(size_bytes)
            self.extents = Extents(ALIGN, size_bytes)
        elif transport == "cuda-ipc":
            self.backing = _CudaBacking(size_bytes, device)
            self.extents = Extents(0, size_bytes)
        else:
            raise ValueError(f"unknown feature plane transport {transport!r}; known: {TRANSPORTS}")
        self.info = self.backing.info(self.plane_id)
        self.publications = 0

    @property
    def transport(self) -> str:
        return self.backing.transport

    @property
    def on_host(self) -> bool:
        """Rows from a GPU are best brought to the host in one copy first: its memory is the
        host's and not registered with the device (a registered one takes them by DMA, like a
        device plane, and is synchronized before the answer the same way)."""
        return not isinstance(self.backing, _CudaBacking) and not self.dma

    def usage(self) -> float:
        return self.extents.used / self.backing.size

    def reserve(self, rows: int, width: int, dtype: torch.dtype) -> Publication | None:
        """A region for rows x width of dtype; None when the plane is full (the caller sends
        those features in the message instead)."""
        record = self.backing.record
        nbytes = record + rows * width * dtype.itemsize
        region = self.extents.alloc(nbytes)
        if region is None:
            return None
        self.publications += 1
        ref = PlaneRef(self.plane_id, self.publications, region + record, rows, width, dtype)
        if record:
            self._write_record(region, ref)
        return Publication(ref, region, nbytes)

    def write(self, pub: Publication, first_row: int, rows: torch.Tensor) -> None:
        """rows [n, width] (any device) into rows first_row..first_row+n-1 of the publication.
        A CUDA plane: the copy is queued on the current stream (synchronize before answering)."""
        ref = pub.ref
        row_bytes = ref.width * ref.dtype.itemsize
        start = ref.offset + first_row * row_bytes
        dst = self.backing.data[start: start + rows.shape[0] * row_bytes]
        dst.view(ref.dtype).view(rows.shape[0], ref.width).copy_(rows, non_blocking=True)

    def read_rows(self, ref: PlaneRef, first_row: int, rows: int) -> bytes | None:
        """A copy of rows first_row..first_row+rows-1 of a live publication of a host plane; None
        when it was freed (checked after the copy: a region freed, even reused, meanwhile has
        another record by then - publication ids are never reused)."""
        row_bytes = ref.width * ref.dtype.itemsize
        start = ref.offset + first_row * row_bytes
        data = self.backing.data[start: start + rows * row_bytes].numpy().tobytes()
        return data if self._record_is(ref) else None

    def _record_is(self, ref: PlaneRef) -> bool:
        return _record(self.backing.data, ref) == _expected_record(ref)

    def free(self, pub: Publication) -> None:
        if self.backing.record:
            self.backing.data[pub.region: pub.region + HEADER].zero_()
        self.extents.release(pub.region, pub.nbytes)

    def close(self) -> None:
        if isinstance(self.backing, _ShmBacking):
            try:
                os.unlink(self.backing.path)
            except OSError:
                pass

    def _write_record(self, region: int, ref: PlaneRef) -> None:
        raw = _RECORD.pack(_MAGIC, ref.publication, ref.rows, ref.width, ref.dtype.itemsize)
        self.backing.data[region: region + len(raw)].copy_(
            torch.frombuffer(bytearray(raw), dtype=torch.uint8))


# -- the draft's side ----------------------------------------------------------------------------
def join_rows(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Rows of consecutive positions - views of messages (host) or of planes (host, or a GPU) -
    as one tensor: one piece as it is, pieces on one device joined there, mixed ones on
    `device`."""
    if len(parts) == 1:
        return parts[0]
    if len({p.device for p in parts}) == 1:
        return torch.cat(parts)
    return torch.cat([p.to(device) for p in parts])


class PlaneReader:
    """An attached plane: refs in it become tensor views."""

    def __init__(self, info: PlaneInfo, device: torch.device) -> None:
        self.info = info
        if info.transport == "shm":
            self.data = self._open_shm(info)
            self.record = HEADER
            pin_for(self.data, device)      # rows reach the draft's GPU by DMA
        elif info.transport == "cuda-ipc":
            self.data = _open_cuda(info, device)
            self.record = 0
        else:
            raise PlaneUnreachable(f"unknown transport {info.transport!r}; known: {TRANSPORTS}")

    @staticmethod
    def _open_shm(info: PlaneInfo) -> torch.Tensor:
        path = os.path.join(SHM_DIR, PREFIX + info.plane_id)
        if "/" in info.plane_id or not os.path.exists(path):
            raise PlaneUnreachable(f"no shared memory {path} here: the target is on another "
                                   f"host or in another IPC namespace, or gone")
        backing = _ShmBacking(path, 0, create=False)
        header = bytes(backing.map[:HEADER])
        if header[:8] != _MAGIC or header[8:].rstrip(b"\0") != info.plane_id.encode():
            raise PlaneUnreachable(f"{path} is not feature plane {info.plane_id}")
        if backing.size != info.size_bytes:
            raise PlaneUnreachable(f"{path} holds {backing.size} bytes, the target offered "
                                   f"{info.size_bytes}")
        return backing.data

    def read(self, ref: PlaneRef) -> torch.Tensor:
        """A view [rows, width] of the ref's rows (raises DataLoss when the ref is not valid)."""
        end = ref.offset + ref.nbytes
        if ref.offset < self.record or end > self.data.shape[0] or ref.offset % ALIGN != (
                self.record % ALIGN):
            raise DataLoss(f"feature ref out of plane {ref.plane}'s bounds (offset {ref.offset}, "
                           f"{ref.nbytes} bytes, plane of {self.data.shape[0]} bytes)")
        if self.record:
            self._check_record(ref)
        return self.data[ref.offset: end].view(ref.dtype).view(ref.rows, ref.width)

    def _check_record(self, ref: PlaneRef) -> None:
        magic, pub, *_ = found = _record(self.data, ref)
        if found != _expected_record(ref):
            raise DataLoss(f"feature ref {ref.publication} in plane {ref.plane} is stale: the "
                           f"region holds publication {pub if magic == _MAGIC else 'none'} "
                           f"(freed or reused); send these positions' features in the message")
