"""Feature planes (services/common/feature_plane.py): allocation, shared-memory publication and
reading, and every way a reference can be wrong (stale, freed, reused, out of bounds, a plane not
attached, a plane that is not there) - each a clear DataLoss or a refusal to attach, never wrong
features. CUDA IPC: the same round trip between two processes on a GPU (skipped without one)."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from runtime.sampling import SamplingConfig
from services.common.errors import DataLoss
from services.common.feature_plane import (
    ALIGN,
    PREFIX,
    SHM_DIR,
    Extents,
    PlaneInfo,
    PlaneReader,
    PlaneRef,
    PlaneWriter,
    remove_stale_shm,
)
from services.draft.planes import AttachedPlanes
from services.target.config import TargetConfig
from services.target.engine import PrefillCall, TargetEngine
from services.target.worker import TargetWorker

MIB = 1 << 20


@pytest.fixture
def writer():
    w = PlaneWriter("shm", 4 * MIB, torch.device("cpu"))
    yield w
    w.close()


def test_extents_allocate_aligned_first_fit_and_coalesce():
    e = Extents(ALIGN, 10 * ALIGN)
    a, b, c = e.alloc(1), e.alloc(ALIGN + 1), e.alloc(3 * ALIGN)
    assert (a, b, c) == (ALIGN, 2 * ALIGN, 4 * ALIGN) and e.used == 6 * ALIGN
    assert e.alloc(4 * ALIGN) is None                      # 3 * ALIGN left
    e.release(b, ALIGN + 1)
    e.release(a, 1)                                        # merges with b's hole
    assert e.free[0] == (ALIGN, 3 * ALIGN)
    e.release(c, 3 * ALIGN)                                # everything is one extent again
    assert e.free == [(ALIGN, 9 * ALIGN)] and e.used == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_published_rows_read_back_exactly_as_views(writer, dtype):
    planes = AttachedPlanes(torch.device("cpu"))
    assert asyncio.run(planes.attach(writer.info)) == ""
    rows = torch.randn(7, 40).to(dtype)
    pub = writer.reserve(7, 40, dtype)
    writer.write(pub, 0, rows[:3])                         # a prompt's chunks, in two writes
    writer.write(pub, 3, rows[3:])
    ref = PlaneRef.from_pb(pub.ref.to_pb())                # through the wire form
    view = planes.read(ref)
    assert view.dtype == dtype and torch.equal(view, rows)
    assert view.data_ptr() != rows.data_ptr()             # the plane's memory, not a copy here


def test_stale_freed_and_reused_refs_are_data_loss(writer):
    planes = AttachedPlanes(torch.device("cpu"))
    asyncio.run(planes.attach(writer.info))
    first = writer.reserve(2, 8, torch.float32)
    writer.write(first, 0, torch.ones(2, 8))
    writer.free(first)
    with pytest.raises(DataLoss, match="stale"):
        planes.read(first.ref)                             # freed: its record is cleared
    second = writer.reserve(2, 8, torch.float32)           # the same region again
    assert second.region == first.region
    with pytest.raises(DataLoss, match=f"holds publication {second.ref.publication}"):
        planes.read(first.ref)
    bad = PlaneRef(writer.plane_id, 9, 4 * MIB - 64, 10, 8, torch.float32)
    with pytest.raises(DataLoss, match="bounds"):
        planes.read(bad)
    other = PlaneRef("12345-nothere", 1, ALIGN + 64, 1, 8, torch.float32)
    with pytest.raises(DataLoss, match="not attached"):
        planes.read(other)


def test_a_full_plane_reserves_nothing(writer):
    assert writer.reserve(1024, 1024, torch.float32) is None     # 4 MiB + record > the plane
    assert writer.reserve(10, 10, torch.float32) is not None


def test_attach_refuses_what_it_cannot_reach(tmp_path):
    planes = AttachedPlanes(torch.device("cpu"))

    def attach(info: PlaneInfo) -> str:
        return asyncio.run(planes.attach(info))
    gone = PlaneInfo("shm", "999999-deadbeef", MIB)
    assert "no shared memory" in attach(gone)
    assert "transport" in attach(PlaneInfo("rdma", "x", MIB))
    assert "address" in attach(PlaneInfo("stream", "x", MIB))
    impostor = os.path.join(SHM_DIR, PREFIX + f"{os.getpid()}-impostor")
    with open(impostor, "wb") as f:
        f.write(b"\0" * MIB)
    try:
        assert "is not feature plane" in attach(PlaneInfo("shm", f"{os.getpid()}-impostor", MIB))
    finally:
        os.unlink(impostor)
    assert "cuda" in attach(PlaneInfo("cuda-ipc", "x", MIB, b"[]"))
    assert planes.readers == {}


def test_planes_of_dead_targets_are_removed():
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, torch
        from services.common.feature_plane import PlaneWriter
        w = PlaneWriter("shm", 1 << 20, torch.device("cpu"))
        print(w.plane_id)
        os._exit(0)               # like kill -9: no clean-up
    """)], capture_output=True, text=True, check=True, cwd=os.getcwd())
    path = os.path.join(SHM_DIR, PREFIX + proc.stdout.strip())
    assert os.path.exists(path)
    remove_stale_shm()
    assert not os.path.exists(path)


