"""dflash.v1.Draft servicer: protobuf <-> domain objects; request validation; nothing else."""
from __future__ import annotations

import grpc

from dflash.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from services.common import call_stream, tensor_codec, validation
from services.common.errors import InvalidArgument, NotReady, rpc
from services.draft.drafter import DrafterFacts
from services.draft.engine import DraftEngine, ProposeCall

PROTOCOL_VERSION = 1
SERVICE_NAME = "dflash.v1.Draft"


class DraftServicer(draft_pb2_grpc.DraftServicer):
    """`stage` says what start-up is doing; `engine` is attached once warm-up is done. Until
    then every RPC answers UNAVAILABLE naming the stage."""

    def __init__(self, lease_seconds: float = 0.0) -> None:
        self.stage = "starting"
        self.engine: DraftEngine | None = None
        self.lease_seconds = lease_seconds

    def _ready(self) -> tuple[DrafterFacts, DraftEngine]:
        if self.engine is None or self.stage != "ready":
            raise NotReady(f"draft not ready: start-up stage '{self.stage}' (loading the drafter, "
                           f"building its backend and warm-up must finish first)")
        return self.engine.drafter.facts, self.engine

    @rpc
    async def GetCapabilities(self, request, context) -> draft_pb2.DraftCapabilities:
        facts, _ = self._ready()
        return capabilities(facts, self.lease_seconds)

    Propose, ProposeStream = call_stream.unary_and_stream("Propose", "propose",
                                                          draft_pb2.ProposeStreamResponse)

    async def propose(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        """Request -> engine call -> response: the one path of Propose and ProposeStream."""
        facts, engine = self._ready()
        result = await engine.propose(propose_call(request, facts))
        return draft_pb2.ProposeResponse(draft_tokens=result.draft_tokens,
                                         context_len=result.context_len,
                                         draft_parents=result.draft_parents)

    @rpc
    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseResponse:
        _, engine = self._ready()
        released = await engine.release(validation.sequence_id(request.sequence_id))
        return common_pb2.ReleaseResponse(released=released)


def propose_call(request: draft_pb2.ProposeRequest, facts: DrafterFacts) -> ProposeCall:
    """Checks what needs no sequence state; the engine checks continuity with the sequence."""
    seq_id = validation.sequence_id(request.sequence_id)
    block = request.block_size or facts.block_size
    if not 1 <= block <= facts.max_block_size:
        raise InvalidArgument(f"block_size {block} is not allowed: expected 1..{facts.max_block_size} "
                              f"(0 = the drafter's block size {facts.block_size})")
    if request.anchor >= facts.vocab_size:
        raise InvalidArgument(f"anchor {request.anchor} is outside the target vocabulary: "
                              f"expected an id in [0, {facts.vocab_size})")
    positions = list(request.positions)
    start = _check_positions(positions)
    ids = validation.token_ids(request.new_token_ids, facts.vocab_size, "new_token_ids")
    if ids and len(ids) != len(positions) or facts.needs_tokens and len(ids) != len(positions):
        need = "must" if facts.needs_tokens else "when given, must"
        raise InvalidArgument(f"new_token_ids {need} have one id per position: expected "
                              f"{len(positions)}, got {len(ids)}")
    features = _features(request, facts, len(positions)) if facts.needs_features else None
    nodes = request.tree_nodes
    if nodes > facts.max_tree_nodes:
        raise InvalidArgument(f"tree_nodes {nodes} is not allowed: this drafter builds trees of "
                              f"up to {facts.max_tree_nodes} drafts (0 = a chain)")
    if nodes and block < 2:
        raise InvalidArgument(f"tree_nodes {nodes} with block_size {block}: a tree needs a block "
                              f"of at least 2 (its depth is at most block_size - 1)")
    return ProposeCall(seq_id, start, len(positions), features, ids, request.anchor, block, nodes)


def _check_positions(positions: list[int]) -> int:
    """positions must be consecutive; returns the first (0 when empty)."""
    if not positions:
        return 0
    start = positions[0]
    for i, p in enumerate(positions):
        if p != start + i:
            kind = "repeats" if p <= start + i - 1 else "skips"
            raise InvalidArgument(f"positions {kind} at index {i}: expected {start + i}, got {p} "
                                  f"(positions must be consecutive: {start}, {start + 1}, ...)")
    return start


def _features(request: draft_pb2.ProposeRequest, facts: DrafterFacts, rows: int):
    msg = request.new_features
    if not msg.data and not msg.shape:
        if rows == 0:
            return None
        raise InvalidArgument(f"new_features is missing: {rows} positions need a "
                              f"[{rows}, {facts.feature_width}] {facts.feature_dtype} tensor")
    if msg.dtype != facts.feature_dtype:
        raise InvalidArgument(f"new_features dtype {msg.dtype or '(unset)'!r}: this drafter takes "
                              f"{facts.feature_dtype!r} (its --feature-dtype)")
    expected = [rows, facts.feature_width]
    if list(msg.shape) != expected:
        raise InvalidArgument(
            f"new_features shape {list(msg.shape)}: expected {expected} = [one row per position, "
            f"K*H = {len(facts.target_layer_ids)} target layers {list(facts.target_layer_ids)} x "
            f"hidden {facts.hidden_size}]")
    features = tensor_codec.decode(msg, "new_features")
    return features if rows else None


def capabilities(facts: DrafterFacts, lease_seconds: float) -> draft_pb2.DraftCapabilities:
    t = facts.target
    return draft_pb2.DraftCapabilities(
        protocol_version=PROTOCOL_VERSION, drafter_kind=facts.kind, block_size=facts.block_size,
        target_layer_ids=list(facts.target_layer_ids), mask_token_id=facts.mask_token_id,
        hidden_size=facts.hidden_size, feature_dtype=facts.feature_dtype,
        target=common_pb2.ModelFingerprint(vocab_size=t.vocab_size, hidden_size=t.hidden_size,
                                           num_layers=t.num_layers, tokenizer_hash=t.tokenizer_hash),
        max_block_size=facts.max_block_size, needs_features=facts.needs_features,
        model_id=facts.model_id, lease_seconds=int(lease_seconds),
        max_tree_nodes=facts.max_tree_nodes)


def add_to_server(servicer: DraftServicer, server: grpc.aio.Server) -> list[str]:
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    return [SERVICE_NAME]
