"""A lone prompt chunk padded to a captured prefill graph's size (docs/architecture.md §6): on a
GPU an eager short prefill is mostly kernel launches, so a chunk runs padded to the smallest
captured size that holds it. Here TargetHooks.pad_prefill_to pads on the CPU, so the padding
itself - rows, positions, pages, the chunk's features and first token - is checked against the
same engine without it: short prompts, prompts chunked by the token budget (a middle chunk's
padding lands where the next chunk writes), a prompt behind a cached prefix, the verifies that
follow, and every page back at the end."""
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
SYSTEM = [(7 * i) % 200 + 3 for i in range(40)]     # a shared prefix of 10 full pages
PROMPTS = [list(range(3, 8)), list(range(5, 36)), list(range(9, 42)), list(range(4, 68)),
           list(range(2, 100)), SYSTEM + [11, 12, 13], SYSTEM + [21, 22, 23, 24, 25]]


def _engine(model_dir, hooks: TargetHooks, **config) -> TargetEngine:
    worker = TargetWorker.started(TargetConfig(
        str(model_dir), kv_budget_bytes=8 << 20, page_size=4, max_block_size=16,
        token_budget=48, prefix_caching=True, **config), hooks)
    worker.capture_cuda_graphs()            # as the service does before SERVING (CUDA only)
    return started_engine(worker)


@pytest.fixture(scope="module")
def engines(tiny_llama_02_dir):
    plain = _engine(tiny_llama_02_dir, TargetHooks())
    padded = _engine(tiny_llama_02_dir, TargetHooks(pad_prefill_to=(16, 32, 48)))
    yield plain, padded
    plain.stop()
    padded.stop()


async def _run(engine: TargetEngine) -> list:
    """Each prompt alone (so each chunk is a lone prefill), then two verifies of its anchor;
    what each returned and the pages its sequence held."""
    seen = []
    for i, prompt in enumerate(PROMPTS):
        seq = f"p{i}"
        held = len(SYSTEM) if i == len(PROMPTS) - 1 else 0     # the draft holds the prefix
        r = await engine.prefill(PrefillCall(seq, prompt, SamplingConfig(), LAYERS,
                                             torch.float32, features_from=held))
        seen.append((r.next_token, r.seq_len, r.cached_tokens, r.features,
                     len(engine.seqs[seq].table.pages)))
        anchor = r.next_token
        for _ in range(2):
            v = await engine.verify(seq, [anchor, (anchor + 1) % 200 + 3])
            seen.append((v.committed, v.seq_len, v.features, len(engine.seqs[seq].table.pages)))
            anchor = v.committed[-1]
        await engine.release(seq)
    return seen


def _assert_same(expected: list, got: list) -> None:
    """Step by step the same tokens, lengths and page counts, and features within fp32
    rounding."""
    assert len(got) == len(expected)
    for e, g in zip(expected, got):
        assert len(e) == len(g)
        for a, b in zip(e, g):
            if isinstance(a, torch.Tensor):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            else:
                assert a == b


def test_padded_prompt_chunks_equal_unpadded(engines):
    plain, padded = engines
    t0, t1 = plain.stats.tokens, padded.stats.tokens
    expected = asyncio.run(_run(plain))
    got = asyncio.run(_run(padded))
    assert padded.stats.tokens - t1 > plain.stats.tokens - t0          # padding really ran
    assert len(got) == len(expected) == 3 * len(PROMPTS)
    _assert_same(expected, got)
    assert got[-3][2] == expected[-3][2] == len(SYSTEM)    # the prefix came from the cache
    assert padded.worker.kv_cache.usage() == 0


async def _overlapping(engine: TargetEngine) -> list:
    """A long prompt prefilled (in chunks) while another sequence verifies block after block:
    on the padded engine they run apart, taking turns (EngineLoop.prompts_apart)."""
    first = await engine.prefill(PrefillCall("o1", PROMPTS[1], SamplingConfig(), LAYERS,
                                             torch.float32))

    async def verifies():
        out, anchor = [], first.next_token
        for _ in range(4):
            v = await engine.verify("o1", [anchor, (anchor + 1) % 200 + 3])
            out.append((v.committed, v.seq_len, v.features))
            anchor = v.committed[-1]
        return out

    long, steps = await asyncio.gather(
        engine.prefill(PrefillCall("o2", PROMPTS[4], SamplingConfig(), LAYERS, torch.float32)),
        verifies())
    for seq in ("o1", "o2"):
        await engine.release(seq)
    return [(long.next_token, long.seq_len, long.features), *steps]


