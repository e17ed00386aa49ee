"""--wire stream: the gateway's Propose and Verify calls multiplexed on one long-lived
bidirectional stream per upstream (Target.VerifyStream, Draft.ProposeStream; the contract is at
CallStatus in proto/dflash/v1/common.proto).

- in process (a fake target behind the real servicer plumbing, no model): a call's own deadline,
  a cancelled call, a stream that breaks (calls in flight fail UNAVAILABLE, the next call opens a
  new stream), large requests sent unary, drain refusals per call, undecodable bytes, and the
  fallback to unary for a service without the stream method;
- raw streams against real target and draft services: a bad call answers its own status with
  the unary message while the other calls on the same stream succeed;
- through the gateway (SmolLM2, three processes): greedy output identical to --wire unary and to
  transformers, concurrent requests on one stream, and a target / draft restarted mid-request."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc
import pytest
from prometheus_client import REGISTRY
from support import prom
from support.draft_service import propose_request, start_draft
from support.gateway_stack import chat_prompts, generate_concurrently, start_gateway, wait_until
from support.procs import ServiceProcess, free_port, start_target
from support.target_client import TargetClient

from dflash.make_draft import make_random_drafter
from dflash.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    target_pb2,
    target_pb2_grpc,
)
from gateway.config import GatewayConfig
from gateway.upstream import Upstream, UpstreamError
from services.common.errors import NotFound
from services.common.guard import Drain
from services.common.server import Readiness, build_server
from services.target import servicer as target_servicer

OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND, UNAVAILABLE = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE
MAX_BLOCK = 8


def code_of(reply) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == reply.status.code)


# -- in process: a fake target behind the real servicer, guard and server ------------------------
class FakeTarget(target_servicer.TargetServicer):
    """Verify answers at once (committed = the block), after `slow_s` for sequence "slow";
    unknown sequence "gone"; a bug for "bug". Records the calls that were cancelled."""

    def __init__(self, slow_s: float = 5.0) -> None:
        super().__init__()
        self.slow_s = slow_s
        self.cancelled: list[str] = []

    async def verify(self, request: target_pb2.VerifyRequest, owner: str
                     ) -> target_pb2.VerifyResponse:
        if request.sequence_id == "gone":
            raise NotFound("unknown sequence 'gone'")
        if request.sequence_id == "bug":
            raise RuntimeError("a bug")
        if request.sequence_id == "slow":
            try:
                await asyncio.sleep(self.slow_s)
            except asyncio.CancelledError:
                self.cancelled.append(request.sequence_id)
                raise
        return target_pb2.VerifyResponse(committed_tokens=request.token_ids, seq_len=1)


@contextlib.asynccontextmanager
async def fake_server(port: int, servicer: FakeTarget | None = None, drain: Drain | None = None
                      ) -> AsyncIterator[FakeTarget]:
    servicer = servicer or FakeTarget()
    server = build_server(port, "127.0.0.1", 1 << 20, Readiness(target_servicer.SERVICE_NAME),
                          lambda s: target_servicer.add_to_server(servicer, s), drain=drain)
    await server.start()
    try:
        yield servicer
    finally:
        await server.stop(0)


def upstream(port: int, wire: str = "stream") -> Upstream:
    config = GatewayConfig(target=f"127.0.0.1:{port}", tokenizer_dir="unused", wire=wire)
    up = Upstream("target", config.target, target_servicer.SERVICE_NAME,
                  target_pb2_grpc.TargetStub, config, lambda: None,
                  {"Verify": (target_pb2.VerifyStreamRequest, target_pb2.VerifyStreamResponse)})
    up.model_name = "wire-test"
    return up


def verify(seq: str, tokens: Sequence[int] = (1, 2)) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(sequence_id=seq, token_ids=list(tokens))


async def outcome(up: Upstream, seq: str, timeout: float = 10.0):
    """The call's committed tokens, or its UpstreamError code."""
    try:
        return list((await up.call("Verify", verify(seq, (len(seq), 2)), timeout)).committed_tokens)
    except UpstreamError as e:
        return e.code


def upstream_errors(code: grpc.StatusCode) -> float:
    return REGISTRY.get_sample_value("dflash_upstream_errors_total", {
        "model_name": "wire-test", "upstream": "target", "code": code.name}) or 0.0


