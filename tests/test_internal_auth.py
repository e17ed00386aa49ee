"""The internal ports' shared secret (issue 39, hole 4; services/common/internal_auth.py).

A target and a DFlash draft with a token (from the environment, as `dflash up` hands it over),
the target offering only its feature stream so that the draft's own client side is exercised:

- the gateway with the token serves, greedy output identical to the target alone;
- every dflash.v1 call without it, or with another one, is UNAUTHENTICATED naming the metadata
  entry - Prefill, Verify, the call streams, FeatureStream, Propose, AttachPlane,
  GetCapabilities - while health stays open for probes;
- a gateway without the token never becomes ready, and says why."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.draft_service import start_draft
from support.gateway_stack import start_gateway, wait_until
from support.procs import start_target

from dflash.make_draft import make_random_drafter
from dflash.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
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
                       draft=draft.address)
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
