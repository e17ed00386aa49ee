"""Cancelled work frees its sequence at once (issue 39, hole 5): leases are the last resort.

A burst of Prefills cancelled while they run or wait (SmolLM2 target, 3 000-token prompts in
32-token chunks: each takes a few seconds here, cancelled once the first holds pages) leaves no KV pages and no sequence behind
within a second of the last cancel - before, each kept its pages for the 120 s lease. A cancelled
Prefill followed at once by a new Prefill of the same id must not take the new one with it. (The
draft's Propose: tests/test_draft_engine.py.)"""
from __future__ import annotations

import time

import grpc
import pytest
from support.procs import free_port, start_target
from support.reliability import gauge

from dflash.v1 import common_pb2, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = [(7 * i) % 5000 + 10 for i in range(3000)]


@pytest.fixture(scope="module")
def target(smollm2_dir, tmp_path_factory):
    port = free_port()
    p = start_target(smollm2_dir, tmp_path_factory.mktemp("prompt_release"), "--token-budget",
                     "32", "--metrics-port", str(port))
    p.metrics_port = port
    yield p
    p.stop()


def _usage(port: int) -> tuple[float, float]:
    return (gauge(port, "dflash_kv_cache_usage_ratio"), gauge(port, "dflash_sequences_active"))


def _prefill(seq: str, ids: list[int]) -> target_pb2.PrefillRequest:
    return target_pb2.PrefillRequest(sequence_id=seq, token_ids=ids,
                                     sampling=common_pb2.SamplingParams(temperature=0))


def test_a_burst_of_cancelled_prefills_frees_everything_within_a_second(target):
    with grpc.insecure_channel(target.address) as channel:
        stub = target_pb2_grpc.TargetStub(channel)
        futures = [stub.Prefill.future(_prefill(f"burst-{i}", PROMPT), timeout=120)
                   for i in range(8)]
        # the first is running (it holds pages of its prompt), the rest wait: polled, not a fixed
        # 0.3 s - on a loaded host the first chunk may not have run by then
        deadline = time.monotonic() + 10
        while _usage(target.metrics_port)[0] == 0:
            assert time.monotonic() < deadline, "no prefill holds pages 10 s after the burst"
            time.sleep(0.02)
        assert all(f.cancel() for f in futures)          # none had finished
        cancelled_at = time.monotonic()
        while _usage(target.metrics_port) != (0, 0):
            assert time.monotonic() - cancelled_at < 1.0, _usage(target.metrics_port)
            time.sleep(0.02)
        # the target serves on
        resp = stub.Prefill(_prefill("after", PROMPT[:32]), timeout=60)
        assert resp.seq_len == 32
        stub.Release(common_pb2.ReleaseRequest(sequence_id="after"), timeout=30)


def test_a_cancelled_prefill_does_not_take_its_successor(target):
    """The gateway prefills a sequence again right after giving up on a Prefill: the release of
    the abandoned one must not free the new one, whichever reaches the engine first."""
    with grpc.insecure_channel(target.address) as channel:
        stub = target_pb2_grpc.TargetStub(channel)
        for _ in range(3):
            old = stub.Prefill.future(_prefill("again", PROMPT), timeout=120)
            time.sleep(0.2)
            assert old.cancel()
            new = stub.Prefill(_prefill("again", PROMPT[:40]), timeout=60)
            time.sleep(0.3)                              # any late release has run by now
            v = stub.Verify(target_pb2.VerifyRequest(sequence_id="again",
                                                     token_ids=[new.next_token]), timeout=60)
            assert v.seq_len == 41
        stub.Release(common_pb2.ReleaseRequest(sequence_id="again"), timeout=30)
        assert _usage(target.metrics_port) == (0, 0)
