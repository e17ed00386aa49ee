"""One sequence whose maths fails never takes its batch with it (issue 39, hole 1): the real
target engine (tiny Llama), the engine thread held so that good and bad works run in one batch,
and the test hook TargetHooks.nan_logits_for giving NaN logits to the sequences named "bad...".
The bad Prefill and the bad Verify fail INTERNAL saying why (no sequence left behind, nothing
committed); the good ones batched with them get exactly what they get alone."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
from support.inproc_target import in_one_batch

from runtime.sampling import SamplingConfig
from services.common.errors import Internal
from services.target.config import TargetConfig
from services.target.engine import PrefillCall, TargetEngine
from services.target.hooks import TargetHooks
from services.target.worker import TargetWorker

PROMPT = list(range(3, 30))
GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(temperature=0.8, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def engine(tiny_llama_02_dir):
    worker = TargetWorker.started(TargetConfig(str(tiny_llama_02_dir), kv_budget_bytes=8 << 20),
                                  TargetHooks(nan_logits_for="bad"))
    engine = TargetEngine(worker)
    engine.start()
    yield engine
    engine.stop()


async def _batched(engine: TargetEngine, *coros):
    """The coroutines' engine works, all in one batch; their results or exceptions."""
    return await in_one_batch(engine, coros, return_exceptions=True)


def _prefill(seq: str, sampling: SamplingConfig = GREEDY) -> PrefillCall:
    return PrefillCall(seq, PROMPT, sampling, (), None)


def test_bad_sequences_fail_alone(engine):
    async def scenario():
        alone = await _batched(engine, engine.prefill(_prefill("g1")),
                               engine.prefill(_prefill("g2", SAMPLED)))
        for seq in ("g1", "g2"):
            await engine.release(seq)
        mixed = await _batched(engine, engine.prefill(_prefill("g1")),
                               engine.prefill(_prefill("bad-p")),
                               engine.prefill(_prefill("g2", SAMPLED)))
        return alone, mixed

    alone, (g1, bad, g2) = asyncio.run(scenario())
    assert isinstance(bad, Internal) and "not usable" in str(bad) and "'bad-p'" in str(bad)
    assert "bad-p" not in engine.seqs                      # no half-built sequence
    assert (g1.next_token, g2.next_token) == (alone[0].next_token, alone[1].next_token)

    async def verifies():
        # a sequence that prefilled fine, then goes bad in a verify batched with a good one
        hooks = engine.worker.hooks
        engine.worker.hooks = dataclasses.replace(hooks, nan_logits_for="zzz")
        v = await engine.prefill(_prefill("bad-v"))
        engine.worker.hooks = hooks
        seq_len = engine.seqs["bad-v"].seq_len
        good, failed = await _batched(engine, engine.verify("g1", [g1.next_token, 5, 6]),
                                      engine.verify("bad-v", [v.next_token, 5, 6]))
        return good, failed, seq_len

    good, failed, seq_len = asyncio.run(verifies())
    assert isinstance(failed, Internal) and "Verify of sequence 'bad-v'" in str(failed)
    assert engine.seqs["bad-v"].seq_len == seq_len         # nothing committed
    assert good.seq_len == len(PROMPT) + good.accepted + 1
    for seq in ("g1", "g2", "bad-v"):
        asyncio.run(engine.release(seq))
    assert engine.kv_usage() == 0
