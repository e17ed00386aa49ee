"""SIGTERM drains each of the three services: it reports NOT_SERVING at once, refuses new work
(503 / UNAVAILABLE, with a message) while the work in flight finishes, then exits 0.

- gateway: streams in flight complete in full; new HTTP and gRPC requests are refused meanwhile;
- target: new sequences (Prefill) are refused; the gateway's streams keep verifying on it until
  they are done, then it exits;
- draft: Proposes that start a sequence are refused; the streams go on (autoregressively) and
  it exits once they have released their sequences.
Outputs are compared with an undisturbed run of the same requests on the same stack."""
from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2
from support.procs import health_status
from support.reliability import (
    PROMPTS,
    TARGET_FLAGS,
    Streams,
    gauge,
    report,
    request,
    sigterm,
    start_stack,
    tiny_hybrid,
    wait_for,
)

from dflash.v1 import draft_pb2, draft_pb2_grpc, gateway_pb2, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

N = 200
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("reliability_drain")


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm2_dir):
    return tiny_hybrid(tmp_path_factory, smollm2_dir)


def undisturbed(st, prompts: list[str]) -> list[list[int]]:
    results = Streams(st.gateway.stub, [request(p, N) for p in prompts]).start().join()
    assert all(r.error is None for r in results)
    return [r.tokens for r in results]


def assert_complete(results, expected: list[list[int]]) -> None:
    errors = [r.error for r in results if r.error is not None]
    assert not errors, errors[0]
    for r, want in zip(results, expected):
        assert r.finish_reason == "length" and r.tokens == want


def refused_while(streams: Streams, attempt, interval: float = 0.25) -> int:
    """Calls attempt() (which asserts a refusal) until every stream has finished. An attempt
    that fails once the last stream has finished raced the service's exit (it drains, then
    stops listening) and ends the loop; one that fails while a stream still runs is a failure."""
    def running() -> bool:
        return any(not r.finish_reason and r.error is None for r in streams.results)

    n = 0
    while running():
        try:
            attempt()
        except (AssertionError, grpc.RpcError, httpx.HTTPError):
            deadline = time.monotonic() + 5          # the last events may still be on their way
            while running() and time.monotonic() < deadline:
                time.sleep(0.05)
            if running():
                raise
            break
        n += 1
        time.sleep(interval)
    return n


def test_gateway_sigterm_finishes_in_flight_and_refuses_new(model, logs):
    st = start_stack(model, logs, "--drain-grace", "120")
    gw = st.gateway
    try:
        expected = undisturbed(st, PROMPTS[:4])
        streams = Streams(gw.stub, [request(p, N) for p in PROMPTS[:4]]).start()
        streams.wait_tokens(8)
        sigterm(gw)
        t0 = time.monotonic()
        wait_for(lambda: health_status(gw.address, "dflash.v1.Gateway") != SERVING, 5,
                 "NOT_SERVING")

        def attempt():
            r = httpx.post(f"{gw.http_url}/v1/completions", timeout=10,
                           json={"model": "m", "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
            with pytest.raises(grpc.RpcError) as e:
                list(gw.stub.Generate(request("hi", 4), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in e.value.details()
            status, body = gw.readiness()
            assert status == 503 and "shutting down" in body["reason"]

        refused = refused_while(streams, attempt)
        assert_complete(streams.join(), expected)
        assert gw.proc.wait(30) == 0
        exit_s = time.monotonic() - t0
        wait_for(lambda: gauge(st.target_metrics, "dflash_sequences_active") == 0, 10,
                 "target sequences released")
        assert refused >= 1
        report("drain_gateway", in_flight=4, completed=4, tokens_each=N,
               new_requests_refused=2 * refused, exit_code=0, sigterm_to_exit_s=round(exit_s, 1))
    finally:
        st.stop()


def test_target_sigterm_serves_its_sequences_to_the_end(model, logs):
    st = start_stack(model, logs, "--upstream-wait", "1", drafter="none",
                     target_flags=(*TARGET_FLAGS, "--drain-grace", "120"))
    target = st.target
    try:
        expected = undisturbed(st, PROMPTS[:4])
        streams = Streams(st.gateway.stub, [request(p, N) for p in PROMPTS[:4]]).start()
        streams.wait_tokens(8)
        sigterm(target)
        t0 = time.monotonic()
        wait_for(lambda: health_status(target.address, "dflash.v1.Target") != SERVING, 5,
                 "target NOT_SERVING")
        channel = grpc.insecure_channel(target.address)
        stub = target_pb2_grpc.TargetStub(channel)

        def attempt():
            with pytest.raises(grpc.RpcError) as e:
                stub.Prefill(target_pb2.PrefillRequest(sequence_id="probe", token_ids=[1, 2, 3]),
                             timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in e.value.details()

        refused = refused_while(streams, attempt)
        # the gateway saw its target NOT_SERVING: new requests wait --upstream-wait, then 503
        r = httpx.post(f"{st.gateway.http_url}/v1/completions", timeout=30,
                       json={"model": "m", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503
        channel.close()
        assert_complete(streams.join(), expected)
        assert target.proc.wait(30) == 0
        exit_s = time.monotonic() - t0
        assert refused >= 1
        report("drain_target", in_flight=4, completed=4, tokens_each=N,
               new_sequences_refused=refused, exit_code=0, sigterm_to_exit_s=round(exit_s, 1))
    finally:
        st.stop()


def test_draft_sigterm_lets_streams_go_on_and_exits_when_released(model, logs):
    st = start_stack(model, logs, draft_flags=("--drain-grace", "120"))
    draft = st.draft
    try:
        expected = undisturbed(st, PROMPTS[:4])
        streams = Streams(st.gateway.stub, [request(p, N) for p in PROMPTS[:4]]).start()
        streams.wait_tokens(8)
        sigterm(draft)
        t0 = time.monotonic()
        wait_for(lambda: health_status(draft.address, "dflash.v1.Draft") != SERVING, 5,
                 "draft NOT_SERVING")
        channel = grpc.insecure_channel(draft.address)
        stub = draft_pb2_grpc.DraftStub(channel)

        def attempt():
            with pytest.raises(grpc.RpcError) as e:
                stub.Propose(draft_pb2.ProposeRequest(
                    sequence_id="probe", positions=[0, 1, 2], new_token_ids=[1000, 1001, 1002],
                    anchor=1003, block_size=4), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in e.value.details()

        refused = refused_while(streams, attempt)
        channel.close()
        assert_complete(streams.join(), expected)
        assert draft.proc.wait(30) == 0
        exit_s = time.monotonic() - t0
        info = st.gateway.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())
        assert not info.speculative                      # serving on, autoregressively
        assert refused >= 1
        report("drain_draft", in_flight=4, completed=4, tokens_each=N,
               new_sequences_refused=refused, exit_code=0, sigterm_to_exit_s=round(exit_s, 1))
    finally:
        st.stop()