def test_a_call_past_its_deadline_fails_alone():
    """DEADLINE_EXCEEDED for that call only (the server cancels it too, from timeout_ms); the
    calls around it succeed on the same stream, and the upstream is not marked down."""
    async def main():
        port = free_port()
        async with fake_server(port) as fake:
            up = upstream(port)
            slow = asyncio.create_task(outcome(up, "slow", timeout=0.3))
            fast = await asyncio.gather(*(outcome(up, f"s{i}") for i in range(4)))
            assert await slow == grpc.StatusCode.DEADLINE_EXCEEDED
            assert fast == [[2, 2]] * 4 and await outcome(up, "gone") == NOT_FOUND
            assert await outcome(up, "bug") == grpc.StatusCode.INTERNAL
            await asyncio.sleep(0.1)
            assert fake.cancelled == ["slow"] and up.streams["Verify"].opened == 1
            assert "down" not in up.status
            await up.close()
    asyncio.run(main())


@pytest.mark.parametrize("cancels", [1, 50])
def test_a_cancelled_call_is_cancelled_on_the_server(cancels):
    """The gateway's request goes away mid-call: the call stops on the server too (as a
    cancelled unary call would) and is answered CANCELLED; `settled(sequence)`, which every
    Release waits for, returns only after that answer, so a Release never overtakes the call.
    Also when the caller is cancelled again and again (anyio's cancel scopes do that to a
    streaming HTTP response whose client hung up). The stream goes on."""
    async def main():
        port = free_port()
        async with fake_server(port) as fake:
            up = upstream(port)
            slow = asyncio.create_task(outcome(up, "slow"))
            await asyncio.sleep(0.2)
            for _ in range(cancels):
                slow.cancel()
                await asyncio.sleep(0)
            with pytest.raises(asyncio.CancelledError):
                await slow
            await up.settled("slow")
            assert fake.cancelled == ["slow"]
            assert not up.streams["Verify"]._withdrawals         # nothing left to settle
            assert await outcome(up, "s1") == [2, 2] and up.streams["Verify"].opened == 1
            await up.close()
    asyncio.run(main())


def test_a_broken_stream_fails_calls_in_flight_and_reopens():
    """The server goes away with three calls in flight: each fails UNAVAILABLE (counted, the
    upstream marked down, as a unary call would be); the next call opens a new stream."""
    async def main():
        port = free_port()
        up = upstream(port)
        before = upstream_errors(UNAVAILABLE)
        async with fake_server(port):
            calls = [asyncio.create_task(outcome(up, "slow")) for _ in range(3)]
            await asyncio.sleep(0.3)
        assert await asyncio.gather(*calls) == [UNAVAILABLE] * 3
        assert upstream_errors(UNAVAILABLE) == before + 3 and up.status.startswith("down")
        assert await outcome(up, "s1") == UNAVAILABLE               # nobody there: fails fast
        async with fake_server(port):
            for _ in range(50):                      # until the channel has reconnected
                if (result := await outcome(up, "s1")) != UNAVAILABLE:
                    break
                await asyncio.sleep(0.1)
            assert result == [2, 2]
        assert up.streams["Verify"].opened >= 3
        await up.close()
    asyncio.run(main())


def test_large_requests_go_unary(monkeypatch):
    """Past STREAM_MAX_BYTES a call goes unary (it would hold up the calls behind it)."""
    monkeypatch.setattr("gateway.upstream.STREAM_MAX_BYTES", 20)

    async def main():
        port = free_port()
        async with fake_server(port):
            up = upstream(port)
            big = await up.call("Verify", verify("big", tuple(range(20))), 10)
            assert len(big.committed_tokens) == 20 and up.streams["Verify"].opened == 0
            assert await outcome(up, "small") == [5, 2] and up.streams["Verify"].opened == 1
            await up.close()
    asyncio.run(main())


