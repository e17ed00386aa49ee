"""The `stream` feature plane (services/common/feature_stream.py) through a real gRPC server with
the real target servicer and engine (tiny Llama), read by the draft's AttachedPlanes:

- a chunked prefill's rows go out chunk by chunk as the engine writes them (not one message at
  the end), and equal the features of the same prompt in a message, bit for bit;
- the rows of a Verify arrive before its answer can be used, and features_consumed frees them on
  the target and then on the draft;
- a freed ref is DATA_LOSS at once, a ref that never comes is DATA_LOSS after the arrival
  timeout, a plane the target does not have is refused at attach (NOT_FOUND, named), a stream
  that breaks in the middle of a publication fails its waiter with DATA_LOSS and detaches it -
  never a hang and never wrong rows."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from dflash.v1 import common_pb2, target_pb2_grpc
from runtime.sampling import SamplingConfig
from services.common import feature_stream
from services.common.errors import DataLoss
from services.common.feature_plane import PlaneInfo, PlaneRef, PlaneWriter
from services.draft.planes import AttachedPlanes
from services.target import servicer as target_servicer
from services.target.config import TargetConfig
from services.target.engine import PrefillCall, TargetEngine
from services.target.worker import TargetWorker

MIB = 1 << 20
BUDGET = 16                     # tokens per engine iteration: a prompt of 50 is 4 chunks
LAYERS = (0, 1)


@pytest.fixture(scope="module")
def worker(tiny_llama_dir):
    return TargetWorker.started(TargetConfig(str(tiny_llama_dir), kv_budget_bytes=8 * MIB,
                                             token_budget=BUDGET, max_block_size=8,
                                             feature_plane="stream",
                                             feature_plane_mib=4))


async def _serve(engine: TargetEngine, worker: TargetWorker) -> tuple[grpc.aio.Server, PlaneInfo]:
    """The real target servicer on a real server; the stream plane as a gateway offers it."""
    servicer = target_servicer.TargetServicer()
    servicer.worker, servicer.engine = worker, engine
    server = grpc.aio.server()
    target_servicer.add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    (info,) = engine.publisher.planes()
    return server, PlaneInfo(info.transport, info.plane_id, info.size_bytes,
                             address=f"127.0.0.1:{port}")


async def _raw_messages(info: PlaneInfo, into: list) -> None:
    """Every message of a second subscription, as a draft would see them."""
    async with grpc.aio.insecure_channel(info.address) as channel:
        call = target_pb2_grpc.TargetStub(channel).FeatureStream(
            common_pb2.FeatureStreamRequest(plane_id=info.plane_id))
        async for msg in call:
            into.append(msg)


async def _until(cond, what: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_rows_stream_chunk_by_chunk_and_equal_the_message(worker, monkeypatch):
    monkeypatch.setattr(feature_stream, "ARRIVAL_TIMEOUT_S", 0.5)
    engine = TargetEngine(worker)
    engine.start()

    async def body():
        server, info = await _serve(engine, worker)
        planes = AttachedPlanes(torch.device("cpu"))
        try:
            assert await planes.attach(info) == ""
            reader = planes.readers[info.plane_id]
            raw: list = []
            watcher = asyncio.ensure_future(_raw_messages(info, raw))
            await _until(lambda: len(raw) == 1, "the subscription")
            assert not raw[0].rows and not raw[0].freed                 # the empty first one
            prompt = list(range(3, 53))

            def call(seq, plane):
                return PrefillCall(seq, prompt, SamplingConfig(), LAYERS, torch.float32,
                                   feature_plane=plane)
            streamed = await engine.prefill(call("s", info.plane_id))
            inline = await engine.prefill(call("i", ""))
            ref = streamed.features
            assert isinstance(ref, PlaneRef) and ref.rows == len(prompt)
            await planes.arrive([ref])
            assert torch.equal(planes.read(ref), inline.features)       # bit for bit
            await _until(lambda: sum(r.ref.publication == ref.publication
                                     for m in raw for r in m.rows) >= 4, "the chunks")
            firsts = [(i, r.first_row) for i, m in enumerate(raw) for r in m.rows
                      if r.ref.publication == ref.publication]
            assert [f for _, f in firsts] == list(range(0, len(prompt), BUDGET))   # a chunk each
            assert len({i for i, _ in firsts}) == len(firsts)          # each sent as it was written

            step = await engine.verify("s", [streamed.next_token, 7, 8])
            await planes.arrive([step.features])
            assert planes.read(step.features).shape == (step.accepted + 1, len(LAYERS) * 64)
            await engine.verify("s", [step.committed[-1]], None, step.seq_len)   # frees both
            await _until(lambda: ref.publication not in reader.pubs, "the freed event")
            with pytest.raises(DataLoss, match="stale"):
                await planes.arrive([ref])                              # at once, no wait
            never = PlaneRef(info.plane_id, 10**6, ref.offset, 1, ref.width, ref.dtype)
            with pytest.raises(DataLoss, match="did not arrive"):
                await planes.arrive([never])
            assert 10**6 not in reader.pubs                             # the waiter is gone
            wrong = PlaneInfo("stream", "1-not-this-one", MIB, address=info.address)
            why = await planes.attach(wrong)
            assert "NOT_FOUND" in why and info.plane_id in why
            watcher.cancel()
        finally:
            await server.stop(0)
    try:
        asyncio.run(body())
    finally:
        engine.stop()


def test_a_stream_that_breaks_mid_publication_is_data_loss(worker):
    """The engine is not started: this test's thread is the engine thread that publishes."""
    engine = TargetEngine(worker)
    publisher = engine.publisher

    async def body():
        server, info = await _serve(engine, worker)
        planes = AttachedPlanes(torch.device("cpu"))
        assert await planes.attach(info) == ""
        reader = planes.readers[info.plane_id]
        writer = publisher.writers[info.plane_id]
        pub = writer.reserve(10, 8, torch.float32)
        publisher.write(pub, 0, torch.ones(4, 8))                     # 4 of 10 rows
        publisher.flush()
        await _until(lambda: pub.ref.publication in reader.pubs
                     and reader.pubs[pub.ref.publication].received == 4, "the first rows")
        waiter = asyncio.ensure_future(planes.arrive([pub.ref]))
        await asyncio.sleep(0.05)
        assert not waiter.done()                                      # incomplete: it waits
        await server.stop(0)
        with pytest.raises(DataLoss, match="broke|closed"):
            await asyncio.wait_for(waiter, 10)
        assert planes.readers == {}                                   # detached
        with pytest.raises(DataLoss, match="not attached"):
            planes.read(pub.ref)
    asyncio.run(body())


