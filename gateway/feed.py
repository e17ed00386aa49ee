"""Context the draft has not received yet: target features (raw bytes, never decoded here) and
token ids of consecutive positions from `start` on. Kept while the draft is down; sent with the
next Propose."""
from __future__ import annotations

from dflash.v1 import common_pb2


class DraftFeed:
    def __init__(self, start: int = 0) -> None:
        self.start = start              # the first position not sent yet
        self.chunks: list[bytes] = []
        self.dtype = ""
        self.width = 0                  # K*H
        self.rows = 0
        self.token_ids: list[int] = []

    @property
    def end(self) -> int:
        """The position the next appended token takes."""
        return self.start + len(self.token_ids)

    @property
    def positions(self) -> list[int]:
        return list(range(self.start, self.end))

    @property
    def nbytes(self) -> int:
        return sum(len(c) for c in self.chunks)

    def reset(self) -> None:
        """Nothing pending, and the next token is position 0 (a rebuild sends everything)."""
        self.__init__()

    def sent(self) -> None:
        """The draft took everything pending: the next token continues after it."""
        self.__init__(self.end)

    def append(self, features: common_pb2.TensorData | None, token_ids: list[int]) -> None:
        """features [n, K*H] (or None / empty when the draft needs none) of the next n positions."""
        if features is not None and features.data:
            rows, width = int(features.shape[0]), int(features.shape[1])
            if rows != len(token_ids):
                raise ValueError(f"{rows} feature rows for {len(token_ids)} positions")
            if self.chunks and (features.dtype != self.dtype or width != self.width):
                raise ValueError(f"feature format changed from {self.dtype}[{self.width}] to "
                                 f"{features.dtype}[{width}]")
            self.chunks.append(features.data)
            self.dtype, self.width = features.dtype, width
            self.rows += rows
        self.token_ids += token_ids

    def features(self) -> common_pb2.TensorData | None:
        """All pending rows as one tensor (raw bytes concatenate along rows)."""
        if not self.chunks:
            return None
        return common_pb2.TensorData(data=b"".join(self.chunks), dtype=self.dtype,
                                     shape=[self.rows, self.width])
