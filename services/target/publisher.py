"""The target's feature planes and what each sequence has published in them (engine thread).

A sequence prefilled with `feature_plane` set publishes there: its Prefill as one publication of
every prompt row (reserved at the first chunk, each chunk writes its rows), each Verify's
committed rows as one more. A publication is freed when a Verify says the draft holds the
positions it covers (features_consumed), or when the sequence goes. A plane that is full, or one
this target does not have (it restarted since the gateway chose it), means the features go in
the message: never an error. A `stream` plane also reports what is written and freed to its
feed (services/common/feature_stream.py), flushed once the rows are on the host; every plane's
feed tells its commit subscribers what each Verify committed (draft-ahead)."""
from __future__ import annotations

import atexit
import logging

import torch

from dflash.v1 import common_pb2
from services.common.feature_plane import PlaneInfo, PlaneWriter, Publication
from services.common.feature_stream import StreamFeed
from services.target.sequence import TargetSequence

log = logging.getLogger("dflash.target.publisher")


def plane_transports(choice: str, device: torch.device) -> list[str]:
    """--feature-plane (checked by TargetConfig) -> the transports to offer (auto: CUDA IPC on a
    CUDA device, and shared memory and the feature stream everywhere)."""
    if choice == "auto":
        return (["cuda-ipc"] if device.type == "cuda" else []) + ["shm", "stream"]
    return [] if choice == "off" else [choice]


class FeaturePublisher:
    def __init__(self, transports: list[str], size_bytes: int, device: torch.device) -> None:
        self.writers: dict[str, PlaneWriter] = {}
        self.feeds: dict[str, StreamFeed] = {}          # each plane's subscribers
        for transport in transports:
            try:
                writer = PlaneWriter(transport, size_bytes, device)
            except (OSError, RuntimeError) as e:    # no /dev/shm, no memory: in-band only
                log.warning("feature plane %s unavailable: %s", transport, e)
                continue
            self.writers[writer.plane_id] = writer
            self.feeds[writer.plane_id] = StreamFeed(writer)
            atexit.register(writer.close)
            log.info("feature plane ready", extra={"plane": writer.plane_id,
                                                  "transport": transport, "bytes": size_bytes})
        self.device_writes = False       # CUDA copies queued since the last sync()

    def planes(self) -> list[PlaneInfo]:
        return [w.info for w in self.writers.values()]

    def reserve(self, seq: TargetSequence, rows: int, width: int, end: int
                ) -> Publication | None:
        """A publication of `rows` positions ending before position `end` for the sequence, in
        its plane; None: send them in the message."""
        writer = self.writers.get(seq.feature_plane)
        if writer is None:
            return None
        pub = writer.reserve(rows, width, seq.feature_dtype)
        if pub is not None:
            seq.publications.append((pub, end))
        return pub

    def on_host(self, pub: Publication) -> bool:
        return self.writers[pub.ref.plane].on_host

    def write(self, pub: Publication, first_row: int, rows: torch.Tensor) -> None:
        """rows [n, width]: host rows for a host plane (FeatureFetch brings a batch's over in one
        copy), any device's for a CUDA plane."""
        writer = self.writers[pub.ref.plane]
        writer.write(pub, first_row, rows)
        self.device_writes |= not writer.on_host
        if (feed := self.feeds.get(pub.ref.plane)) is not None:
            feed.written(pub, first_row, rows.shape[0])

    def committed(self, seq: TargetSequence, start: int, token_ids: list[int], next_anchor: int,
                  pub: Publication) -> None:
        """A Verify committed positions start.. (tokens `token_ids`, features in `pub`): its
        plane's commit subscribers hear of it with the answer (draft-ahead)."""
        feed = self.feeds.get(pub.ref.plane)
        if feed is not None and feed.commit_subscribers:
            feed.committed(common_pb2.CommitNotice(sequence_key=seq.seq_id, start=start,
                                                   token_ids=token_ids, next_anchor=next_anchor,
                                                   ref=pub.ref.to_pb()))

    def sync(self, device: torch.device) -> None:
        """Before answering: a draft in another process reads what was written."""
        if self.device_writes:
            torch.cuda.current_stream(device).synchronize()
            self.device_writes = False

    def flush(self) -> None:
        """Stream planes: what was written (on the host by now) and freed goes to the feeds'
        subscribers. Called before every answer and after every step."""
        for feed in self.feeds.values():
            feed.flush()

    def consumed(self, seq: TargetSequence, position: int) -> None:
        """The draft holds the positions below `position`: publications ending there are freed."""
        keep = []
        for pub, end in seq.publications:
            if end <= position:
                self._free(pub)
            else:
                keep.append((pub, end))
        seq.publications = keep

    def drop(self, seq: TargetSequence) -> None:
        for pub, _ in seq.publications:
            self._free(pub)
        seq.publications = []

    def _free(self, pub: Publication) -> None:
        self.writers[pub.ref.plane].free(pub)
        if (feed := self.feeds.get(pub.ref.plane)) is not None:
            feed.freed(pub)

    def usage(self) -> float:
        return max((w.usage() for w in self.writers.values()), default=0.0)