def test_a_flush_packs_small_publications_together_and_splits_large_ones():
    writer = PlaneWriter("stream", 16 * MIB, torch.device("cpu"))
    feed = feature_stream.StreamFeed(writer)
    small = [writer.reserve(3, 1024, torch.float32) for _ in range(3)]     # 12 KiB each
    for pub in small:
        writer.write(pub, 0, torch.randn(3, 1024))
        feed.written(pub, 0, 3)
    feed.freed(small[0])
    (msg,) = feed._messages(feed._pending)
    assert [r.ref.publication for r in msg.rows] == [p.ref.publication for p in small]
    assert list(msg.freed) == [small[0].ref.publication]
    big = writer.reserve(768, 1024, torch.float32)                          # 3 MiB
    rows = torch.randn(768, 1024)
    writer.write(big, 0, rows)
    messages = feed._messages([feature_stream._Rows(big.ref, 0, 768)])
    assert len(messages) == 3 and all(len(m.rows) == 1 for m in messages)
    data = b"".join(m.rows[0].data for m in messages)
    assert data == rows.numpy().tobytes()
    assert [m.rows[0].first_row for m in messages] == [0, 256, 512]


def test_a_freed_region_is_never_sent():
    writer = PlaneWriter("stream", MIB, torch.device("cpu"))
    pub = writer.reserve(3, 4, torch.float32)
    writer.write(pub, 0, torch.arange(12, dtype=torch.float32).view(3, 4))
    assert writer.read_rows(pub.ref, 1, 2) == torch.arange(4, 12, dtype=torch.float32).numpy().tobytes()
    writer.free(pub)
    assert writer.read_rows(pub.ref, 0, 3) is None
    again = writer.reserve(3, 4, torch.float32)                      # the same region, reused
    assert again.region == pub.region and writer.read_rows(pub.ref, 0, 3) is None


def test_a_bug_in_the_stream_is_internal_and_logged(worker, caplog):
    """A fault injected into the feed (a bug, not a ServiceError): the subscriber gets INTERNAL
    naming it, the log has its traceback, and the target serves the next subscription."""
    engine = TargetEngine(worker)
    engine.start()

    async def body():
        server, info = await _serve(engine, worker)
        feed = engine.publisher.feeds[info.plane_id]
        real = feed.subscribe

        async def broken(commits=False):
            yield common_pb2.FeatureStreamMessage()
            raise RuntimeError("injected fault")
        feed.subscribe = broken
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _raw_messages(info, [])
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "RuntimeError: injected fault" in e.value.details()
            feed.subscribe = real
            got: list = []
            watcher = asyncio.ensure_future(_raw_messages(info, got))
            await _until(lambda: got, "a message of the next subscription")
            watcher.cancel()
        finally:
            await server.stop(0)
    try:
        with caplog.at_level("ERROR", logger="dflash"):
            asyncio.run(body())
        assert any("internal error in FeatureStream" in r.getMessage() and r.exc_info
                   for r in caplog.records)
    finally:
        engine.stop()
