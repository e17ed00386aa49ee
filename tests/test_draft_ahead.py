"""Draft-ahead through real processes (tiny Llama target, random DFlash draft, `--draft-ahead
on`): the target's commit notice reaches the draft as it answers a Verify, the draft drafts the
next block before the Propose comes, and

- a Propose that continues exactly as the notice said takes those drafts: the same tokens a
  draft without draft-ahead proposes from the same features (an in-message twin sequence);
- a Propose asking another block size redrafts with the context already in ("reshaped"); one
  whose features came in the message instead undoes the ahead context ("undone") - both give
  the twin's drafts;
- through the gateway, over shared memory and the feature stream, the output is the target's
  own greedy output (on a GPU: over CUDA IPC as well, the target in fp32), and the draft's
  queue is empty afterwards; after a kill -9 of the target mid-stream as well (the draft
  subscribes to the restarted target's plane and drafts ahead again)."""
from __future__ import annotations

import time

import grpc
import pytest
import torch
from support import prom
from support.draft_service import start_draft
from support.gateway_stack import start_gateway
from support.procs import free_port, start_target
from support.reliability import Streams, kill9, request, restart, wait_for
from support.target_client import TargetClient

from dflash.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2
from gateway.feed import answer_chunk

pytestmark = pytest.mark.slow

CUDA = torch.cuda.is_available()
# the target in fp32 on a GPU: its output is compared token for token with its own decoding
TARGET_FLAGS = ("--device", "cuda", "--dtype", "float32") if CUDA else ()
DRAFT_FLAGS = ("--device", "cuda", "--dtype", "bfloat16") if CUDA else ()
TRANSPORTS = ["shm", "stream"] + (["cuda-ipc"] if CUDA else [])   # the GPU run: CUDA IPC too
PROMPT = list(range(5, 45))
BLOCK = 8
AHEAD = "dflash_draft_ahead_blocks_total"


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("draft_ahead")


@pytest.fixture(scope="module")
def services(tiny_llama_02_dir, tiny_llama_02_drafter, logs):
    target = start_target(tiny_llama_02_dir, logs, "--feature-plane", "auto")
    try:
        draft = start_draft(tiny_llama_02_dir, logs, "--draft-ahead", "on", "--metrics-port",
                            str(free_port()), model_dir=tiny_llama_02_drafter)
        draft.metrics_port = int(draft.args[draft.args.index("--metrics-port") + 1])
        yield target, draft
        draft.stop()
    finally:
        target.stop()


