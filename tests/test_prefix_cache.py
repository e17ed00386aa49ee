"""Prefix caching in the paged KV cache (runtime/prefix_cache.py, runtime/kv_cache.py): keys,
sharing, eviction order, the cap, and a randomized run whose every attached prefix must hold
exactly the tokens it was keyed by."""
from __future__ import annotations

import random

import pytest
import torch

from runtime.kv_cache import OutOfPages, PagedKVCache, PageTable
from runtime.prefix_cache import PrefixCache, page_keys

PS = 4


def cache(pages: int = 12, max_idle: int = 0) -> PagedKVCache:
    return PagedKVCache(1, 1, 1, PS, pages, torch.float32, "cpu", PrefixCache(max_idle))


def write(kv: PagedKVCache, table: PageTable, tokens: list[int], start: int, end: int) -> None:
    """Stands in for a forward: position p's K holds its token."""
    for p, slot in zip(range(start, end), kv.slots(table, start, end)):
        kv.k[0, slot, 0, 0] = tokens[p]


def held(kv: PagedKVCache, table: PageTable, end: int) -> list[int]:
    return [int(kv.k[0, s, 0, 0]) for s in kv.slots(table, 0, end)]


def run(kv: PagedKVCache, tokens: list[int], limit: int | None = None) -> tuple[PageTable, int]:
    """A prompt: its cached prefix attached (short of its last token), the rest written."""
    table = PageTable()
    limit = len(tokens) - 1 if limit is None else limit
    hit = kv.attach_prefix(table, page_keys(tokens[:limit], PS))
    try:
        kv.ensure(table, len(tokens))
    except OutOfPages:
        kv.release(table)               # as the target's scheduler drops a failed prefill
        raise
    write(kv, table, tokens, hit, len(tokens))
    kv.cache_full_pages(table, tokens, len(tokens))
    return table, hit


def test_keys_name_a_page_and_everything_before_it():
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], PS)
    assert len(a) == 2                                    # full pages only
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 8], PS) == a
    b = page_keys([0, 2, 3, 4, 5, 6, 7, 8], PS)
    assert b[0] != a[0] and b[1] != a[1]                  # same second page, other first page
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 8], PS, 1, a[0]) == a[1:]


def test_a_second_prompt_reuses_the_first_ones_full_pages_and_shares_them():
    kv = cache()
    prompt = list(range(1, 11))                           # 10 tokens: 2 full pages
    first, hit = run(kv, prompt)
    assert hit == 0 and len(kv.prefix_cache) == 2
    second, hit = run(kv, prompt + [11, 12])
    assert hit == 8 and second.pages[:2] == first.pages[:2]
    assert held(kv, second, 12) == prompt + [11, 12]
    kv.release(first)                                     # shared pages stay with `second`
    assert held(kv, second, 12) == prompt + [11, 12]
    kv.release(second)
    assert kv.used_pages == 0 and kv.idle_pages == 3      # pages 0-1 and second's third page


def test_the_last_token_is_always_computed():
    kv = cache()
    prompt = list(range(1, 9))                            # exactly 2 pages
    run(kv, prompt)
    _, hit = run(kv, prompt)
    assert hit == 4                                       # not 8: the last token runs


def test_unreferenced_pages_are_evicted_only_when_the_pool_needs_them_deepest_first():
    kv = cache(pages=5)                                   # 4 usable pages
    t, _ = run(kv, list(range(1, 14)))                    # 4 pages, 3 full and cached
    kv.release(t)
    assert kv.free_pages == 4 and kv.idle_pages == 3
    other = PageTable()
    kv.ensure(other, 8)                                   # the free page, then the LRU one
    assert len(kv.prefix_cache) == 2
    kv.release(other)
    again, hit = run(kv, list(range(1, 14)))              # the first two pages remain
    assert hit == 8 and held(kv, again, 13) == list(range(1, 14))
    with pytest.raises(OutOfPages):
        kv.ensure(PageTable(), 1)


