"""Context the draft has not received yet: target features (raw bytes, never decoded here),
their positions and token ids. Kept while the draft is down; sent with the next Propose."""
from __future__ import annotations

from collections.abc import Iterable

from dflash.v1 import common_pb2


class DraftFeed:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.dtype = ""
        self.width = 0                  # K*H
        self.rows = 0
        self.positions: list[int] = []
        self.token_ids: list[int] = []

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def clear(self) -> None:
        self.__init__()

    def append(self, features: common_pb2.TensorData | None, positions: Iterable[int],
               token_ids: Iterable[int]) -> None:
        """features [n, K*H] (or None / empty when the draft needs none) for these positions."""
        positions, token_ids = list(positions), list(token_ids)
        if features is not None and features.data:
            rows, width = int(features.shape[0]), int(features.shape[1])
            if rows != len(positions):
                raise ValueError(f"{rows} feature rows for {len(positions)} positions")
            if self.chunks and (features.dtype != self.dtype or width != self.width):
                raise ValueError(f"feature format changed from {self.dtype}[{self.width}] to "
                                 f"{features.dtype}[{width}]")
            self.chunks.append(features.data)
            self.dtype, self.width = features.dtype, width
            self.rows += rows
        self.positions += positions
        self.token_ids += token_ids

    def features(self) -> common_pb2.TensorData | None:
        """All pending rows as one tensor (raw bytes concatenate along rows)."""
        if not self.chunks:
            return None
        return common_pb2.TensorData(data=b"".join(self.chunks), dtype=self.dtype,
                                     shape=[self.rows, self.width])
