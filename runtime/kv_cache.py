"""Paged KV cache: one pool of fixed-size pages shared by all sequences, page tables per sequence."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class OutOfPages(Exception):
    """Raised when the pool cannot hold a sequence's next tokens."""


@dataclass
class PageTable:
    """The pages one sequence owns, in position order. Position p lives in
    slot pages[p // page_size] * page_size + p % page_size."""
    pages: list[int] = field(default_factory=list)


class PagedKVCache:
    """K and V for every layer, as flat slot arrays: k[layer] is [num_pages * page_size, nkv, hd].
    Page 0 is reserved as a scratch page (padding writes land there), so usable pages are 1..N-1."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 num_pages: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV budget gives {num_pages} pages; at least 2 are needed")
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first

    @staticmethod
    def bytes_per_page(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                       dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.usable_pages - self.free_pages

    def usage(self) -> float:
        return self.used_pages / self.usable_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def ensure(self, table: PageTable, num_tokens: int) -> None:
        """Grow `table` to hold positions [0, num_tokens). All or nothing."""
        need = self.pages_for(num_tokens) - len(table.pages)
        if need <= 0:
            return
        if need > len(self._free):
            raise OutOfPages(f"KV cache full: {need} more pages needed, {len(self._free)} free "
                             f"of {self.usable_pages} ({self.page_size} tokens per page)")
        table.pages.extend(self._free.pop() for _ in range(need))

    def trim(self, table: PageTable, num_tokens: int) -> None:
        """Return pages past what positions [0, num_tokens) need."""
        keep = self.pages_for(num_tokens)
        while len(table.pages) > keep:
            self._free.append(table.pages.pop())

    def release(self, table: PageTable) -> None:
        self._free.extend(reversed(table.pages))
        table.pages.clear()

    def slots(self, table: PageTable, start: int, end: int) -> list[int]:
        """Flat slot ids of positions [start, end) (pages must already exist)."""
        return self.slots_of(table, range(start, end))

    def copy_positions(self, table: PageTable, src: list[int], dst: list[int]) -> None:
        """K/V of positions src[i] -> positions dst[i], every layer (a verified tree's accepted
        path moved into place). All sources are read before any destination is written."""
        s = torch.tensor(self.slots_of(table, src), device=self.k.device)
        d = torch.tensor(self.slots_of(table, dst), device=self.k.device)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]

    def slots_of(self, table: PageTable, positions) -> list[int]:
        """Flat slot ids of the given positions (pages must already exist)."""
        ps = self.page_size
        return [table.pages[p // ps] * ps + p % ps for p in positions]