def test_draining_refuses_new_work_per_call_on_the_stream():
    """The guard's drain check applies to each call on a stream, as to a unary call."""
    async def main():
        port = free_port()
        drain = Drain(grace_s=1.0, refuse=lambda method, req: req.sequence_id == "new",
                      draining=True)
        async with fake_server(port, drain=drain), \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = target_pb2_grpc.TargetStub(channel).VerifyStream()
            for call_id, seq in enumerate(["new", "old"]):
                await stream.write(target_pb2.VerifyStreamRequest(call_id=call_id,
                                                                  request=verify(seq)))
            await stream.done_writing()
            replies = {r.call_id: r async for r in stream}
            assert await stream.code() == OK
        assert code_of(replies[0]) == UNAVAILABLE and drain.refused == 1
        assert "Verify refused: this service is shutting down" in replies[0].status.message
        assert code_of(replies[1]) == OK and list(replies[1].response.committed_tokens) == [1, 2]
    asyncio.run(main())


def test_undecodable_bytes_end_the_stream_invalid_argument():
    async def main():
        port = free_port()
        async with fake_server(port), grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            raw = channel.stream_stream("/dflash.v1.Target/VerifyStream")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in raw(iter([b"\xff\xff\xff"]), timeout=10):
                    pass
        assert e.value.code() == INVALID
        assert "not a valid dflash.v1.VerifyStreamRequest" in e.value.details()
    asyncio.run(main())