class Pair:
    """Two sequences of one prompt on the target and the draft: `plane` publishes in the shm
    plane (its Verify answers notify the draft), `twin` gets its features in messages (no
    notices): its drafts are what the draft proposes without draft-ahead."""

    def __init__(self, services, name: str) -> None:
        target, draft = services
        self.tc = TargetClient(target.address)
        self.channel = grpc.insecure_channel(draft.address)
        self.draft = draft_pb2_grpc.DraftStub(self.channel)
        self.metrics_port = draft.metrics_port
        dcaps = self.draft.GetCapabilities(common_pb2.GetCapabilitiesRequest(), timeout=30)
        plane = next(p for p in self.tc.capabilities().feature_planes if p.transport == "shm")
        plane.address = self.tc.address             # what the gateway fills in
        assert self.draft.AttachPlane(plane, timeout=30).attached
        self.names = {"plane": f"{name}-p", "twin": f"{name}-t"}
        self.state = {}
        self.parents: dict[str, list[int]] = {}
        for kind, seq in self.names.items():
            resp = self.tc.stub.Prefill(target_pb2.PrefillRequest(
                sequence_id=seq, token_ids=PROMPT, capture_layers=dcaps.target_layer_ids,
                feature_dtype=dcaps.feature_dtype,
                feature_plane=plane.plane_id if kind == "plane" else ""), timeout=60)
            self.state[kind] = (0, answer_chunk(resp), PROMPT, resp.next_token)

    def propose(self, kind: str, block: int = BLOCK, chunk=None, tree: int = 0) -> list[int]:
        """The drafts (a tree's: `self.parents[kind]` holds their parents)."""
        start, own, tokens, anchor = self.state[kind]
        resp = self.draft.Propose(draft_pb2.ProposeRequest(
            sequence_id=self.names[kind], positions=list(range(start, start + len(tokens))),
            feature_chunks=[chunk or own], new_token_ids=tokens, anchor=anchor,
            block_size=block, tree_nodes=tree), timeout=60)
        self.state[kind] = (start + len(tokens), None, [], anchor)
        self.parents[kind] = list(resp.draft_parents)
        return list(resp.draft_tokens)

    def verify(self, kind: str, drafts: list[int]) -> target_pb2.VerifyResponse:
        start, _, _, anchor = self.state[kind]
        v = self.tc.stub.Verify(target_pb2.VerifyRequest(
            sequence_id=self.names[kind], token_ids=[anchor] + drafts, features_consumed=start,
            parents=self.parents[kind]), timeout=60)
        committed = list(v.committed_tokens)
        self.state[kind] = (start, answer_chunk(v), [anchor] + committed[:-1], committed[-1])
        return v

    def forwards(self) -> float:
        return prom.value(self.metrics_port, "dflash_forward_tokens_total", service="draft") or 0

    def outcome(self, name: str) -> float:
        return prom.value(self.metrics_port, AHEAD, outcome=name) or 0

    def close(self) -> None:
        for seq in self.names.values():
            self.tc.release(seq)
        self.tc.close()
        self.channel.close()


def _until_drafted_ahead(pair: Pair, before: float) -> None:
    """Until the draft's forward counter moved past `before` (the ahead block ran): the test
    waits for the notice instead of racing it."""
    deadline = time.monotonic() + 30
    while pair.forwards() <= before:
        assert time.monotonic() < deadline, "no block was drafted ahead within 30 s"
        time.sleep(0.05)


@pytest.fixture
def pair(services, request):
    p = Pair(services, request.node.name[:40].replace("[", "-").replace("]", ""))
    yield p
    p.close()


@pytest.mark.parametrize("tree", [0, 20], ids=["chain", "tree"])   # 20 > depth 7: it branches
def test_a_propose_that_continues_as_noticed_takes_the_drafts_drafted_ahead(pair, tree):
    drafts = {k: pair.propose(k, tree=tree) for k in ("plane", "twin")}
    for step in range(5):
        assert drafts["plane"] == drafts["twin"], f"step {step}"
        assert pair.parents["plane"] == pair.parents["twin"]
        assert bool(pair.parents["plane"]) == bool(tree)
        before = pair.forwards()
        v = {k: pair.verify(k, drafts[k]) for k in ("plane", "twin")}
        assert v["plane"].committed_tokens == v["twin"].committed_tokens
        _until_drafted_ahead(pair, before)
        used = pair.outcome("used")
        drafts = {k: pair.propose(k, tree=tree) for k in ("plane", "twin")}
        assert pair.outcome("used") == used + 1, f"step {step}: the ahead block was not used"
    # nothing stays queued on the draft's engine (an ahead work is done in the step that sees it)
    assert prom.value(pair.metrics_port, "dflash_requests_waiting", service="draft") == 0
    assert prom.value(pair.metrics_port, "dflash_requests_running", service="draft") == 0