READER = """
import sys
import torch
from services.common.feature_plane import PlaneInfo, PlaneReader, PlaneRef
from dflash.v1 import common_pb2
info = PlaneInfo.from_pb(common_pb2.FeaturePlane.FromString(bytes.fromhex(sys.argv[1])))
ref = PlaneRef.from_pb(common_pb2.FeatureRef.FromString(bytes.fromhex(sys.argv[2])))
view = PlaneReader(info, torch.device("cuda")).read(ref)
print(view.device.type, float(view.float().sum()), flush=True)
import os
os._exit(0)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_round_trip_between_processes():
    writer = PlaneWriter("cuda-ipc", 64 * MIB, torch.device("cuda"))
    rows = torch.randn(100, 4096, device="cuda").to(torch.bfloat16)
    pub = writer.reserve(100, 4096, torch.bfloat16)
    writer.write(pub, 0, rows)
    torch.cuda.synchronize()
    proc = subprocess.run([sys.executable, "-c", READER, writer.info.to_pb().SerializeToString().hex(),
                           pub.ref.to_pb().SerializeToString().hex()],
                          capture_output=True, text=True, cwd=os.getcwd(), timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    device, total = proc.stdout.split()
    assert device == "cuda" and float(total) == pytest.approx(float(rows.float().sum()), rel=1e-3)


def test_a_cuda_ipc_plane_needs_a_cuda_target_and_a_known_choice(tiny_llama_dir):
    with pytest.raises(ValueError, match="cuda-ipc needs --device cuda"):
        TargetConfig(str(tiny_llama_dir), feature_plane="cuda-ipc")
    with pytest.raises(ValueError, match=re.escape("allowed auto | shm | cuda-ipc | stream | off")):
        TargetConfig(str(tiny_llama_dir), feature_plane="rdma")


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a GPU"))])
def test_the_target_engine_publishes_and_frees(tiny_llama_dir, device):
    """Prefill and Verify publish in the sequence's plane (one publication each, equal to the
    features an in-message sequence gets); features_consumed frees what the draft holds, and
    Release the rest. On a GPU the shared memory is registered with CUDA on both sides (the
    rows go into it by DMA, straight from the device) and must read back the same."""
    worker = TargetWorker.started(TargetConfig(str(tiny_llama_dir), kv_budget_bytes=8 * MIB,
                                               feature_plane="shm", feature_plane_mib=4,
                                               device=device))
    engine = TargetEngine(worker)
    engine.start()
    try:
        (info,) = engine.publisher.planes()
        planes = PlaneReader(info, torch.device(device))
        writer = next(iter(engine.publisher.writers.values()))
        assert writer.dma == (device == "cuda") and planes.data.is_pinned() == writer.dma
        prompt, layers = list(range(3, 40)), (0, 1)

        def prefill(seq, plane):
            return asyncio.run(engine.prefill(PrefillCall(seq, prompt, SamplingConfig(), layers,
                                                          torch.float32, feature_plane=plane)))
        published, inline = prefill("p", info.plane_id), prefill("i", "")
        assert isinstance(published.features, PlaneRef) and published.features.rows == len(prompt)
        assert torch.equal(planes.read(published.features), inline.features)
        anchor = published.next_token
        step = asyncio.run(engine.verify("p", [anchor, 5, 6]))           # nothing consumed yet
        assert isinstance(step.features, PlaneRef) and writer.extents.used > 0
        used = writer.extents.used
        asyncio.run(engine.verify("p", [step.committed[-1]], None, step.seq_len))
        assert writer.extents.used < used                                 # those two freed
        with pytest.raises(DataLoss, match="stale"):
            planes.read(published.features)
        asyncio.run(engine.release("p"))
        assert writer.extents.used == 0 and engine.publisher.usage() == 0
    finally:
        engine.stop()
        for w in engine.publisher.writers.values():
            w.close()