def test_a_service_without_the_stream_gets_unary_calls():
    """An older target (no VerifyStream: UNIMPLEMENTED) is served unary from then on."""
    async def unary_verify(request, context):
        return target_pb2.VerifyResponse(committed_tokens=[7])

    async def main():
        port = free_port()
        handler = grpc.method_handlers_generic_handler("dflash.v1.Target", {
            "Verify": grpc.unary_unary_rpc_method_handler(
                unary_verify, request_deserializer=target_pb2.VerifyRequest.FromString,
                response_serializer=target_pb2.VerifyResponse.SerializeToString)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([handler])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        up = upstream(port)
        try:
            assert [await outcome(up, "a"), await outcome(up, "b")] == [[7], [7]]
            assert "Verify" not in up.streams and "down" not in up.status
        finally:
            await up.close()
            await server.stop(0)
    asyncio.run(main())


# -- raw streams against the real services --------------------------------------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("stream_wire")


@pytest.fixture(scope="module")
def tiny_target(tiny_llama_dir, logs):
    metrics_port = free_port()
    p = start_target(tiny_llama_dir, logs, "--max-block-size", str(MAX_BLOCK),
                     "--metrics-port", str(metrics_port))
    p.metrics_port = metrics_port
    yield p
    p.stop()


def stream_calls(method, messages: list) -> dict[int, object]:
    """Sends every call, half-closes, and returns the answers by call_id (the stream must end OK:
    answering a failed call does not end it)."""
    return {r.call_id: r for r in method(iter(messages), timeout=60)}


def test_target_stream_answers_each_call_with_its_own_status(tiny_target):
    client = TargetClient(tiny_target.address)
    rpcs = lambda code: prom.value(tiny_target.metrics_port, "dflash_rpc_requests_total",
                                   method="Verify", code=code) or 0
    before = {c: rpcs(c) for c in ("OK", "NOT_FOUND", "INVALID_ARGUMENT")}
    try:
        anchors = {seq: client.prefill(seq, [1, 2, 3]).next_token for seq in ("u", "s1", "s2")}
        unary = client.verify("u", [anchors["u"], 5, 6])
        calls = [("s1", [anchors["s1"], 5, 6]), ("never-seen", [1]),
                 ("s2", [7] * (MAX_BLOCK + 1)), ("s2", [anchors["s2"]])]
        replies = stream_calls(client.stub.VerifyStream, [
            target_pb2.VerifyStreamRequest(call_id=10 + i, request=verify(s, t), timeout_ms=60_000)
            for i, (s, t) in enumerate(calls)])
        assert [code_of(replies[10 + i]) for i in range(4)] == [OK, NOT_FOUND, INVALID, OK]
        assert _untimed(replies[10].response) == _untimed(unary)   # the unary Verify's path
        assert "unknown sequence 'never-seen'" in replies[11].status.message
        assert f"a verify block has {MAX_BLOCK + 1} tokens; allowed 1..{MAX_BLOCK}" in \
            replies[12].status.message
        assert replies[13].response.seq_len == 4 and not replies[13].HasField("status")
        # counted like unary calls: the unary Verify and the two good ones OK, one of each error
        assert {c: rpcs(c) - before[c] for c in before} == \
            {"OK": 3, "NOT_FOUND": 1, "INVALID_ARGUMENT": 1}
        assert all(client.release(seq) for seq in anchors)
    finally:
        client.close()


@pytest.fixture(scope="module")
def lookup_draft(smollm2_dir, logs):
    p = start_draft(smollm2_dir, logs, "--drafter", "prompt-lookup")
    yield p
    p.stop()


def test_draft_stream_answers_each_call_with_its_own_status(lookup_draft):
    text = [5, 6, 7, 8, 5, 6, 7]
    calls = [propose_request("d1", None, 0, anchor=8, token_ids=text),
             propose_request("unknown", None, 5, anchor=8, token_ids=[1, 2]),
             propose_request("d2", None, 0, anchor=8, token_ids=text, block_size=99)]
    with grpc.insecure_channel(lookup_draft.address) as channel:
        stub = draft_pb2_grpc.DraftStub(channel)
        unary = stub.Propose(propose_request("d0", None, 0, anchor=8, token_ids=text), timeout=60)
        replies = stream_calls(stub.ProposeStream, [
            draft_pb2.ProposeStreamRequest(call_id=i, request=r) for i, r in enumerate(calls)])
        for seq in ("d0", "d1"):
            assert stub.Release(common_pb2.ReleaseRequest(sequence_id=seq), timeout=60).released
    assert [code_of(replies[i]) for i in range(3)] == [OK, NOT_FOUND, INVALID]
    # the same answer on both wires, but for the time of the forward each ran in (and waited
    # for) and the load the draft reported (the sequences open then)
    streamed = replies[0].response
    assert streamed.batch_seconds > 0 and unary.batch_seconds > 0
    assert unary.load.sequences >= 1 and streamed.load.sequences >= 1
    streamed.batch_seconds = unary.batch_seconds = 0.0
    streamed.queue_seconds = unary.queue_seconds = 0.0
    streamed.ClearField("load")
    unary.ClearField("load")
    assert streamed == unary and list(unary.draft_tokens)[:3] == [5, 6, 7]
    assert "unknown sequence 'unknown'" in replies[1].status.message
    assert "block_size 99 is not allowed" in replies[2].status.message


# -- through the gateway (SmolLM2) ----------------------------------------------------------------
N = 24
CHATS = ["Explain how photosynthesis works in simple terms.",
         "Repeat the following sentence three times: The cat sat on the mat near the door."]


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    return chat_prompts(smollm2_dir, CHATS)


@pytest.fixture(scope="module")
def services(smollm2_dir, logs, tmp_path_factory) -> Iterator[dict[str, ServiceProcess]]:
    """The SmolLM2 target and a random DFlash draft (block 4: features cross ProposeStream).
    The last test of this file kills and restarts the target."""
    drafter = make_random_drafter(smollm2_dir, tmp_path_factory.mktemp("random_dflash"),
                                  block_size=4)
    procs = {"target": start_target(smollm2_dir, logs),
             "draft": start_draft(smollm2_dir, logs, model_dir=drafter)}
    yield procs
    for p in procs.values():
        p.stop()


@pytest.fixture(scope="module")
def target(services) -> ServiceProcess:
    return services["target"]


@pytest.fixture(scope="module")
def gateways(smollm2_dir, services, logs) -> Iterator[dict]:
    # fixed sizes: the test needs Proposes on the wire (auto may not draft with a random drafter)
    gws = {wire: start_gateway(services["target"].address, smollm2_dir, logs, "--wire", wire,
                               "--speculation", "fixed", draft=services["draft"].address)
           for wire in ("stream", "unary")}
    yield gws
    for p in gws.values():
        p.stop()


def test_stream_output_is_identical_to_unary_and_transformers(gateways, prompts,
                                                              smollm2_reference):
    for ids in prompts:
        stream, _, responses = gateways["stream"].generate(ids, N)
        assert stream == gateways["unary"].generate(ids, N)[0] == smollm2_reference(ids, N)
        assert responses[-1].usage.draft_tokens > 0           # Propose went through the stream
    log, unary_log = gateways["stream"].log(), gateways["unary"].log()
    assert "target VerifyStream opened (stream 1)" in log
    assert "draft ProposeStream opened (stream 1)" in log
    assert "Stream opened" not in unary_log


def test_concurrent_requests_multiplex_on_one_stream(gateways, prompts, smollm2_reference):
    gw = gateways["stream"]
    jobs = [prompts[i % len(prompts)] for i in range(4)]
    assert generate_concurrently(gw, jobs, N) == [smollm2_reference(ids, N) for ids in jobs]
    log = gw.log()
    assert log.count("target VerifyStream opened") == 1      # every call on the one stream
    assert log.count("draft ProposeStream opened") == 1


def kill(p: ServiceProcess) -> ServiceProcess:
    os.killpg(p.proc.pid, signal.SIGKILL)
    p.proc.wait(5)
    return p


def generate_killing(gw, ids: list[int], n: int, kill_at: int, on_kill) -> list[int]:
    """Greedy n tokens; on_kill() runs after response `kill_at` while the request goes on."""
    req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=ids), max_tokens=n,
                                      sampling=common_pb2.SamplingParams(temperature=0))
    tokens = []
    for i, r in enumerate(gw.stub.Generate(req, timeout=600)):
        tokens += r.token_ids
        if i == kill_at:
            on_kill()
    return tokens


