"""--wire socket: the per-step call streams on a service's unix call socket (--call-socket;
services/common/call_socket.py, gateway/call_socket.py) instead of gRPC's transport.

- in process (the fake target of test_stream_wire behind the real servicer plumbing, on a real
  socket): answers, per-call errors, deadlines, cancellation, drain refusals, the internal token,
  an undecodable frame, and the fall back to gRPC when the socket does not open;
- through the gateway (SmolLM2, three processes, `--call-socket` on both services): greedy output
  identical to transformers and to --wire stream, requests multiplexed on one socket each, and a
  target restarted mid-request."""
from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from support.draft_service import start_draft
from support.gateway_stack import chat_prompts, generate_concurrently, start_gateway
from support.procs import ServiceProcess, free_port, start_target
from test_stream_wire import (
    CHATS,
    FakeTarget,
    N,
    fake_server,
    outcome,
    restart_target_mid_request,
    upstream,
)

from dflash.make_draft import make_random_drafter
from dflash.v1 import target_pb2
from gateway import call_socket as client_socket
from services.common import internal_auth
from services.common.call_socket import CallSocket, SocketMethod
from services.common.guard import Drain

OK_TOKENS = [2, 2]                      # outcome() of sequence "ok": (len("ok"), 2)
UNAVAILABLE, NOT_FOUND = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND


@contextlib.asynccontextmanager
async def socket_server(path: str, servicer: FakeTarget, token: str = "",
                        drain: Drain | None = None) -> AsyncIterator[CallSocket]:
    sock = CallSocket(path, {"Verify": SocketMethod(servicer.VerifyStream,
                                                    target_pb2.VerifyStreamRequest)},
                      token, drain, 1 << 20)
    await sock.start()
    try:
        yield sock
    finally:
        await sock.close()


async def socket_upstream(port: int, path: str, socket_id: str = "", token: str = ""):
    """A --wire socket upstream of the fake target: its gRPC port and its call socket, as
    _on_serving leaves it (capabilities fetched, the socket probed)."""
    up = upstream(port, "socket")
    if token:
        up.metadata = internal_auth.metadata(token)
    caps = target_pb2.TargetCapabilities(call_socket=path, call_socket_id=socket_id)
    await up.probe_socket(caps)
    up.capabilities = caps
    return up


def at(path: str, socket_id: str, method: str = "Verify", metadata=()) -> client_socket.SocketTarget:
    return client_socket.SocketTarget(path, socket_id, method, metadata)


def test_calls_on_the_socket_answer_as_on_the_stream(tmp_path):
    """Each call its own answer or status; a deadline fails the call alone; a cancelled call is
    cancelled on the server; all of it on one connection, none over gRPC."""
    async def main():
        port, path = free_port(), str(tmp_path / "t.sock")
        async with fake_server(port, FakeTarget(slow_s=5.0)) as fake, \
                socket_server(path, fake) as sock:
            up = await socket_upstream(port, path, sock.id)
            assert up.socket_failed == ""
            got = await asyncio.gather(outcome(up, "ok"), outcome(up, "gone"),
                                       outcome(up, "bug"), outcome(up, "slow", timeout=0.3))
            assert got == [OK_TOKENS, NOT_FOUND, grpc.StatusCode.INTERNAL,
                           grpc.StatusCode.DEADLINE_EXCEEDED]
            task = asyncio.ensure_future(outcome(up, "slow"))
            await asyncio.sleep(0.2)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await up.settled("slow")
            assert fake.cancelled.count("slow") == 2    # the deadline's and the cancelled one
            assert await outcome(up, "ok") == OK_TOKENS
            assert up.streams["Verify"].opened == 1 and up.socket_failed == ""
            await up.close()
    asyncio.run(main())


def test_draining_refuses_new_work_per_call_on_the_socket(tmp_path):
    async def main():
        port, path = free_port(), str(tmp_path / "t.sock")
        drain = Drain(grace_s=5.0, refuse=lambda method, request: request.sequence_id == "new")
        async with fake_server(port) as fake, socket_server(path, fake, drain=drain) as sock:
            up = await socket_upstream(port, path, sock.id)
            drain.draining = True
            assert await asyncio.gather(outcome(up, "new"), outcome(up, "ok")) == \
                [UNAVAILABLE, OK_TOKENS]
            await up.close()
    asyncio.run(main())


def test_the_internal_token_is_checked_and_a_refused_socket_means_grpc(tmp_path):
    """A gateway without the token is refused at the hello (UNAUTHENTICATED): its calls go over
    the gRPC stream instead; with the token they go over the socket."""
    async def main():
        port, path = free_port(), str(tmp_path / "t.sock")
        async with fake_server(port) as fake, socket_server(path, fake, token="secret") as sock:
            why = await client_socket.probe(at(path, sock.id), 5.0)
            assert why.startswith("UNAUTHENTICATED") and internal_auth.HEADER in why
            up = await socket_upstream(port, path, sock.id)   # no token: refused, so gRPC
            assert up.socket_failed.startswith("UNAUTHENTICATED")
            assert await outcome(up, "ok") == OK_TOKENS       # (the fake's port has no token)
            await up.close()
            secret = internal_auth.metadata("secret")
            assert await client_socket.probe(at(path, sock.id, metadata=secret), 5.0) == ""
            assert (await client_socket.probe(at(path, sock.id, "Prefill", secret), 5.0)
                    ).startswith("UNIMPLEMENTED")
    asyncio.run(main())


def test_a_socket_that_does_not_open_means_grpc(tmp_path):
    async def main():
        port = free_port()
        async with fake_server(port):
            up = await socket_upstream(port, str(tmp_path / "nobody.sock"), "x")
            assert "FileNotFoundError" in up.socket_failed
            assert await outcome(up, "ok") == OK_TOKENS
            await up.close()
    asyncio.run(main())


