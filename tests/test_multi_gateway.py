"""Several gateways on one target and one draft (issue 37, part 2: gateways behind one Kubernetes
Service, each owning its own requests, without talking to each other).

Each gateway's sequences are its own on the services (services/common/callers.py: its caller
key), so two gateways may even use the same sequence ids. Tests: streams through two gateways at
once all equal the target alone; a gateway killed (-9) mid-stream takes only its own streams
with it - the other gateway's finish identical - and what the dead one held on the services is
freed (its calls in flight at once, the rest by the short lease given here)."""
from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest
from support.draft_service import start_draft
from support.gateway_stack import start_gateway, wait_until
from support.procs import free_port, start_target
from support.reliability import gauge
from support.target_client import greedy_alone

from dflash.make_draft import make_random_drafter
from dflash.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.slow

PROMPTS = [list(range(5 + i, 45 + 2 * i)) for i in range(4)]
TOKENS = 40
LEASE_S = 4


@pytest.fixture(scope="module")
def stack(tiny_llama_02_dir, smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("multi_gateway")
    drafter = make_random_drafter(tiny_llama_02_dir, logs / "drafter", block_size=4)
    metrics = free_port()
    target = start_target(tiny_llama_02_dir, logs, "--metrics-port", str(metrics),
                          "--lease-seconds", str(LEASE_S))
    target.metrics_port = metrics
    draft = start_draft(tiny_llama_02_dir, logs, "--lease-seconds", str(LEASE_S),
                        model_dir=drafter)
    gateways = [start_gateway(target.address, smollm2_dir, logs, draft=draft.address)
                for _ in range(2)]
    yield target, draft, gateways
    for p in (*gateways, draft, target):
        p.stop()


def _stream(gw, prompt: list[int], into: list, started: threading.Event | None = None,
            tokens: int = TOKENS) -> None:
    """One greedy stream through `gw`; its tokens appended to `into` (an error too)."""
    req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt),
                                      max_tokens=tokens, ignore_eos=True,
                                      sampling=common_pb2.SamplingParams(temperature=0))
    try:
        for r in gw.stub.Generate(req, timeout=120):
            into.extend(r.token_ids)
            if started is not None:
                started.set()
    except grpc.RpcError as e:
        into.append(e.code())


def _run(streams: list[tuple]) -> list[threading.Thread]:
    threads = [threading.Thread(target=_stream, args=args) for args in streams]
    for t in threads:
        t.start()
    return threads


def _sequences_held(target) -> float:
    return gauge(target.metrics_port, "dflash_sequences_active")


def test_streams_through_two_gateways_equal_the_target_alone(stack):
    target, _, gateways = stack
    expected = [greedy_alone(target.address, p, TOKENS) for p in PROMPTS]
    got = {(g, i): [] for g in range(2) for i in range(len(PROMPTS))}
    for t in _run([(gateways[g], PROMPTS[i], got[g, i]) for g, i in got]):
        t.join(180)
    for (g, i), tokens in got.items():
        assert tokens == expected[i], (g, i)
    wait_until(lambda: _sequences_held(target) == 0, timeout=10, what="no sequence held")


def test_a_gateway_killed_mid_stream_takes_only_its_own_streams(stack):
    target, _, (victim, survivor) = stack
    expected = [greedy_alone(target.address, p, TOKENS) for p in PROMPTS]
    lost, kept = [[] for _ in PROMPTS], [[] for _ in PROMPTS]
    started = [threading.Event() for _ in PROMPTS]
    threads = _run([(victim, p, lost[i], started[i], 900) for i, p in enumerate(PROMPTS)]
                   + [(survivor, p, kept[i]) for i, p in enumerate(PROMPTS)])
    for e in started:
        assert e.wait(60), "the victim's streams never started"
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    for t in threads:
        t.join(180)
    assert kept == expected                                  # the other gateway's, untouched
    cut = [s[-1] for s in lost if isinstance(s[-1], grpc.StatusCode)]
    assert cut and set(cut) == {grpc.StatusCode.UNAVAILABLE}, lost   # killed mid-stream
    wait_until(lambda: _sequences_held(target) == 0, timeout=LEASE_S + 6,
               what="the dead gateway's sequences freed")
