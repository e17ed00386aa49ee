"""The torch (SDPA) backend reads a sequence's K/V in place when its pages are consecutive, and
gathers them otherwise: both give the same attention."""
from __future__ import annotations

import pytest
import torch

from runtime.attention.metadata import AttentionMetadata, SeqSlice
from runtime.attention.torch_backend import TorchAttentionBackend
from runtime.kv_cache import PagedKVCache, PageTable, first_slot_if_consecutive

NH, NKV, HD, PAGE = 4, 2, 8, 4


def test_first_slot_if_consecutive():
    assert first_slot_if_consecutive([3, 4, 5], 12, PAGE) == 12
    assert first_slot_if_consecutive([3, 4, 9], 8, PAGE) == 12     # only the pages it needs
    assert first_slot_if_consecutive([3, 4, 9], 9, PAGE) is None
    assert first_slot_if_consecutive([5, 4], 8, PAGE) is None        # descending is not
    assert first_slot_if_consecutive([7], 1, PAGE) == 28


def _tables(cache: PagedKVCache, lengths: list[int], scattered: bool) -> list[PageTable]:
    """A table per sequence; scattered: a spacer page taken between every two pages, so no
    sequence's pages are consecutive."""
    tables = [PageTable() for _ in lengths]
    spacer = PageTable()
    for t, n in zip(tables, lengths):
        for _ in range(cache.pages_for(n)):
            cache.ensure(t, (len(t.pages) + 1) * PAGE)
            if scattered:
                cache.ensure(spacer, (len(spacer.pages) + 1) * PAGE)
    return tables


def _attend(specs: list[tuple[int, int]], scattered: bool, seed: int = 0):
    """specs: [(prefix_len, q_len)]: the same logical K/V and queries in either page layout;
    returns (output [T, NH, HD], the backend's spans)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [p + q for p, q in specs]
    pages = 2 * sum(-(-n // PAGE) for n in lengths) + 2        # room for the spacers
    cache = PagedKVCache(1, NKV, HD, PAGE, pages, torch.float32, "cpu")
    tables = _tables(cache, lengths, scattered)
    for t, n in zip(tables, lengths):
        slots = torch.tensor(cache.slots(t, 0, n))
        cache.write(0, slots, torch.randn(n, NKV, HD, generator=g), torch.randn(n, NKV, HD, generator=g))
    meta = AttentionMetadata.build([SeqSlice(t, p, q) for t, (p, q) in zip(tables, specs)], cache)
    backend = TorchAttentionBackend(cache, NH, NKV, HD, HD ** -0.5)
    backend.prepare(meta)
    n = meta.num_tokens
    q = torch.randn(n, NH, HD, generator=g)
    # the new tokens' own K/V are already in the cache: attend alone reads them from there
    return backend.attend(0, q, causal=True, window=None), backend._spans


@pytest.mark.parametrize("specs", [[(13, 1)], [(9, 4)], [(9, 4), (5, 4)], [(9, 4), (21, 1)]])
def test_in_place_reads_equal_gathered_reads(specs):
    in_place, spans = _attend(specs, scattered=False)
    gathered, no_spans = _attend(specs, scattered=True)
    assert all(s is not None for s in spans) and all(s is None for s in no_spans)
    assert torch.equal(in_place, gathered)
