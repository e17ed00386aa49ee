"""Losslessness through three real processes (target, draft, gateway) on SmolLM2-135M fp32:
greedy output is token-identical to transformers' greedy `generate`, autoregressively, with a
DFlash drafter (random weights: acceptance is low, output must still be exact), with prompt
lookup, and with the draft service killed (and restarted) in the middle of a request."""
from __future__ import annotations

import os
import signal

import pytest
from support.draft_service import start_draft
from support.gateway_stack import GreedyReference, generate_concurrently, start_gateway, wait_until
from support.procs import ServiceProcess, start_target
from support.target_client import TargetClient

from dflash.make_draft import make_random_drafter
from dflash.v1 import common_pb2, gateway_pb2
from runtime.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow

N = 48
CHATS = ["Write a short story about a robot who learns to paint.",
         "Explain how photosynthesis works in simple terms.",
         "Repeat the following sentence three times: The cat sat on the mat near the door."]
TEXTS = ["The history of the Roman Empire began",
         'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n']


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("gateway_e2e")


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    tok = ChatTokenizer(smollm2_dir)
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHATS]
    return chats + [tok.encode(t, add_special_tokens=True) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(smollm2_reference) -> GreedyReference:
    return smollm2_reference


@pytest.fixture(scope="module")
def target(smollm2_dir, logs):
    p = start_target(smollm2_dir, logs)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def dflash_dir(smollm2_dir, tmp_path_factory):
    return make_random_drafter(smollm2_dir, tmp_path_factory.mktemp("random_dflash"), block_size=4)


@pytest.fixture(scope="module")
def inband_target(smollm2_dir, logs):
    """A target that offers no feature plane: features travel in messages."""
    p = start_target(smollm2_dir, logs, "--feature-plane", "off")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def stream_target(smollm2_dir, logs):
    """A target that offers only its feature stream (as a draft on another host would use)."""
    p = start_target(smollm2_dir, logs, "--feature-plane", "stream")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def gateways(smollm2_dir, dflash_dir, target, inband_target, stream_target, logs):
    """kind -> gateway; the drafts are started alongside. "dflash" reads the features from the
    target's shared-memory plane, "dflash-stream" from the target's feature stream,
    "dflash-inband" gets them in messages."""
    dflash = start_draft(smollm2_dir, logs, model_dir=dflash_dir)
    lookup = start_draft(smollm2_dir, logs, "--drafter", "prompt-lookup")
    # fixed sizes: every step drafts, whatever the machine's load (auto may price drafting out
    # on a busy CPU, and then a drafter's exactness is not what runs; auto's own output is
    # checked in tests/test_adaptive_speculation.py)
    fixed = ("--speculation", "fixed")
    gws = {"autoregressive": start_gateway(target.address, smollm2_dir, logs),
           "dflash": start_gateway(target.address, smollm2_dir, logs, *fixed,
                                   draft=dflash.address),
           "dflash-inband": start_gateway(inband_target.address, smollm2_dir, logs, *fixed,
                                          draft=dflash.address),
           "dflash-stream": start_gateway(stream_target.address, smollm2_dir, logs, *fixed,
                                          draft=dflash.address),
           "prompt-lookup": start_gateway(target.address, smollm2_dir, logs, *fixed,
                                          draft=lookup.address)}
    yield gws
    for p in [*gws.values(), dflash, lookup]:
        p.stop()


def plane_used(plane: str) -> str:
    return f"features travel through the target's {plane} plane"


@pytest.mark.parametrize("kind", ["autoregressive", "dflash", "dflash-inband", "dflash-stream",
                                  "prompt-lookup"])
def test_greedy_output_is_token_identical_to_transformers(kind, gateways, prompts, reference):
    gw = gateways[kind]
    info = gw.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
    assert info.speculative == (kind != "autoregressive")
    drafter = kind.removesuffix("-inband").removesuffix("-stream")
    assert info.drafter_kind == ("" if kind == "autoregressive" else drafter)
    assert (plane_used("shm") in gw.log()) == (kind == "dflash")      # the transport really used
    assert (plane_used("stream") in gw.log()) == (kind == "dflash-stream")
    drafted = accepted = 0
    for ids in prompts:
        tokens, _, responses = gw.generate(ids, N)
        assert tokens == reference(ids, N), f"{kind}: prompt {ids[-8:]}"
        usage = responses[-1].usage
        assert usage.completion_tokens == len(tokens) and usage.prompt_tokens == len(ids)
        assert responses[-1].finish_reason == ("length" if len(tokens) == N else "stop")
        assert sum(r.accepted for r in responses) == usage.accepted_tokens
        drafted += usage.draft_tokens
        accepted += usage.accepted_tokens
    assert sum(len(reference(ids, N)) == N for ids in prompts) >= 4     # mostly full-length runs
    if kind == "autoregressive":
        assert drafted == 0
    else:
        assert drafted > 0                     # speculation really happened
    if kind == "prompt-lookup":
        assert accepted > 0                    # and some drafts were right


def test_concurrent_requests_are_each_exact(gateways, prompts, reference):
    results = generate_concurrently(gateways["prompt-lookup"], prompts, N)
    assert all(results[i] == reference(ids, N) for i, ids in enumerate(prompts))


@pytest.mark.parametrize("plane", ["shm", "stream", "off"])
def test_draft_killed_and_restarted_mid_request(smollm2_dir, dflash_dir, target, inband_target,
                                                stream_target, logs, prompts, reference, plane):
    """Killed: the request goes on autoregressively. Restarted on the same port while the request
    runs: the draft answers NOT_FOUND (or, with a plane it has not attached yet, DATA_LOSS), the
    gateway rebuilds its context (a target prefill) and speculation resumes. The output stays
    identical throughout, with features through the shared-memory plane, the target's feature
    stream, or in messages."""
    draft = start_draft(smollm2_dir, logs, model_dir=dflash_dir)
    tgt = {"shm": target, "stream": stream_target, "off": inband_target}[plane]
    gw = start_gateway(tgt.address, smollm2_dir, logs, "--speculation", "fixed",
                       draft=draft.address)
    ids, n = prompts[0], 120
    expected = reference(ids, n)
    restarted = None
    try:
        req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=ids), max_tokens=n,
                                          sampling=common_pb2.SamplingParams(temperature=0))
        tokens, last = [], None
        for i, r in enumerate(gw.stub.Generate(req, timeout=600)):
            tokens += r.token_ids
            last = r
            if i == 3:
                os.killpg(draft.proc.pid, signal.SIGKILL)
                draft.proc.wait(5)
                restarted = ServiceProcess("services.draft", draft.args, draft.service, draft.port,
                                           logs).start()
        assert tokens == expected
        assert last.usage.draft_steps > 3          # speculated before the kill and after the restart
        assert "rebuilding the draft context" in gw.log()
        assert "not serving" in gw.log()
        # and the next request speculates from the start again, still exact
        restarted.wait_serving()
        wait_until(lambda: gw.readiness()[1]["reason"].startswith("serving (speculative"),
                   what="speculation back on")
        tokens, _, responses = gw.generate(prompts[1], N)
        assert tokens == reference(prompts[1], N) and responses[-1].usage.draft_steps > 0
        attached = gw.log().count(plane_used(plane))     # attached again after the restart
        assert attached >= 2 if plane != "off" else "features travel through" not in gw.log()
    finally:
        for p in (gw, draft, restarted):
            if p is not None:
                p.stop()