def test_a_referenced_page_is_never_evicted():
    kv = cache(pages=4)                                   # 3 usable pages
    a, _ = run(kv, list(range(1, 10)))                    # 3 pages held
    with pytest.raises(OutOfPages):
        kv.ensure(PageTable(), 1)
    assert held(kv, a, 9) == list(range(1, 10))


def test_the_cap_frees_the_least_recently_used_pages_a_sequences_deepest_first():
    """A released sequence's last page is its least recently used: the cap keeps the head of
    its prefix (the part later prompts can still reach)."""
    kv = cache(pages=12, max_idle=2)
    t, _ = run(kv, list(range(1, 18)))                    # 4 full pages
    kv.release(t)
    assert kv.idle_pages == 2 and len(kv.prefix_cache) == 2
    _, hit = run(kv, list(range(1, 18)))
    assert hit == 8


def test_clear_keeps_referenced_pages():
    kv = cache()
    run(kv, list(range(1, 10)))                          # held: its pages stay
    b, _ = run(kv, list(range(20, 30)))
    kv.release(b)
    kv.clear_prefix_cache()
    assert kv.idle_pages == 0 and len(kv.prefix_cache) == 2     # a's two full pages
    assert run(kv, list(range(1, 10)))[1] == 8


def test_without_a_prefix_cache_nothing_is_kept():
    kv = PagedKVCache(1, 1, 1, PS, 12, torch.float32, "cpu")
    t, _ = run(kv, list(range(1, 10)))
    kv.release(t)
    assert kv.free_pages == kv.usable_pages and run(kv, list(range(1, 10)))[1] == 0


@pytest.mark.parametrize("max_idle", [0, 3])
def test_random_sequences_only_ever_attach_the_tokens_they_asked_for(max_idle):
    """Sequences start (with their cached prefix), append verify blocks of which a random part
    is committed (the rest's KV left past the committed length, then trimmed), and end, on a
    small pool; every attached prefix holds the tokens its keys name, and the page accounting
    always adds up."""
    rng = random.Random(max_idle)
    kv = cache(pages=14, max_idle=max_idle)
    live: list[tuple[PageTable, list[int]]] = []
    hits = 0
    bases = [[rng.randrange(3) for _ in range(20)] for _ in range(3)]   # shared beginnings
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 and len(live) < 4:
            tokens = rng.choice(bases)[: rng.randrange(1, 20)] + [
                rng.randrange(3) for _ in range(rng.randrange(0, 6))]
            try:
                table, hit = run(kv, tokens)
            except OutOfPages:
                continue
            hits += hit > 0
            assert held(kv, table, len(tokens)) == tokens
            live.append((table, tokens))
        elif op < 0.7 and live:
            table, tokens = rng.choice(live)
            block = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            try:
                kv.ensure(table, len(tokens) + len(block))
            except OutOfPages:
                continue
            write(kv, table, tokens + block, len(tokens), len(tokens) + len(block))
            kept = rng.randrange(1, len(block) + 1)
            for p, slot in zip(range(len(tokens) + kept, len(tokens) + len(block)),
                               kv.slots(table, len(tokens) + kept, len(tokens) + len(block))):
                kv.k[0, slot, 0, 0] = -1                  # a rejected draft's KV
            tokens += block[:kept]
            kv.trim(table, len(tokens))
            kv.cache_full_pages(table, tokens, len(tokens))
        elif op < 0.9 and live:
            kv.release(live.pop(rng.randrange(len(live)))[0])
        else:
            kv.clear_prefix_cache()
        owned = {p for t, _ in live for p in t.pages}
        assert kv.used_pages == len(owned)
        for table, tokens in live:
            assert held(kv, table, len(tokens)) == tokens
    assert hits > 50


def test_a_requests_prefix_keys_find_the_pages_a_service_cached():
    """The gateway's placement hook computes the keys the services file pages under."""
    from gateway.request import GenerationRequest
    kv = cache()
    prompt = list(range(1, 14))
    table, _ = run(kv, prompt)
    keys = GenerationRequest(prompt_ids=tuple(prompt)).prefix_keys(PS)
    assert len(keys) == 3 and kv.prefix_cache.match(keys) == table.pages[:3]
