"""Context the draft has not received yet: the token ids of consecutive positions from `start` on
and their target features, as chunks that are either raw bytes (never decoded here) or
references into a target's feature plane (the bytes stay on the target's host or GPU). Kept while
the draft is down; sent with the next Propose."""
from __future__ import annotations

from dflash.v1 import common_pb2
from services.common.wire_dtypes import ITEM_BYTES


def answer_chunk(resp) -> common_pb2.FeatureChunk | None:
    """A Prefill or Verify answer's features as a chunk (None: the answer has none)."""
    if resp.HasField("feature_ref"):
        return common_pb2.FeatureChunk(ref=resp.feature_ref)
    if resp.features.data:
        return common_pb2.FeatureChunk(inline=resp.features)
    return None


def chunk_format(chunk: common_pb2.FeatureChunk) -> tuple[int, int, str]:
    """(rows, width, dtype) of a chunk."""
    if chunk.HasField("ref"):
        return chunk.ref.rows, chunk.ref.width, chunk.ref.dtype
    t = chunk.inline
    return int(t.shape[0]), int(t.shape[1]), t.dtype


def chunk_nbytes(chunk: common_pb2.FeatureChunk) -> int:
    """Bytes the chunk's rows hold, wherever they are."""
    rows, width, dtype = chunk_format(chunk)
    return rows * width * ITEM_BYTES[dtype]


class DraftFeed:
    def __init__(self, start: int = 0) -> None:
        self.start = start              # the first position not sent yet
        self.chunks: list[common_pb2.FeatureChunk] = []
        self.dtype = ""
        self.width = 0                  # K*H
        self.nbytes = 0                 # inline bytes held here (refs hold the target's memory)
        self.token_ids: list[int] = []

    @property
    def end(self) -> int:
        """The position the next appended token takes."""
        return self.start + len(self.token_ids)

    @property
    def positions(self) -> list[int]:
        return list(range(self.start, self.end))

    def reset(self) -> None:
        """Nothing pending, and the next token is position 0 (a rebuild sends everything)."""
        self.__init__()

    def sent(self) -> None:
        """The draft took everything pending: the next token continues after it."""
        self.__init__(self.end)

    def append(self, chunk: common_pb2.FeatureChunk | None, token_ids: list[int]) -> None:
        """The features [n, K*H] (or None when the draft needs none) of the next n positions."""
        if chunk is not None:
            rows, width, dtype = chunk_format(chunk)
            if rows != len(token_ids):
                raise ValueError(f"{rows} feature rows for {len(token_ids)} positions")
            if self.chunks and (dtype != self.dtype or width != self.width):
                raise ValueError(f"feature format changed from {self.dtype}[{self.width}] to "
                                 f"{dtype}[{width}]")
            self.chunks.append(chunk)
            self.dtype, self.width = dtype, width
            if chunk.HasField("inline"):
                self.nbytes += len(chunk.inline.data)
        self.token_ids += token_ids
