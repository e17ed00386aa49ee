"""Prefix caching for a paged KV cache: full pages keyed by a chain of page hashes.

Page i of a sequence is keyed by hash(key of page i-1, the page's tokens), so one key names a
page's tokens and everything before them: two sequences whose first k pages hold the same
tokens find the same k pages. A chain of hashes rather than a radix tree: lookups walk a
prompt page by page either way, a dict needs no tree surgery on insert or eviction, and the
same keys serve the target and the draft (each computes them over its own page size).

Pages are reference-counted (PagedKVCache holds the counts; several sequences may share a
cached page). Only full pages whose every position holds committed KV are ever inserted: a
verify block's rows past the accepted length are beyond the sequence's committed length, so a
page they touched is not full yet, and by the time it is, the next blocks overwrote them. A
cached page nobody references stays in the cache, least-recently-used first in line, until
the pool needs it (or the cache holds more of them than its cap)."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

ROOT = b"dflash-prefix-v1"              # the key before a sequence's first page


def page_keys(tokens: list[int], page_size: int, start: int = 0,
              parent: bytes = ROOT) -> list[bytes]:
    """Keys of the full pages of `tokens` from page `start` on (`parent`: page start-1's key)."""
    keys = []
    for i in range(start, len(tokens) // page_size):
        page = array("I", tokens[i * page_size: (i + 1) * page_size]).tobytes()
        parent = hashlib.blake2b(parent + page, digest_size=16).digest()
        keys.append(parent)
    return keys


def prompt_keys(token_ids: list[int], page_size: int, limit: int | None = None) -> list[bytes]:
    """The keys a new sequence looks its prompt up by: its full pages short of its last token
    (whose forward gives the first output, and its features), and below `limit` when given."""
    end = len(token_ids) - 1 if limit is None else min(len(token_ids) - 1, limit)
    return page_keys(token_ids[:end], page_size)


class PrefixCache:
    """The index of cached pages. PagedKVCache asks it which pages a prompt can reuse, tells
    it when a cached page loses its last reference (it becomes evictable) or gains one again,
    and takes evictable pages back when its free list runs dry."""

    def __init__(self, max_idle_pages: int = 0) -> None:
        """max_idle_pages: the most unreferenced pages the cache keeps (0: as many as the pool
        has spare)."""
        self.max_idle_pages = max_idle_pages
        self._page: dict[bytes, int] = {}     # key -> page
        self._key: dict[int, bytes] = {}      # page -> key
        self._idle: OrderedDict[int, None] = OrderedDict()   # unreferenced cached pages, LRU first

    def __len__(self) -> int:
        return len(self._page)

    @property
    def idle_pages(self) -> int:
        return len(self._idle)

    def cached(self, page: int) -> bool:
        return page in self._key

    def match(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest cached prefix of `keys` (the caller takes references)."""
        pages = []
        for key in keys:
            page = self._page.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def insert(self, key: bytes, page: int) -> None:
        """Caches a full, referenced page under `key`; nothing when that key is cached already
        (another sequence computed the same prefix: this page stays private) or the page is."""
        if key not in self._page and page not in self._key:
            self._page[key], self._key[page] = page, key

    def used(self, page: int) -> None:
        """A cached page gained a reference: it is not evictable."""
        self._idle.pop(page, None)

    def unused(self, page: int) -> int | None:
        """A cached page lost its last reference: evictable, most recently used. Returns a page
        evicted to keep the cap (to be freed), or None."""
        self._idle[page] = None
        if self.max_idle_pages and len(self._idle) > self.max_idle_pages:
            return self.evict()
        return None

    def evict(self) -> int | None:
        """The least recently used unreferenced page, dropped from the cache (None: none)."""
        if not self._idle:
            return None
        page, _ = self._idle.popitem(last=False)
        del self._page[self._key.pop(page)]
        return page

    def clear(self) -> list[int]:
        """Drops every unreferenced page (returned, to be freed); referenced ones stay cached."""
        pages = []
        while (page := self.evict()) is not None:
            pages.append(page)
        return pages
