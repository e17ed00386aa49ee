"""Short verify blocks padded to a captured graph's size (issue 32, one graph launch per
forward): a batch of chain verifies whose blocks differ, or are shorter than the graph's block,
runs every sequence padded to that block instead of eagerly. On the GPU the sizes are the
captured graphs'; here TargetHooks.pad_verify_to pads on the CPU, so the padding itself - rows,
positions, pages - is checked against the same engine without it: the same accepted drafts,
committed tokens, features and KV pages, step after step, for a batch of blocks of 1, 3, 6 and 16
tokens; and a verify whose padded block would pass the context is not padded."""
from __future__ import annotations

import asyncio

import pytest
import torch
from support.inproc_target import in_one_batch, started_engine

from runtime.sampling import SamplingConfig
from services.target.config import TargetConfig
from services.target.engine import PrefillCall, TargetEngine
from services.target.hooks import TargetHooks
from services.target.worker import TargetWorker

LAYERS = (1, 3)
PROMPTS = {f"s{i}": list(range(3 + i, 40 + 3 * i)) for i in range(4)}
BLOCKS = {"s0": 1, "s1": 3, "s2": 6, "s3": 16}      # tokens per verify: anchor + drafts


def _engine(model_dir, hooks: TargetHooks) -> TargetEngine:
    return started_engine(TargetWorker.started(TargetConfig(
        str(model_dir), kv_budget_bytes=8 << 20, max_block_size=16), hooks))


@pytest.fixture(scope="module")
def engines(tiny_llama_02_dir):
    plain = _engine(tiny_llama_02_dir, TargetHooks())
    padded = _engine(tiny_llama_02_dir, TargetHooks(pad_verify_to=(1, 16)))
    yield plain, padded
    plain.stop()
    padded.stop()


async def _run(engine: TargetEngine, steps: int) -> list:
    """Prefills, then `steps` batched verifies whose drafts are the wrong half of the time (a
    fixed pattern: draft i is token (anchor + i) % 7 + 3), and what each step returned."""
    seen, anchors = [], {}
    prefills = await in_one_batch(engine, [engine.prefill(PrefillCall(
        s, p, SamplingConfig(), LAYERS, torch.float32)) for s, p in PROMPTS.items()])
    for s, r in zip(PROMPTS, prefills):
        anchors[s] = r.next_token
    for _ in range(steps):
        blocks = {s: [a] + [(a + i) % 7 + 3 for i in range(BLOCKS[s] - 1)]
                  for s, a in anchors.items()}
        results = await in_one_batch(engine, [engine.verify(s, b) for s, b in blocks.items()])
        pages = {s: len(engine.seqs[s].table.pages) for s in blocks}
        for s, r in zip(blocks, results):
            anchors[s] = r.committed[-1]
            seen.append((s, r.accepted, r.committed, r.seq_len, r.features, pages[s],
                         r.batch_tokens))
    for s in PROMPTS:
        await engine.release(s)
    return seen


def test_padded_verifies_equal_unpadded(engines):
    plain, padded = engines
    t0 = plain.stats.tokens
    expected = asyncio.run(_run(plain, 4))
    t1 = padded.stats.tokens
    got = asyncio.run(_run(padded, 4))
    # the padded engine ran every verify at 16 rows (the 16-token block needed none)
    padding = 4 * sum(16 - n for n in BLOCKS.values())
    assert (padded.stats.tokens - t1) - (plain.stats.tokens - t0) == padding
    assert len(got) == len(expected) == 16
    for (s, a, c, n, f, pages, t), (s2, a2, c2, n2, f2, pages2, t2) in zip(expected, got):
        assert (s, a, c, n, pages) == (s2, a2, c2, n2, pages2)
        # the forward's rows, padding included: what the gateway's cost model prices
        assert (t, t2) == (sum(BLOCKS.values()), 16 * len(BLOCKS))
        assert f.shape == f2.shape == (a + 1, len(LAYERS) * 64)
        torch.testing.assert_close(f, f2, rtol=1e-4, atol=1e-4)
    assert padded.worker.kv_cache.usage() == 0


def test_the_padding_needs_room_in_the_context(engines):
    """A sequence near the end of the context verifies its short block unpadded."""
    _, padded = engines
    worker = padded.worker
    assert worker.padded_block(1, 3, LAYERS) == 16
    max_ctx = worker.facts.max_context

    async def near_the_end():
        prompt = [5] * (max_ctx - 4)
        first = await padded.prefill(PrefillCall("end", prompt, SamplingConfig(), (), None))
        v = await padded.verify("end", [first.next_token, 7, 8])    # 3 of the 4 left
        pages = len(padded.seqs["end"].table.pages)
        await padded.release("end")
        return v, pages
    v, pages = asyncio.run(near_the_end())
    assert v.seq_len <= max_ctx and pages == worker.kv_cache.pages_for(v.seq_len)


def test_capabilities_say_which_blocks_the_target_pads_to(engines):
    """The gateway's cost model prices a chain batch by its padded rows."""
    from services.target.servicer import capabilities
    plain, padded = engines
    assert list(capabilities(plain.worker).verify_padded_blocks) == []
    assert list(capabilities(padded.worker).verify_padded_blocks) == [1, 16]
