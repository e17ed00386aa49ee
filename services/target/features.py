"""Feature transfer: the tapped layers' hidden states of the rows each sequence commits, brought
from the device to the host for the draft, or written to the sequence's feature plane."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from services.common.feature_plane import Publication
from services.target.publisher import FeaturePublisher
from services.target.sequence import TargetSequence

# where a request's rows go: (publication, its first row written) in a plane; None: to the host
Destination = tuple[Publication, int] | None


class FeatureFetch:
    """Collects (sequence, first row, rows, destination) requests over one forward's captured
    features [T, K*H] and moves them together: per distinct (layers, dtype) group - one in the
    usual case where every sequence asks for the same layers - one gather and one pinned
    device->host copy for the rows that go in messages, and one gather for the rows published
    in planes (then a copy into each publication), instead of one transfer per sequence."""

    def __init__(self, captured: torch.Tensor | None, capture: tuple[int, ...],
                 publisher: FeaturePublisher) -> None:
        self.captured, self.capture, self.publisher = captured, capture, publisher
        # (layers, dtype, first row of the sequence's part, its rows wanted, destination)
        self.requests: list[tuple[tuple[int, ...], torch.dtype, int, Sequence[int],
                                  Destination] | None] = []

    def add(self, seq: TargetSequence, first: int, rows: Sequence[int],
            dest: Destination = None) -> None:
        """rows: of the sequence's part of the forward, which starts at row `first`."""
        if self.captured is None or not seq.capture_layers:
            self.requests.append(None)
        else:
            self.requests.append((seq.capture_layers, seq.feature_dtype, first, rows, dest))

    def fetch(self) -> list[torch.Tensor | Publication | None]:
        """Per request, a host tensor [rows, len(layers)*H] in its dtype, the publication its
        rows were written to, or None (none asked)."""
        out: list[torch.Tensor | Publication | None] = [None] * len(self.requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(self.requests):
            if r is not None:
                groups.setdefault((r[0], r[1], r[4] is not None), []).append(i)
        for (layers, dtype, published), members in groups.items():
            rows = self._columns(self._rows(members), layers).to(dtype)
            host = to_host(rows) if not published or self._any_on_host(members) else None
            start = 0
            for i in members:
                n, dest = len(self.requests[i][3]), self.requests[i][4]
                if dest is None:
                    out[i] = host[start: start + n]
                else:
                    src = host if self.publisher.on_host(dest[0]) else rows
                    self.publisher.write(dest[0], dest[1], src[start: start + n])
                    out[i] = dest[0]
                start += n
        return out

    def _any_on_host(self, members: list[int]) -> bool:
        """Whether some member publishes in a host plane (its rows then come over in the
        group's one pinned copy, not a pageable copy each)."""
        return any(self.publisher.on_host(self.requests[i][4][0]) for i in members)

    def _rows(self, members: list[int]) -> torch.Tensor:
        """The requested rows of the members, in order (a slice when they are one range)."""
        spans = [(self.requests[i][2], self.requests[i][3]) for i in members]
        if len(spans) == 1 and isinstance(spans[0][1], range) and spans[0][1].step == 1:
            first, rows = spans[0]
            return self.captured[first + rows.start: first + rows.stop]
        index = torch.cat([torch.arange(first + rows.start, first + rows.stop)
                           if isinstance(rows, range) and rows.step == 1
                           else torch.tensor([first + r for r in rows], dtype=torch.int64)
                           for first, rows in spans])
        return self.captured.index_select(0, to_device_index(index, self.captured.device))

    def _columns(self, rows: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
        """The columns of `layers` (a subset of the batch's captured layers, in their order)."""
        if layers == self.capture:
            return rows
        h = rows.shape[-1] // len(self.capture)
        return torch.cat([rows[:, self.capture.index(layer) * h: (self.capture.index(layer) + 1) * h]
                          for layer in layers], dim=-1)


def to_device_index(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on `device` without waiting for the device: to a GPU through pinned
    memory, queued behind the work in flight (a pageable copy would first wait for all of it,
    e.g. the forward whose rows it selects)."""
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """One device->host copy into pinned memory (torch's caching host allocator reuses the
    block once the returned tensor is freed); CPU tensors are returned as they are."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host