def again(p: ServiceProcess, logs) -> ServiceProcess:
    """The same command on the same port."""
    return ServiceProcess(p.module, p.args, p.service, p.port, logs).start()


def test_draft_killed_mid_request_on_the_stream(smollm2_dir, target, logs, prompts,
                                                smollm2_reference):
    """The draft dies under the open ProposeStream: the request goes on autoregressively with
    output unchanged; once the draft is back, the next request speculates over a new stream."""
    draft = start_draft(smollm2_dir, logs, "--drafter", "prompt-lookup")
    gw = start_gateway(target.address, smollm2_dir, logs, "--wire", "stream",
                       "--speculation", "fixed", draft=draft.address)
    restarted = None
    try:
        assert generate_killing(gw, prompts[0], N, 1, lambda: kill(draft)) == \
            smollm2_reference(prompts[0], N)
        assert "draft at" in gw.log() and "not serving" in gw.log()
        restarted = again(draft, logs).wait_serving()
        wait_until(lambda: gw.readiness()[1]["reason"].startswith("serving (speculative"),
                   what="speculation back on")
        tokens, _, responses = gw.generate(prompts[1], N)
        assert tokens == smollm2_reference(prompts[1], N) and responses[-1].usage.draft_steps > 0
        assert gw.log().count("draft ProposeStream opened") >= 2
    finally:
        for p in (gw, draft, restarted):
            if p is not None:
                p.stop()


def restart_target_mid_request(smollm2_dir, target: ServiceProcess, logs, ids: list[int],
                               reference: list[int], wire: str) -> str:
    """Kills `target` after the third answer of a request through a gateway on `wire` and
    starts it again on the same port: the output must equal `reference`, the call in flight
    fail UNAVAILABLE and the gateway open a second VerifyStream. Returns the gateway's log."""
    gw = start_gateway(target.address, smollm2_dir, logs, "--wire", wire)
    restarted: list[ServiceProcess] = []
    try:
        tokens = generate_killing(gw, ids, N, 3,
                                  lambda: restarted.append(again(kill(target), logs)))
        assert tokens == reference
        log = gw.log()
        assert "target lost the sequence (UNAVAILABLE)" in log
        assert "target VerifyStream opened (stream 2)" in log
        return log
    finally:
        for p in (gw, *restarted):
            p.stop()


def test_target_restarted_mid_request_on_the_stream(smollm2_dir, target, logs, prompts,
                                                    smollm2_reference):
    """The target dies under the open VerifyStream (last in this file: it kills the module's
    target): the call fails UNAVAILABLE, the gateway waits for the target, prefills the committed
    tokens again and goes on over a new stream; nothing is lost or repeated."""
    restart_target_mid_request(smollm2_dir, target, logs, prompts[0],
                               smollm2_reference(prompts[0], N), "stream")


def _untimed(resp: target_pb2.VerifyResponse) -> target_pb2.VerifyResponse:
    """The answer without the timing of the forward it ran in (batch_*, queue_seconds)."""
    out = target_pb2.VerifyResponse()
    out.CopyFrom(resp)
    for name in ("batch_tokens", "batch_seconds", "queue_seconds"):
        out.ClearField(name)
    return out
