"""Which of the target's feature planes the draft reads now ("" = features travel in messages).

Negotiated whenever the pair changes (the target's planes - a restarted target has new ones - or
the draft coming back to SERVING): the target's planes are tried in the order of the transports
that both sides list (CUDA IPC first, then shared memory, then the target's feature stream), each
offered to the draft (Draft.AttachPlane), which attaches it only when it can actually reach it (a
CUDA IPC handle it can open, the same host's shared memory, the target's FeatureStream at the
address this gateway dials). Until one is attached, and when none can be, features
travel in messages: a draft that cannot reach the target's data plane falls back, it does not
fail. A request whose draft could not read a reference (DATA_LOSS) asks for a new negotiation
(at most MAX_RENEGOTIATIONS times per pair: a plane that keeps failing stays unused)."""
from __future__ import annotations

import asyncio
import logging

from dflash.v1 import common_pb2, draft_pb2, target_pb2
from gateway.upstream import Upstream, UpstreamError

log = logging.getLogger("dflash.gateway.planes")

PREFERENCE = ("cuda-ipc", "shm", "stream")
MAX_RENEGOTIATIONS = 3


class PlaneChoice:
    def __init__(self, timeout_s: float, target_address: str) -> None:
        self.plane_id = ""
        self.timeout_s = timeout_s
        self.target_address = target_address     # where a draft subscribes to a plane's feed
        self._key: tuple | None = None
        self._task: asyncio.Task | None = None
        self._pair: tuple | None = None          # the last (target caps, draft) refreshed
        self.failures = 0                        # failed() calls for this pair

    def refresh(self, tcaps: target_pb2.TargetCapabilities, draft: Upstream) -> None:
        """Called with a compatible, SERVING pair: negotiates again when the pair changed."""
        dcaps: draft_pb2.DraftCapabilities = draft.capabilities
        key = (tuple(p.plane_id for p in tcaps.feature_planes), draft.serving_epoch)
        if key == self._key:
            return
        if self._pair is None or key != self._pair[2]:
            self.failures = 0                    # a new pair: it may fail afresh
        self._key, self._pair = key, (tcaps, draft, key)
        self.plane_id = ""
        if self._task is not None:
            self._task.cancel()
        offers = sorted((p for p in tcaps.feature_planes
                         if p.transport in dcaps.feature_transports and p.transport in PREFERENCE),
                        key=lambda p: PREFERENCE.index(p.transport))
        if offers:
            self._task = asyncio.get_running_loop().create_task(self._attach(offers, draft, key))

    def failed(self) -> None:
        """A draft could not read a reference (a restart it has not re-attached after, or a
        plane it lost): features go in messages until it attaches a plane again, negotiated now."""
        if self.plane_id:
            log.warning("feature plane %s failed for a request; features travel in messages "
                        "until the draft attaches a plane again", self.plane_id)
        self.plane_id = ""
        self.failures += 1
        if self._pair is not None and self.failures <= MAX_RENEGOTIATIONS:
            tcaps, draft, _ = self._pair
            self._key = None
            self.refresh(tcaps, draft)

    def off(self) -> None:
        """No usable pair: nothing is attached."""
        self.plane_id = ""
        self._key = None

    async def _attach(self, offers: list, draft: Upstream, key: tuple) -> None:
        reasons = []
        for offer in offers:
            plane = common_pb2.FeaturePlane()
            plane.CopyFrom(offer)
            if not plane.address:         # a stream's rows, any plane's commit notices
                plane.address = self.target_address
            try:
                resp = await draft.call("AttachPlane", plane, self.timeout_s)
            except UpstreamError as e:
                reasons.append(f"{plane.transport}: {e.code.name} {e.details}")
                continue
            if resp.attached and self._key == key:
                self.plane_id = plane.plane_id
                log.info("features travel through the target's %s plane%s", plane.transport,
                         f" (not attached: {'; '.join(reasons)})" if reasons else "",
                         extra={"plane": plane.plane_id})
                return
            reasons.append(f"{plane.transport}: {resp.reason}")
        log.info("features travel in messages: the draft attached none of the target's planes "
                 "(%s)", "; ".join(reasons))
