"""The feature data plane through real processes (tiny Llama target, random DFlash draft):

- features a target publishes in its plane (shared memory, or its feature stream to the draft)
  reach the draft as the same values as features in messages (the draft's proposals from both
  are identical, step after step), and the plane's bytes equal the message's bytes exactly;
- a stale reference is DATA_LOSS naming the plane and the publication; a Prefill naming a plane
  the target does not have (it restarted) answers in the message; the draft refuses to attach
  what it cannot reach, saying why;
- a draft that cannot reach the target's shared memory (its own /dev/shm, as in another
  container) is served with features in messages, output identical.
On a GPU the same exchange runs over CUDA IPC (the developers' H200 run; skipped in CI)."""
from __future__ import annotations

import subprocess

import grpc
import pytest
import torch
from support.draft_service import start_draft
from support.gateway_stack import start_gateway
from support.procs import start_target
from support.target_client import TargetClient

from dflash.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2
from gateway.feed import answer_chunk
from services.common import tensor_codec
from services.common.feature_plane import PlaneInfo, PlaneReader, PlaneRef

pytestmark = pytest.mark.slow

CUDA = torch.cuda.is_available()
DEVICE_FLAGS = ("--device", "cuda", "--dtype", "bfloat16") if CUDA else ()
TRANSPORTS = ["shm", "stream"] + (["cuda-ipc"] if CUDA else [])
PROMPT = list(range(5, 45))
BLOCK = 8
PRIVATE_SHM = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("feature_plane_services")


@pytest.fixture(scope="module")
def services(tiny_llama_02_dir, tiny_llama_02_drafter, logs):
    target = start_target(tiny_llama_02_dir, logs, *DEVICE_FLAGS, "--feature-plane", "auto")
    try:
        draft = start_draft(tiny_llama_02_dir, logs, *DEVICE_FLAGS,
                            model_dir=tiny_llama_02_drafter)
        yield target, draft
        draft.stop()
    finally:
        target.stop()


@pytest.fixture(scope="module")
def clients(services):
    target, draft = services
    tc = TargetClient(target.address)
    channel = grpc.insecure_channel(draft.address)
    yield tc, draft_pb2_grpc.DraftStub(channel)
    tc.close()
    channel.close()


def _plane(tc: TargetClient, transport: str) -> common_pb2.FeaturePlane:
    """The target's plane of that transport, as the gateway offers it (a stream: with the
    address the draft dials)."""
    plane = next(p for p in tc.capabilities().feature_planes if p.transport == transport)
    if transport == "stream":
        plane.address = tc.address
    return plane


def _prefill(tc, dcaps, seq: str, plane: str) -> target_pb2.PrefillResponse:
    return tc.stub.Prefill(target_pb2.PrefillRequest(
        sequence_id=seq, token_ids=PROMPT, capture_layers=dcaps.target_layer_ids,
        feature_dtype=dcaps.feature_dtype, feature_plane=plane), timeout=60)


def _propose(draft, seq: str, start: int, chunk: common_pb2.FeatureChunk, rows: int, anchor: int):
    return draft.Propose(draft_pb2.ProposeRequest(
        sequence_id=seq, positions=list(range(start, start + rows)), feature_chunks=[chunk],
        anchor=anchor, block_size=BLOCK), timeout=60)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_plane_features_equal_message_features_step_by_step(clients, transport):
    tc, draft = clients
    dcaps = draft.GetCapabilities(common_pb2.GetCapabilitiesRequest(), timeout=30)
    assert transport in dcaps.feature_transports
    plane = _plane(tc, transport)
    assert draft.AttachPlane(plane, timeout=30).attached
    seqs = {"plane": _prefill(tc, dcaps, f"p-{transport}", plane.plane_id),
            "inline": _prefill(tc, dcaps, f"i-{transport}", "")}
    assert seqs["plane"].HasField("feature_ref") and not seqs["plane"].features.data
    assert seqs["inline"].features.data and not seqs["inline"].HasField("feature_ref")
    if transport == "shm":                       # the bytes themselves, read from the plane here
        view = PlaneReader(PlaneInfo.from_pb(plane), torch.device("cpu")).read(PlaneRef.from_pb(seqs["plane"].feature_ref))
        assert torch.equal(view, tensor_codec.decode(seqs["inline"].features))
    anchor = seqs["plane"].next_token
    assert anchor == seqs["inline"].next_token
    state = {k: (0, answer_chunk(r), len(PROMPT)) for k, r in seqs.items()}
    for step in range(6):
        drafts = {}
        for kind, (start, chunk, rows) in state.items():
            drafts[kind] = list(_propose(draft, f"{kind[0]}-{transport}", start, chunk, rows,
                                         anchor).draft_tokens)
        assert drafts["plane"] == drafts["inline"], f"step {step}"
        for kind, (start, _, rows) in list(state.items()):
            v = tc.stub.Verify(target_pb2.VerifyRequest(
                sequence_id=f"{kind[0]}-{transport}", token_ids=[anchor] + drafts[kind],
                features_consumed=start + rows), timeout=60)
            state[kind] = (start + rows, answer_chunk(v), v.accepted + 1)
            committed = list(v.committed_tokens)
        assert state["plane"][1].HasField("ref") and state["inline"][1].HasField("inline")
        anchor = committed[-1]
    for kind in state:
        tc.release(f"{kind[0]}-{transport}")