def test_a_socket_of_another_process_is_not_used(tmp_path):
    """The advertised path opens here but answers another id (the same path of a service on
    another host, say): the calls go over the service's own gRPC port, never to that socket."""
    async def main():
        port, path = free_port(), str(tmp_path / "t.sock")
        async with fake_server(port), socket_server(path, FakeTarget()) as other:
            up = await socket_upstream(port, path, "the-service-s-own-id")
            assert "answers as another process" in up.socket_failed and other.id in up.socket_failed
            assert await outcome(up, "ok") == OK_TOKENS
            await up.close()
    asyncio.run(main())


def test_a_restart_that_draws_a_new_socket_id_keeps_the_generation(tmp_path):
    """call_socket_id is per process: a service restarted as it was keeps its capabilities
    generation (the draft contexts it counts are not rebuilt for it); another model does not."""
    answers = iter([("m", "id-1"), ("m", "id-2"), ("other", "id-3")])

    class Restarting(FakeTarget):
        async def GetCapabilities(self, request, context):
            model, socket_id = next(answers)
            return target_pb2.TargetCapabilities(model_id=model, call_socket=str(tmp_path / "x"),
                                                 call_socket_id=socket_id)

    async def main():
        port = free_port()
        async with fake_server(port, Restarting()):
            up = upstream(port, "socket")
            generations = []
            for _ in range(3):
                up.serving = False                 # as after the service went away
                await up._on_serving()
                generations.append(up.generation)
            assert up.capabilities.call_socket_id == "id-3"
            assert generations == [1, 1, 2]
            await up.close()
    asyncio.run(main())


def test_an_undecodable_frame_ends_the_connection(tmp_path):
    """No call_id to answer: the connection ends (the client's calls in flight would fail
    UNAVAILABLE, as on a broken stream); the socket keeps serving new connections."""
    async def main():
        path = str(tmp_path / "t.sock")
        async with socket_server(path, FakeTarget()) as sock:
            reader, writer = await asyncio.open_unix_connection(path)
            hello = json.dumps({"method": "Verify", "metadata": []}).encode()
            writer.write(struct.pack("<I", len(hello)) + hello)
            answer = await reader.readexactly(struct.unpack("<I", await reader.readexactly(4))[0])
            assert json.loads(answer) == {"code": 0, "id": sock.id}
            writer.write(struct.pack("<I", 3) + b"\xff\xff\xff")
            assert await reader.read() == b""                # closed by the server
            writer.close()
            assert await client_socket.probe(at(path, sock.id), 5.0) == ""
    asyncio.run(main())


# -- through the gateway (SmolLM2) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("call_socket_logs")


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    return chat_prompts(smollm2_dir, CHATS)


@pytest.fixture(scope="module")
def sockets(tmp_path_factory) -> Iterator[str]:
    import tempfile
    with tempfile.TemporaryDirectory(prefix="dflash-test-") as d:   # short: < 108 bytes
        yield d


@pytest.fixture(scope="module")
def services(smollm2_dir, logs, sockets, tmp_path_factory) -> Iterator[dict[str, ServiceProcess]]:
    """The SmolLM2 target and a random DFlash draft (block 4: features cross the draft's
    socket), each with a call socket. The last test kills and restarts the target."""
    drafter = make_random_drafter(smollm2_dir, tmp_path_factory.mktemp("random_dflash"),
                                  block_size=4)
    procs = {"target": start_target(smollm2_dir, logs, "--call-socket", f"{sockets}/t.sock"),
             "draft": start_draft(smollm2_dir, logs, "--call-socket", f"{sockets}/d.sock",
                                  model_dir=drafter)}
    yield procs
    for p in procs.values():
        p.stop()


@pytest.fixture(scope="module")
def gateways(smollm2_dir, services, logs) -> Iterator[dict]:
    gws = {wire: start_gateway(services["target"].address, smollm2_dir, logs, "--wire", wire,
                               "--speculation", "fixed", draft=services["draft"].address)
           for wire in ("socket", "stream")}
    yield gws
    for p in gws.values():
        p.stop()


def test_socket_output_is_identical_to_the_stream_and_transformers(gateways, prompts, sockets,
                                                                   smollm2_reference):
    for ids in prompts:
        tokens, _, responses = gateways["socket"].generate(ids, N)
        assert tokens == gateways["stream"].generate(ids, N)[0] == smollm2_reference(ids, N)
        assert responses[-1].usage.draft_tokens > 0          # Proposes crossed the socket
    log = gateways["socket"].log()
    assert f"per-step calls on its call socket {sockets}/t.sock" in log
    assert f"per-step calls on its call socket {sockets}/d.sock" in log
    assert "not usable from here" not in log
    assert "per-step calls on its call socket" not in gateways["stream"].log()


def test_concurrent_requests_share_one_socket_connection(gateways, prompts, smollm2_reference):
    gw = gateways["socket"]
    jobs = [prompts[i % len(prompts)] for i in range(4)]
    assert generate_concurrently(gw, jobs, N) == [smollm2_reference(ids, N) for ids in jobs]
    assert gw.log().count("target VerifyStream opened") == 1


def test_target_restarted_mid_request_on_the_socket(smollm2_dir, services, logs, prompts,
                                                    smollm2_reference):
    """The target dies under the open socket connection (last in this file): the call fails
    UNAVAILABLE, the gateway waits for the target, prefills the committed tokens again and goes
    on over a new connection to the restarted target's socket; nothing lost or repeated."""
    log = restart_target_mid_request(smollm2_dir, services["target"], logs, prompts[0],
                                     smollm2_reference(prompts[0], N), "socket")
    assert log.count("per-step calls on its call socket") == 2        # before and after