def test_prompts_apart_from_verifies_give_what_mixed_batches_give(engines):
    plain, padded = engines
    expected, got = asyncio.run(_overlapping(plain)), asyncio.run(_overlapping(padded))
    _assert_same(expected, got)
    assert padded.worker.kv_cache.usage() == 0
    assert plain.stats.max_batch == 2 and padded.stats.max_batch == 1   # mixed, and apart


async def _together(engine: TargetEngine) -> list:
    """Three short prompts prefilled at once (later chat turns arriving together): the engine
    thread is held until all three wait."""
    calls = [PrefillCall(f"t{i}", PROMPTS[i], SamplingConfig(), LAYERS, torch.float32)
             for i in (0, 1, 2)]
    done = await in_one_batch(engine, [engine.prefill(c) for c in calls])
    for c in calls:
        await engine.release(c.seq_id)
    return [(r.next_token, r.seq_len, r.features) for r in done]


def test_a_prompt_batch_runs_waiting_prompts_in_one_forward_and_changes_nothing(
        engines, tiny_llama_02_dir):
    """--prompt-batch 3 where prompts run apart: the three waiting prompts' chunks share one
    (eager) forward instead of one forward each, and give what they give alone."""
    plain, _ = engines
    batched = _engine(tiny_llama_02_dir, TargetHooks(pad_prefill_to=(16, 32, 48)),
                      prompt_batch=3)
    try:
        expected, got = asyncio.run(_together(plain)), asyncio.run(_together(batched))
        _assert_same(expected, got)
        assert batched.loop.prompts_apart() and batched.stats.max_batch == 3
        assert batched.worker.kv_cache.usage() == 0
    finally:
        batched.stop()


def test_sizes_padding_picks_and_what_is_not_padded(engines, tiny_llama_02_dir):
    plain_engine, padded = engines
    worker = padded.worker
    assert [worker.prefill_block(n, LAYERS) for n in (1, 16, 17, 48, 49)] == [16, 16, 32, 48, 0]
    plain = TargetWorker(TargetConfig(str(tiny_llama_02_dir)))
    assert plain.prefill_block(5, ()) == 0                    # no graphs on the CPU: eager
    assert TargetConfig(str(tiny_llama_02_dir)).graph_prefill_sizes == (32, 64, 128, 256, 512)
    # prompt chunks run apart from verifies only where they have graphs (here: the hook)
    assert worker.prompts_apart() and not plain.prompts_apart()
    assert padded.loop.prompts_apart() and not plain_engine.loop.prompts_apart()
    mixed = TargetWorker(TargetConfig(str(tiny_llama_02_dir), mixed_batches=True),
                         TargetHooks(pad_prefill_to=(16,)))
    assert not mixed.prompts_apart()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the prefill graphs are CUDA's")
def test_prompt_chunks_replayed_from_graphs_equal_eager(tiny_llama_02_dir):
    """On a GPU (fp32): the same prompts with the prefill graphs captured and with none."""
    def engine(graphs: bool) -> TargetEngine:
        return _engine(tiny_llama_02_dir, TargetHooks(), device="cuda",
                       attention_backend="triton", cuda_graphs=graphs,
                       graph_block_sizes=(1, 16), graph_prefill_sizes=(32, 48),
                       graph_capture_layers=LAYERS)
    graphed, eager = engine(True), engine(False)
    try:
        assert graphed.worker.prefill_block(20, LAYERS) == 32
        assert eager.worker.prefill_block(20, LAYERS) == 0
        got, expected = asyncio.run(_run(graphed)), asyncio.run(_run(eager))
        _assert_same(expected, got)
    finally:
        graphed.stop()
        eager.stop()