@pytest.mark.parametrize("plane", ["shm", "stream", "off"])
def test_target_restarted_mid_request(smollm2_dir, dflash_dir, logs, prompts, reference, plane):
    """The target dies (kill -9) and comes back on the same port during a request: the gateway
    waits for it (bounded by the step deadline), prefills the committed tokens again, and the
    output has nothing lost or repeated. With a plane, the restarted target offers a new one,
    the draft attaches it, and the dead target's shared memory is removed."""
    target = start_target(smollm2_dir, logs, "--feature-plane", plane)
    draft = start_draft(smollm2_dir, logs, model_dir=dflash_dir)
    gw = start_gateway(target.address, smollm2_dir, logs, "--speculation", "fixed",
                       draft=draft.address)
    dead_plane = [p.plane_id for p in TargetClient(target.address).capabilities().feature_planes]
    restarted = None
    ids, n = prompts[0], 96
    try:
        req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=ids), max_tokens=n,
                                          sampling=common_pb2.SamplingParams(temperature=0))
        tokens = []
        for i, r in enumerate(gw.stub.Generate(req, timeout=600)):
            tokens += r.token_ids
            if i == 3:
                os.killpg(target.proc.pid, signal.SIGKILL)
                target.proc.wait(5)
                restarted = ServiceProcess("services.target", target.args, target.service,
                                           target.port, logs).start()
        assert tokens == reference(ids, n)
        assert "target lost the sequence (UNAVAILABLE)" in gw.log()
        if plane != "off":
            wait_until(lambda: gw.log().count(plane_used(plane)) >= 2,
                       what="the new plane attached")
        else:
            assert "features travel through" not in gw.log()
        assert not any(os.path.exists(f"/dev/shm/dflash-features-{p}") for p in dead_plane)
    finally:
        for p in (gw, target, restarted, draft):
            if p is not None:
                p.stop()