def test_another_size_redrafts_and_message_features_undo_the_ahead_context(pair):
    drafts = {k: pair.propose(k) for k in ("plane", "twin")}
    for step, (block, inline) in enumerate([(4, False), (BLOCK, True), (BLOCK, False)]):
        before = pair.forwards()
        v = {k: pair.verify(k, drafts[k]) for k in ("plane", "twin")}
        _until_drafted_ahead(pair, before)
        counts = {o: pair.outcome(o) for o in ("used", "reshaped", "undone")}
        # inline: the plane sequence's Propose carries the twin's message bytes instead of its ref
        chunk = pair.state["twin"][1] if inline else None
        drafts = {"plane": pair.propose("plane", block, chunk), "twin": pair.propose("twin", block)}
        assert drafts["plane"] == drafts["twin"], f"step {step}"
        assert len(drafts["plane"]) == block - 1
        expected = "undone" if inline else "reshaped" if block != BLOCK else "used"
        after = {o: pair.outcome(o) for o in counts}
        assert after[expected] == counts[expected] + 1, (step, counts, after)
        assert v["plane"].committed_tokens == v["twin"].committed_tokens


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_gateway_output_is_the_targets_own_with_draft_ahead(tiny_llama_02_dir, logs,
                                                                tiny_llama_02_drafter,
                                                                smollm2_dir, transport):
    target = start_target(tiny_llama_02_dir, logs, *TARGET_FLAGS, "--feature-plane", transport)
    metrics_port = free_port()
    draft = start_draft(tiny_llama_02_dir, logs, *DRAFT_FLAGS, "--draft-ahead", "on",
                        "--metrics-port", str(metrics_port), model_dir=tiny_llama_02_drafter)
    gw = start_gateway(target.address, smollm2_dir, logs, "--speculation", "fixed",
                       draft=draft.address)
    try:
        tokens, _, responses = gw.generate(PROMPT, 48)
        reference = TargetClient(target.address).greedy("plain", PROMPT, len(tokens))
        assert tokens == reference and responses[-1].usage.draft_steps > 0
        assert f"features travel through the target's {transport} plane" in gw.log()
        assert "draft-ahead: commit notices subscribed" in draft.log()
        # no notice stays queued on the draft's engine (the first version's stale ones stayed,
        # taken into every iteration: counted running, with nothing running)
        wait_for(lambda: all(prom.value(metrics_port, f"dflash_requests_{g}", service="draft") == 0
                             for g in ("waiting", "running")), 10, "the draft's engine idle")
    finally:
        for p in (gw, draft, target):
            p.stop()


def test_a_target_restart_resubscribes_and_changes_nothing(tiny_llama_02_dir, logs,
                                                          tiny_llama_02_drafter, smollm2_dir):
    target = start_target(tiny_llama_02_dir, logs, "--feature-plane", "shm")
    draft = start_draft(tiny_llama_02_dir, logs, "--draft-ahead", "on",
                        model_dir=tiny_llama_02_drafter)
    gw = start_gateway(target.address, smollm2_dir, logs, "--speculation", "fixed",
                       "--upstream-wait", "120", draft=draft.address)
    try:
        n = 160
        reference = TargetClient(target.address).greedy("plain", PROMPT, n)
        streams = Streams(gw.stub, [request(PROMPT, n)]).start()
        streams.wait_tokens(16)
        kill9(target)
        target = restart(target, logs / "restarted").wait_serving()
        [result] = streams.join()
        assert result.error is None and result.tokens == reference
        wait_for(lambda: draft.log().count("draft-ahead: commit notices subscribed") >= 2, 30,
                 "the draft subscribed to the restarted target's plane")
        assert "features travel through the target's shm plane" in gw.log()
    finally:
        for p in (gw, draft, target):
            p.stop()


def test_the_flag_is_auto_by_default_and_auto_means_a_cuda_draft():
    from services.draft.config import DraftConfig
    assert DraftConfig("target").draft_ahead == "auto"
    assert not DraftConfig("target").ahead                               # the CPU: off
    assert DraftConfig("target", device="cuda").ahead
    assert not DraftConfig("target", device="cuda", draft_ahead="off").ahead
    assert DraftConfig("target", draft_ahead="on").ahead
    with pytest.raises(ValueError, match=r"allowed \('auto', 'on', 'off'\)"):
        DraftConfig("target", draft_ahead="yes")
