"""The internal ports' shared secret (issue 39, hole 4; services/common/internal_auth.py).

A target and a DFlash draft with a token (from the environment, as `dflash up` hands it over),
the target offering only its feature stream so that the draft's own client side is exercised:

- the gateway with the token serves, greedy output identical to the target alone;
- every dflash.v1 call without it, or with another one, is UNAUTHENTICATED naming the metadata
  entry - Prefill, Verify, the call streams, FeatureStream, Propose, AttachPlane,
  GetCapabilities - while health stays open for probes;
- a gateway without the token never becomes ready, and says why."""
from __future__ import annotations

import os
import re
import signal

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.draft_service import propose_request, start_draft
from support.gateway_stack import start_gateway, wait_until
from support.procs import start_target

from dflash.make_draft import make_random_drafter
from dflash.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    target_pb2,
    target_pb2_grpc,
)
from services.common import callers
from services.common.internal_auth import ENV, HEADER

pytestmark = pytest.mark.slow

TOKEN = "internal-0123456789abcdef"
PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def services(tiny_llama_02_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("internal_auth")
    drafter = make_random_drafter(tiny_llama_02_dir, logs / "drafter", block_size=4)
    env = {ENV: TOKEN}
    target = start_target(tiny_llama_02_dir, logs, "--feature-plane", "stream", env=env)
    draft = start_draft(tiny_llama_02_dir, logs, model_dir=drafter, env=env)
    yield target, draft, logs
    draft.stop()
    target.stop()


def test_the_gateway_with_the_token_serves(services, smollm2_dir):
    target, draft, logs = services
    gw = start_gateway(target.address, smollm2_dir, logs, "--internal-token", TOKEN,
                       "--speculation", "fixed", draft=draft.address)
    try:
        tokens, _, responses = gw.generate(PROMPT, 24)
        with grpc.insecure_channel(target.address) as channel:
            stub = target_pb2_grpc.TargetStub(channel)
            md = ((HEADER, TOKEN),)
            ref = stub.Prefill(target_pb2.PrefillRequest(sequence_id="ref", token_ids=PROMPT),
                               metadata=md, timeout=60)
            expected = [ref.next_token]
            while len(expected) < len(tokens):
                v = stub.Verify(target_pb2.VerifyRequest(sequence_id="ref",
                                                         token_ids=[expected[-1]]),
                                metadata=md, timeout=60)
                expected += list(v.committed_tokens)
            stub.Release(common_pb2.ReleaseRequest(sequence_id="ref"), metadata=md, timeout=30)
        assert tokens == expected[:len(tokens)] and responses[-1].usage.draft_steps > 0
        assert "features travel through the target's stream plane" in gw.log()
    finally:
        gw.stop()


def _unauthenticated(call) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
    assert HEADER in e.value.details()


@pytest.mark.parametrize("sent", [None, "wrong-token"])
def test_calls_without_the_token_are_refused(services, sent):
    target, draft, _ = services
    md = () if sent is None else ((HEADER, sent),)
    with grpc.insecure_channel(target.address) as tc, grpc.insecure_channel(draft.address) as dc:
        t, d = target_pb2_grpc.TargetStub(tc), draft_pb2_grpc.DraftStub(dc)
        _unauthenticated(lambda: t.Prefill(target_pb2.PrefillRequest(
            sequence_id="x", token_ids=PROMPT), metadata=md, timeout=30))
        _unauthenticated(lambda: t.Verify(target_pb2.VerifyRequest(
            sequence_id="x", token_ids=[1]), metadata=md, timeout=30))
        _unauthenticated(lambda: t.GetCapabilities(common_pb2.GetCapabilitiesRequest(),
                                                   metadata=md, timeout=30))
        _unauthenticated(lambda: list(t.VerifyStream(iter([target_pb2.VerifyStreamRequest(
            call_id=1, request=target_pb2.VerifyRequest(sequence_id="x", token_ids=[1]))]),
            metadata=md, timeout=30)))
        _unauthenticated(lambda: next(t.FeatureStream(common_pb2.FeatureStreamRequest(
            plane_id="any"), metadata=md, timeout=30)))
        _unauthenticated(lambda: d.Propose(draft_pb2.ProposeRequest(
            sequence_id="x", positions=[0], anchor=1), metadata=md, timeout=30))
        _unauthenticated(lambda: d.AttachPlane(common_pb2.FeaturePlane(transport="shm"),
                                               metadata=md, timeout=30))
        for channel, name in ((tc, "dflash.v1.Target"), (dc, "dflash.v1.Draft")):
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=name), timeout=30)
            assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_gateway_without_the_token_is_not_ready(services, smollm2_dir):
    target, _, logs = services
    gw = start_gateway(target.address, smollm2_dir, logs, wait=False)

    def reason() -> str:
        try:
            return gw.readiness()[1].get("reason", "")
        except OSError:                                  # not listening yet
            return ""
    try:
        wait_until(lambda: "UNAUTHENTICATED" in reason(), timeout=60,
                   what="the reason in /readiness")
        assert gw.readiness()[0] == 503
    finally:
        gw.stop()


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_a_sequence_answers_only_the_caller_that_created_it(services):
    """Issue 39, hole 4: the internal token lets a caller in, but a sequence belongs to the
    caller that created it (its caller key, services/common/callers.py): another caller naming
    the same id - even with the token, or with no key at all - gets NOT_FOUND, its Release frees
    nothing, its Prefill makes a sequence of its own, and the owner's sequence goes on as if
    nobody had tried."""
    target, draft, _ = services
    a = ((HEADER, TOKEN), (callers.HEADER, callers.new_key()))
    b = ((HEADER, TOKEN), (callers.HEADER, callers.new_key()))
    anonymous = ((HEADER, TOKEN),)
    with grpc.insecure_channel(target.address) as tc, grpc.insecure_channel(draft.address) as dc:
        t, d = target_pb2_grpc.TargetStub(tc), draft_pb2_grpc.DraftStub(dc)
        prefill = lambda seq, md, ids=PROMPT: t.Prefill(target_pb2.PrefillRequest(
            sequence_id=seq, token_ids=ids), metadata=md, timeout=60)
        verify = lambda seq, md, tok: t.Verify(target_pb2.VerifyRequest(
            sequence_id=seq, token_ids=[tok]), metadata=md, timeout=60)
        release = lambda seq, md: t.Release(common_pb2.ReleaseRequest(sequence_id=seq),
                                            metadata=md, timeout=30).released
        expected = [prefill("ref", anonymous).next_token]
        for _ in range(6):
            expected += list(verify("ref", anonymous, expected[-1]).committed_tokens)
        assert release("ref", anonymous)

        got = [prefill("s", a).next_token]
        for intruder in (b, anonymous):
            assert _code(lambda md=intruder: verify("s", md, got[-1])) == grpc.StatusCode.NOT_FOUND
            stream = t.VerifyStream(iter([target_pb2.VerifyStreamRequest(
                call_id=1, request=target_pb2.VerifyRequest(sequence_id="s", token_ids=[got[-1]]))]),
                metadata=intruder, timeout=30)
            assert [m.status.code for m in stream] == [grpc.StatusCode.NOT_FOUND.value[0]]
            assert release("s", intruder) is False
        prefill("s", b, list(range(100, 130)))          # b's own "s", beside a's
        for _ in range(6):
            got += list(verify("s", a, got[-1]).committed_tokens)
        assert got == expected
        assert release("s", a) and release("s", b) and not release("s", a)

        width = d.GetCapabilities(common_pb2.GetCapabilitiesRequest(), metadata=a, timeout=30)
        width = width.hidden_size * len(width.target_layer_ids)
        features = torch.randn(4, width).to(torch.bfloat16)
        proposed = d.Propose(propose_request("p", features, 0, 7), metadata=a, timeout=60)
        more = propose_request("p", features[:1], 4, 9)
        for intruder in (b, anonymous):
            assert _code(lambda md=intruder: d.Propose(more, metadata=md, timeout=60)) \
                == grpc.StatusCode.NOT_FOUND
            assert d.Release(common_pb2.ReleaseRequest(sequence_id="p"), metadata=intruder,
                             timeout=30).released is False
        assert d.Propose(more, metadata=a, timeout=60).context_len == proposed.context_len + 1
        assert d.Release(common_pb2.ReleaseRequest(sequence_id="p"), metadata=a,
                         timeout=30).released


