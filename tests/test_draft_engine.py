"""The draft engine in-process: many Proposes in one iteration, leases, memory pressure."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from dflash.make_draft import make_random_drafter
from services.common.errors import NotFound, ResourceExhausted
from services.draft.config import DraftConfig
from services.draft.dflash_drafter import DFlashDrafter
from services.draft.engine import DraftEngine, ProposeCall


@pytest.fixture(scope="module")
def tiny_draft(tiny_qwen3_dir: Path, tmp_path_factory) -> Path:
    return make_random_drafter(tiny_qwen3_dir, tmp_path_factory.mktemp("draft"), num_layers=1,
                               block_size=8, seed=2)


def start_engine(draft: Path, target: Path, **overrides) -> DraftEngine:
    cfg = DraftConfig(target_dir=str(target), model_dir=str(draft), page_size=4, **overrides)
    drafter = DFlashDrafter(cfg)
    drafter.init_backend()
    engine = DraftEngine(drafter, cfg)
    engine.start()
    return engine


def calls(seed: int) -> list[ProposeCall]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 1, 9, 30, 5, 12, 2]
    return [ProposeCall(f"q{i}", 0, n, torch.randn(n, 64, generator=gen).to(torch.bfloat16), [],
                        int(torch.randint(0, 256, (1,), generator=gen)), 8)
            for i, n in enumerate(lengths)]


def test_a_cancelled_propose_releases_its_sequence(tiny_draft, tiny_qwen3_dir):
    """Its caller gone (the RPC cancelled, its deadline passed), a Propose's sequence is freed at
    once - whether the work never ran or ran and could not be answered - and a sequence that a
    later Propose started anew from position 0 is not."""
    engine = start_engine(tiny_draft, tiny_qwen3_dir)

    async def held(coro_fn):
        """Runs coro_fn() while the engine thread is held, cancelled before it is let go."""
        gate, running = threading.Event(), threading.Event()
        engine.loop.call(lambda: (running.set(), gate.wait(10)))
        await asyncio.to_thread(running.wait, 10)
        task = asyncio.create_task(coro_fn())
        await asyncio.sleep(0.02)
        task.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def until_gone(seq_id: str) -> None:
        for _ in range(100):
            if seq_id not in engine.seqs:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{seq_id} was not released")

    async def scenario():
        first = calls(3)[1]
        await engine.propose(first)                              # q1 exists
        more = ProposeCall("q1", first.num_new, 1, torch.zeros(1, 64, dtype=torch.bfloat16), [],
                           5, 8)
        await held(lambda: engine.propose(more))                 # cancelled before it ran
        await until_gone("q1")
        fresh = calls(4)[2]
        await engine.propose(fresh)                              # q2
        gate, running = threading.Event(), threading.Event()
        engine.loop.call(lambda: (running.set(), gate.wait(10)))
        await asyncio.to_thread(running.wait, 10)
        given_up = asyncio.create_task(engine.propose(ProposeCall(
            "q2", fresh.num_new, 1, torch.zeros(1, 64, dtype=torch.bfloat16), [], 5, 8)))
        await asyncio.sleep(0.01)
        restart = asyncio.create_task(engine.propose(calls(5)[2]))   # q2 anew, from position 0
        await asyncio.sleep(0.01)
        given_up.cancel()                       # its release is queued after the restart
        await asyncio.sleep(0.01)
        gate.set()
        await restart
        await asyncio.sleep(0.1)                                 # the abandoned release ran
        assert "q2" in engine.seqs and engine.seqs["q2"].context_len == calls(5)[2].num_new

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_concurrent_proposes_run_as_one_batch(tiny_draft, tiny_qwen3_dir):
    batched = start_engine(tiny_draft, tiny_qwen3_dir)
    single = start_engine(tiny_draft, tiny_qwen3_dir)

    async def together():
        gate, running = threading.Event(), threading.Event()
        batched.loop.call(lambda: (running.set(), gate.wait(10)))   # hold the engine thread
        await asyncio.to_thread(running.wait, 10)
        tasks = [asyncio.create_task(batched.propose(c)) for c in calls(1)]
        await asyncio.sleep(0.05)                                   # all 8 are queued
        gate.set()
        return await asyncio.gather(*tasks)

    async def one_by_one():
        return [await single.propose(c) for c in calls(1)]

    try:
        got, want = asyncio.run(together()), asyncio.run(one_by_one())
    finally:
        batched.stop()
        single.stop()
    assert batched.stats.batches == 1 and batched.stats.max_batch == 8
    assert single.stats.max_batch == 1
    drafts = lambda results: [(r.draft_tokens, r.context_len, r.draft_parents) for r in results]
    assert drafts(got) == drafts(want)
    assert all(len(r.draft_tokens) == 7 for r in got)
    # each answer reports the forward it ran in: the batch's rows (8 x (appended + block)), or
    # its own alone
    assert {r.batch_rows for r in got} == {sum(r.batch_rows for r in want)}
    assert all(r.batch_seconds > 0 for r in got + want)
    # and how long it waited in the engine: the batched ones >= the 50 ms they were held
    assert all(r.queue_seconds >= 0.04 for r in got)
    assert max(r.queue_seconds for r in want) < min(r.queue_seconds for r in got)


def test_lease_expiry_frees_the_cache(tiny_draft, tiny_qwen3_dir):
    engine = start_engine(tiny_draft, tiny_qwen3_dir, lease_seconds=0.3)
    try:
        first = calls(2)[1]
        asyncio.run(engine.propose(first))
        assert engine.drafter.kv_usage() > 0
        deadline = time.monotonic() + 5
        while engine.seqs and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not engine.seqs and engine.leases.expired == 1
        assert engine.drafter.kv_usage() == 0
        more = ProposeCall(first.seq_id, first.num_new, 1, first.features[:1], [], 3, 8)
        with pytest.raises(NotFound, match="lease expired"):
            asyncio.run(engine.propose(more))
    finally:
        engine.stop()


def test_out_of_pages_fails_only_that_sequence(tiny_draft, tiny_qwen3_dir):
    # K+V of one layer, 2 kv heads x 32 x fp32: 512 B per token; 12 KiB = 6 pages of 4 tokens,
    # 5 usable (page 0 is scratch)
    engine = start_engine(tiny_draft, tiny_qwen3_dir, kv_budget_bytes=12 << 10)
    big, small = calls(3)[4], calls(3)[0]          # 30 rows + block 8; 3 rows + block 8
    try:
        with pytest.raises(ResourceExhausted, match="draft KV cache full"):
            asyncio.run(engine.propose(big))
        assert big.seq_id not in engine.seqs
        result = asyncio.run(engine.propose(small))
        assert len(result.draft_tokens) == 7 and result.context_len == 3
        # the block's pages were given back: only the 3 context rows hold a page
        assert engine.drafter.cache.used_pages == 1
    finally:
        engine.stop()


class _CapturedBlock:
    """Stands for a CUDA graph captured at the drafter's block (on the CPU nothing is captured):
    its q_len is what the drafter pads shorter chains to; it never runs (can_run False), so the
    padded block runs on the eager path - the same forward the graph holds."""
    q_len = 8

    def can_run(self, slices) -> bool:
        return False


def test_a_shorter_chain_runs_at_the_captured_block_and_is_cut(tiny_draft, tiny_qwen3_dir):
    """On a GPU only the drafter's own block has a CUDA graph, and auto speculation asks for
    every chain length: a shorter chain runs at the captured block (its K/V room reserved for
    it) and returns the first drafts asked for - those of the full block."""
    full = start_engine(tiny_draft, tiny_qwen3_dir)
    padded = start_engine(tiny_draft, tiny_qwen3_dir)
    padded.drafter._graph = _CapturedBlock()
    try:
        def with_block(c: ProposeCall, block: int) -> ProposeCall:
            return ProposeCall(c.seq_id, c.start, c.num_new, c.features, c.token_ids, c.anchor,
                               block)

        async def scenario():
            for c in calls(7):
                whole = await full.propose(c)
                cut = await padded.propose(with_block(c, 3))
                assert len(whole.draft_tokens) == 7 and cut.draft_tokens == whole.draft_tokens[:2]
            return padded.drafter.cache.usage()

        assert asyncio.run(scenario()) > 0
    finally:
        full.stop()
        padded.stop()


def _ahead_count(outcome: str) -> float:
    from prometheus_client import REGISTRY
    return sum(s.value for m in REGISTRY.collect() if m.name == "dflash_draft_ahead_blocks"
               for s in m.samples if s.name.endswith("_total") and s.labels["outcome"] == outcome)


def test_draft_ahead_uses_idle_time_only(tiny_draft, tiny_qwen3_dir):
    """A commit notice taken in the same iteration as a waiting Propose is not drafted (the
    ahead block would lengthen that Propose's forward): outcome `skipped`; the same notice
    reaching an idle engine is drafted ahead."""
    engine = start_engine(tiny_draft, tiny_qwen3_dir)

    def notice(call: ProposeCall) -> ProposeCall:
        """What the target's commit of one more position after `call` tells the draft."""
        return ProposeCall(call.seq_id, call.num_new, 1, torch.zeros(1, 64, dtype=torch.bfloat16),
                           [7], 5, 8, source=(("plane", 1, 0, 1),))

    async def scenario():
        first, other = calls(6)[0], calls(6)[1]
        await engine.propose(first)
        await engine.propose(other)
        skipped = _ahead_count("skipped")
        gate, running = threading.Event(), threading.Event()
        engine.loop.call(lambda: (running.set(), gate.wait(10)))      # hold the engine thread
        await asyncio.to_thread(running.wait, 10)
        engine.ahead(notice(first))
        waiting = asyncio.create_task(engine.propose(ProposeCall(
            other.seq_id, other.num_new, 1, torch.zeros(1, 64, dtype=torch.bfloat16), [], 5, 8)))
        await asyncio.sleep(0.05)
        gate.set()                                   # both in the engine's next iteration
        await waiting
        assert _ahead_count("skipped") == skipped + 1
        assert engine.seqs[first.seq_id].ahead is None
        assert engine.seqs[first.seq_id].context_len == first.num_new      # nothing appended
        engine.ahead(notice(first))                  # the engine is idle now: drafted ahead
        for _ in range(200):
            if engine.seqs[first.seq_id].ahead is not None:
                break
            await asyncio.sleep(0.01)
        assert engine.seqs[first.seq_id].ahead is not None
        assert engine.seqs[first.seq_id].context_len == first.num_new + 1

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()
