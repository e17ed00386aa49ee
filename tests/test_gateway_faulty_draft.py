"""A draft that proposes garbage costs only speculation: the target is the one place a proposal is
validated (token ids, tree shape, depth), it refuses a bad one with INVALID_ARGUMENT and appends
nothing, and the gateway verifies the anchor alone for that step. The output stays the target's
own greedy output, token for token.

The faulty draft is a real gRPC server in this process that advertises itself as a compatible
drafter (no features) and answers every Propose with another kind of garbage."""
from __future__ import annotations

import itertools
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from support.gateway_stack import start_gateway
from support.procs import free_port, start_target
from support.target_client import TargetClient

from dflash.v1 import common_pb2, draft_pb2, draft_pb2_grpc

PROMPT = [1, 504, 3458, 314, 4085, 28, 253, 2104, 1345, 30, 216]
N = 40


class FaultyDraft(draft_pb2_grpc.DraftServicer):
    """Cycles through proposals the target must refuse, and one it may use."""

    def __init__(self, caps: draft_pb2.DraftCapabilities, vocab: int) -> None:
        self.caps, self.vocab = caps, vocab
        self.kinds = itertools.cycle(["out_of_vocab", "parent_after_child", "negative",
                                      "too_deep", "plausible"])
        self.proposals: list[tuple[str, int]] = []     # (kind, tree nodes asked)

    def GetCapabilities(self, request, context):
        return self.caps

    def Propose(self, request, context):
        kind = next(self.kinds)
        self.proposals.append((kind, request.tree_nodes))
        drafts = request.block_size - 1
        nodes = request.tree_nodes
        if kind == "out_of_vocab":
            return draft_pb2.ProposeResponse(draft_tokens=[self.vocab + 5] * drafts)
        if kind == "parent_after_child" and nodes >= 2:
            return draft_pb2.ProposeResponse(draft_tokens=[5, 6], draft_parents=[2, 0])
        if kind == "too_deep" and nodes:
            n = min(nodes, 64)                  # a chain as a tree, deeper than any block
            return draft_pb2.ProposeResponse(draft_tokens=[7] * n, draft_parents=list(range(n)))
        if kind == "negative":
            return draft_pb2.ProposeResponse(draft_tokens=[2 ** 31 + 3] * drafts)
        return draft_pb2.ProposeResponse(draft_tokens=[self.vocab - 1] * drafts)

    def Release(self, request, context):
        return common_pb2.ReleaseResponse(released=True)


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("faulty_draft")
    target = start_target(smollm2_dir, logs, "--max-block-size", "8")
    tcaps = TargetClient(target.address).capabilities()
    caps = draft_pb2.DraftCapabilities(
        protocol_version=1, drafter_kind="faulty", block_size=8, max_block_size=8,
        hidden_size=tcaps.hidden_size, feature_dtype="bfloat16", needs_features=False,
        model_id="faulty", lease_seconds=120, max_tree_nodes=16,
        target=common_pb2.ModelFingerprint(vocab_size=tcaps.vocab_size,
                                           hidden_size=tcaps.hidden_size,
                                           num_layers=tcaps.num_layers,
                                           tokenizer_hash=tcaps.tokenizer_hash))
    draft = FaultyDraft(caps, tcaps.vocab_size)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    draft_pb2_grpc.add_DraftServicer_to_server(draft, server)
    status = health.HealthServicer()
    status.set("dflash.v1.Draft", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    gateway = start_gateway(target.address, smollm2_dir, logs, "--spec-tree-nodes", "8",
                            "--wire", "unary", draft=f"127.0.0.1:{port}")
    yield target, draft, gateway
    gateway.stop()
    server.stop(0)
    target.stop()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_garbage_proposals_cost_only_speculation(stack, temperature):
    target, draft, gateway = stack
    before = len(draft.proposals)
    refused_before = gateway.log().count("refused the draft's proposal")
    sampling = common_pb2.SamplingParams(temperature=temperature, seed=7)
    ids, _, responses = gateway.generate(PROMPT, N, sampling=sampling, ignore_eos=True)
    assert len(ids) == N
    assert len(draft.proposals) - before >= 5, "the gateway kept asking the draft"
    asked = draft.proposals[before:]
    assert all(nodes > 0 for _, nodes in asked), asked          # trees, greedy and sampled
    usage = responses[-1].usage
    assert usage.verify_steps >= N // 8 and usage.draft_steps < usage.verify_steps
    if temperature == 0:
        assert ids == TargetClient(target.address).greedy("alone", PROMPT, N)
    assert gateway.log().count("refused the draft's proposal") > refused_before