def test_a_known_sequence_id_does_not_let_an_insider_drive_the_gateways_stream(services, smollm2_dir):
    """The outside probe's attack, replayed: a sequence id read from a log (here the gateway's,
    at DEBUG) and the internal token were enough to send Verify calls on another user's sequence,
    whose stream then ended 200 with wrong text. Now the gateway's sequences answer only its own
    caller key: with the gateway paused (SIGSTOP) mid-stream, so that its sequence certainly
    exists, three Verify calls and a Release with the token are NOT_FOUND / released: false,
    and the stream, resumed, equals the target alone."""
    target, draft, logs = services
    gw = start_gateway(target.address, smollm2_dir, logs, "--internal-token", TOKEN,
                       "--log-level", "DEBUG", draft=draft.address)
    try:
        req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPT),
                                          max_tokens=48,
                                          sampling=common_pb2.SamplingParams(temperature=0.0))
        stream = gw.stub.Generate(req, timeout=120)
        tokens = list(next(stream).token_ids)
        os.kill(gw.proc.pid, signal.SIGSTOP)
        try:
            seq_id = re.search(r"request started .*?seq=(\S+)", gw.log()).group(1)
            with grpc.insecure_channel(target.address) as channel:
                t = target_pb2_grpc.TargetStub(channel)
                for token in (1, 2, 3):
                    assert _code(lambda tok=token: t.Verify(target_pb2.VerifyRequest(
                        sequence_id=seq_id, token_ids=[tok]), metadata=((HEADER, TOKEN),),
                        timeout=30)) == grpc.StatusCode.NOT_FOUND
                assert not t.Release(common_pb2.ReleaseRequest(sequence_id=seq_id),
                                     metadata=((HEADER, TOKEN),), timeout=30).released
        finally:
            os.kill(gw.proc.pid, signal.SIGCONT)
        tokens += [t for r in stream for t in r.token_ids]
        with grpc.insecure_channel(target.address) as channel:
            expected = _target_alone(target_pb2_grpc.TargetStub(channel), len(tokens))
        assert tokens == expected
    finally:
        gw.stop()


def _target_alone(t, n: int) -> list[int]:
    """The target's own greedy continuation of PROMPT (n tokens), as an anonymous caller."""
    md = ((HEADER, TOKEN),)
    out = [t.Prefill(target_pb2.PrefillRequest(sequence_id="alone", token_ids=PROMPT),
                     metadata=md, timeout=60).next_token]
    while len(out) < n:
        out += list(t.Verify(target_pb2.VerifyRequest(sequence_id="alone", token_ids=[out[-1]]),
                             metadata=md, timeout=60).committed_tokens)
    t.Release(common_pb2.ReleaseRequest(sequence_id="alone"), metadata=md, timeout=30)
    return out[:n]