def test_a_stale_reference_is_data_loss(clients):
    tc, draft = clients
    dcaps = draft.GetCapabilities(common_pb2.GetCapabilitiesRequest(), timeout=30)
    plane = _plane(tc, "shm")
    draft.AttachPlane(plane, timeout=30)
    ref = _prefill(tc, dcaps, "stale", plane.plane_id).feature_ref
    stale = common_pb2.FeatureRef()
    stale.CopyFrom(ref)
    stale.publication += 1
    with pytest.raises(grpc.RpcError) as e:
        _propose(draft, "stale", 0, common_pb2.FeatureChunk(ref=stale), len(PROMPT), 1)
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    assert "stale" in e.value.details() and str(stale.publication) in e.value.details()
    foreign = common_pb2.FeatureRef()
    foreign.CopyFrom(ref)
    foreign.plane = "1-elsewhere"
    with pytest.raises(grpc.RpcError) as e:
        _propose(draft, "stale", 0, common_pb2.FeatureChunk(ref=foreign), len(PROMPT), 1)
    assert e.value.code() == grpc.StatusCode.DATA_LOSS and "not attached" in e.value.details()
    ok = _propose(draft, "stale", 0, common_pb2.FeatureChunk(ref=ref), len(PROMPT), 1)
    assert len(ok.draft_tokens) == BLOCK - 1            # the draft serves on
    tc.release("stale")


def test_unknown_plane_answers_in_the_message_and_attach_says_why_not(clients):
    tc, draft = clients
    dcaps = draft.GetCapabilities(common_pb2.GetCapabilitiesRequest(), timeout=30)
    resp = _prefill(tc, dcaps, "unknown-plane", "123-restarted-since")
    assert resp.features.data and not resp.HasField("feature_ref")
    tc.release("unknown-plane")
    gone = draft.AttachPlane(common_pb2.FeaturePlane(transport="shm", plane_id="1-gone",
                                                     size_bytes=1 << 20), timeout=30)
    assert not gone.attached and "no shared memory" in gone.reason
    odd = draft.AttachPlane(common_pb2.FeaturePlane(transport="rdma", plane_id="x"), timeout=30)
    assert not odd.attached and "rdma" in odd.reason


def _private_shm_works() -> bool:
    probe = subprocess.run([*PRIVATE_SHM, "true"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _private_shm_works(), reason="needs unshare -m (root) for a private /dev/shm")
@pytest.mark.parametrize("offered", ["auto", "shm"])
def test_a_draft_that_cannot_reach_the_shared_memory(tiny_llama_02_dir, tiny_llama_02_drafter,
                                                     logs, smollm2_dir,
                                                     offered):
    """A draft in its own IPC namespace (another container, or host): with the target's
    feature stream offered (auto) the features come over it; with only shared memory offered
    they travel in messages. The output is the target's either way."""
    target = start_target(tiny_llama_02_dir, logs, "--feature-plane", offered)
    draft = start_draft(tiny_llama_02_dir, logs, *DEVICE_FLAGS, model_dir=tiny_llama_02_drafter,
                        prefix=PRIVATE_SHM)
    gw = start_gateway(target.address, smollm2_dir, logs, "--speculation", "fixed",
                       draft=draft.address)
    try:
        tokens, _, responses = gw.generate(PROMPT, 40)
        reference = TargetClient(target.address).greedy("plain", PROMPT, len(tokens))
        assert tokens == reference and responses[-1].usage.draft_steps > 0
        log = gw.log()
        assert "no shared memory" in log
        if offered == "auto":
            assert "features travel through the target's stream plane" in log
        else:
            assert "features travel in messages: the draft attached none" in log
    finally:
        for p in (gw, draft, target):
            p.stop()
