"""dflash.v1.Draft servicer: protobuf <-> domain objects; request validation; nothing else."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
import torch

from dflash.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from services.common import call_stream, callers, tensor_codec, validation
from services.common.errors import DataLoss, InvalidArgument, NotReady, ServiceError, rpc
from services.common.feature_plane import PlaneInfo, PlaneRef, join_rows
from services.common.tls import ClientTls
from services.draft.drafter import DrafterFacts
from services.draft.engine import DraftEngine, ProposeCall
from services.draft.planes import AttachedPlanes
from services.draft.propose_calibration import ProposeCurves

log = logging.getLogger("dflash.draft.servicer")
PROTOCOL_VERSION = 1
SERVICE_NAME = "dflash.v1.Draft"


class DraftServicer(draft_pb2_grpc.DraftServicer):
    """`stage` says what start-up is doing; `engine` is attached once warm-up is done. Until
    then every RPC answers UNAVAILABLE naming the stage."""

    def __init__(self, lease_seconds: float = 0.0, device: str = "cpu",
                 stream_tls: ClientTls | None = None, internal_token: str = "",
                 ahead: bool = False) -> None:
        """ahead: subscribe to the attached planes' commit notices and draft ahead."""
        self.stage = "starting"
        self.engine: DraftEngine | None = None
        self.call_socket = self.call_socket_id = ""   # --call-socket, in the capabilities
        self.lease_seconds = lease_seconds
        self.planes = AttachedPlanes(torch.device(device), stream_tls, internal_token)
        if ahead:
            self.planes.on_commit = self._commit
        self.propose_cost = ProposeCurves()     # measured at warm-up (propose_calibration.py)

    def _ready(self) -> tuple[DrafterFacts, DraftEngine]:
        if self.engine is None or self.stage != "ready":
            raise NotReady(f"draft not ready: start-up stage '{self.stage}' (loading the drafter, "
                           f"building its backend and warm-up must finish first)")
        return self.engine.drafter.facts, self.engine

    @rpc
    async def GetCapabilities(self, request, context) -> draft_pb2.DraftCapabilities:
        facts, _ = self._ready()
        caps = capabilities(facts, self.lease_seconds, self.planes.transports,
                            self.engine.drafter.prefix_caching, self.propose_cost,
                            self.engine.drafter.config.page_size)
        caps.call_socket, caps.call_socket_id = self.call_socket, self.call_socket_id
        return caps

    @rpc
    async def AttachPlane(self, request: common_pb2.FeaturePlane, context
                          ) -> draft_pb2.AttachPlaneResponse:
        """The gateway offers a target's feature plane: attached when this process can reach it
        (the same host's shared memory, a CUDA IPC handle it can open, the target's feature
        stream at the address given); else the reason."""
        facts, _ = self._ready()
        if not facts.needs_features:
            return draft_pb2.AttachPlaneResponse(attached=False, reason=f"drafter {facts.kind} "
                                                 f"reads no features")
        why = await self.planes.attach(PlaneInfo.from_pb(request))
        return draft_pb2.AttachPlaneResponse(attached=not why, reason=why)

    Propose, ProposeStream = call_stream.unary_and_stream("Propose", "propose",
                                                          draft_pb2.ProposeStreamResponse)

    async def propose(self, request: draft_pb2.ProposeRequest, owner: str
                      ) -> draft_pb2.ProposeResponse:
        """Request -> engine call -> response: the one path of Propose and ProposeStream.
        owner: the caller's tag (callers.py), under which its sequences are filed."""
        facts, engine = self._ready()
        if facts.needs_features:
            await self.planes.arrive(PlaneRef.from_pb(c.ref) for c in request.feature_chunks
                                     if c.HasField("ref"))
        result = await engine.propose(propose_call(request, facts, self.planes, owner))
        return draft_pb2.ProposeResponse(draft_tokens=result.draft_tokens,
                                         context_len=result.context_len,
                                         draft_parents=result.draft_parents,
                                         batch_rows=result.batch_rows,
                                         batch_seconds=result.batch_seconds,
                                         queue_seconds=result.queue_seconds,
                                         load=engine.load())

    def _commit(self, notice: common_pb2.CommitNotice) -> None:
        """A target's commit notice (event loop): the engine drafts ahead when it applies. A
        notice this draft cannot use is dropped: the Propose brings the same, authoritatively."""
        if self.engine is None or self.stage != "ready" \
                or notice.sequence_key not in self.engine.seqs:    # another draft's (a hint:
            return                                                 # the engine checks again)
        try:
            call = ahead_call(notice, self.engine.drafter.facts, self.planes)
        except ServiceError as e:
            log.debug("commit notice dropped: %s", e)
            return
        self.engine.ahead(call)

    @rpc
    async def OpenSequence(self, request: draft_pb2.OpenSequenceRequest, context
                           ) -> draft_pb2.OpenSequenceResponse:
        facts, engine = self._ready()
        seq_key = callers.key(callers.owner(context), validation.sequence_id(request.sequence_id))
        ids = validation.token_ids(request.token_ids, facts.vocab_size)
        if len(ids) > facts.max_context:
            raise InvalidArgument(f"a prompt of {len(ids)} tokens passes the drafter's max "
                                  f"context {facts.max_context}")
        return draft_pb2.OpenSequenceResponse(cached_tokens=await engine.open(seq_key, ids))

    @rpc
    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseResponse:
        _, engine = self._ready()
        seq_key = callers.key(callers.owner(context), validation.sequence_id(request.sequence_id))
        return common_pb2.ReleaseResponse(released=await engine.release(seq_key))


def propose_call(request: draft_pb2.ProposeRequest, facts: DrafterFacts,
                 planes: AttachedPlanes | None = None, owner: str = "") -> ProposeCall:
    """Checks what needs no sequence state; the engine checks continuity with the sequence
    (filed under the caller's `owner` tag)."""
    seq_id = callers.key(owner, validation.sequence_id(request.sequence_id))
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
    features = None
    if facts.needs_features:
        features = (_chunks(request, facts, len(positions), planes) if request.feature_chunks
                    else _features(request.new_features, facts, len(positions), "new_features"))
    nodes = request.tree_nodes
    if nodes > facts.max_tree_nodes:
        raise InvalidArgument(f"tree_nodes {nodes} is not allowed: this drafter builds trees of "
                              f"up to {facts.max_tree_nodes} drafts (0 = a chain)")
    if nodes and block < 2:
        raise InvalidArgument(f"tree_nodes {nodes} with block_size {block}: a tree needs a block "
                              f"of at least 2 (its depth is at most block_size - 1)")
    return ProposeCall(seq_id, start, len(positions), features, ids, request.anchor, block, nodes,
                       _source(request.feature_chunks))


def ahead_call(notice: common_pb2.CommitNotice, facts: DrafterFacts, planes: AttachedPlanes
               ) -> ProposeCall:
    """A commit notice as the Propose it foretells (its size left to the engine); the features
    are read from the plane now, while the target keeps them for the coming Propose."""
    ref = notice.ref
    _check_format("the commit notice's ref", ref.dtype, [ref.rows, ref.width], len(notice.token_ids),
                  facts)
    features = join_rows([planes.read(PlaneRef.from_pb(ref))], planes.device)
    return ProposeCall(notice.sequence_key, notice.start, len(notice.token_ids), features,
                       list(notice.token_ids), notice.next_anchor, 0,
                       source=((ref.plane, ref.publication, ref.offset, ref.rows),))


def _source(chunks) -> tuple:
    """A Propose's features as plane refs (what an ahead block was drafted from), or () when
    any of them came in the message."""
    if not chunks or not all(c.HasField("ref") for c in chunks):
        return ()
    return tuple((c.ref.plane, c.ref.publication, c.ref.offset, c.ref.rows) for c in chunks)


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


def _features(msg: common_pb2.TensorData, facts: DrafterFacts, rows: int, what: str):
    if not msg.data and not msg.shape:
        if rows == 0:
            return None
        raise InvalidArgument(f"{what} is missing: {rows} positions need a "
                              f"[{rows}, {facts.feature_width}] {facts.feature_dtype} tensor")
    _check_format(what, msg.dtype, list(msg.shape), rows, facts)
    features = tensor_codec.decode(msg, what)
    return features if rows else None


def _check_format(what: str, dtype: str, shape: list[int], rows: int, facts: DrafterFacts) -> None:
    if dtype != facts.feature_dtype:
        raise InvalidArgument(f"{what} dtype {dtype or '(unset)'!r}: this drafter takes "
                              f"{facts.feature_dtype!r} (its --feature-dtype)")
    expected = [rows, facts.feature_width]
    if shape != expected:
        raise InvalidArgument(
            f"{what} shape {shape}: expected {expected} = [one row per position, "
            f"K*H = {len(facts.target_layer_ids)} target layers {list(facts.target_layer_ids)} x "
            f"hidden {facts.hidden_size}]")


def _chunks(request: draft_pb2.ProposeRequest, facts: DrafterFacts, rows: int,
            planes: AttachedPlanes | None) -> torch.Tensor | None:
    """feature_chunks -> one tensor [rows, K*H]: a single chunk stays a view (of the message's
    bytes or of the plane); several are joined (join_rows). A ref that cannot be read is
    DataLoss: the gateway sends those features again."""
    if request.new_features.data or request.new_features.shape:
        raise InvalidArgument("send features either in new_features or in feature_chunks, not both")
    parts = []
    for i, chunk in enumerate(request.feature_chunks):
        what = f"feature_chunks[{i}]"
        if chunk.HasField("ref"):
            ref = chunk.ref
            _check_format(what, ref.dtype, [ref.rows, ref.width], ref.rows, facts)
            if planes is None:
                raise DataLoss(f"{what}: this draft reads no feature planes")
            parts.append(planes.read(PlaneRef.from_pb(ref)))
        else:
            msg = chunk.inline
            _check_format(what, msg.dtype, list(msg.shape), msg.shape[0] if msg.shape else 0, facts)
            parts.append(tensor_codec.decode(msg, what))
    total = sum(p.shape[0] for p in parts)
    if total != rows:
        raise InvalidArgument(f"feature_chunks hold {total} rows for {rows} positions: one row "
                              f"per position expected")
    if rows == 0:
        return None
    return join_rows(parts, planes.device if planes is not None else torch.device("cpu"))


def capabilities(facts: DrafterFacts, lease_seconds: float, transports: Sequence[str] = (),
                 prefix_caching: bool = False, propose_cost: ProposeCurves | None = None,
                 page_size: int = 0) -> draft_pb2.DraftCapabilities:
    propose_cost = propose_cost or ProposeCurves()
    t = facts.target
    return draft_pb2.DraftCapabilities(
        protocol_version=PROTOCOL_VERSION, drafter_kind=facts.kind, block_size=facts.block_size,
        target_layer_ids=list(facts.target_layer_ids), mask_token_id=facts.mask_token_id,
        hidden_size=facts.hidden_size, feature_dtype=facts.feature_dtype,
        target=common_pb2.ModelFingerprint(vocab_size=t.vocab_size, hidden_size=t.hidden_size,
                                           num_layers=t.num_layers, tokenizer_hash=t.tokenizer_hash),
        max_block_size=facts.max_block_size, needs_features=facts.needs_features,
        model_id=facts.model_id, lease_seconds=int(lease_seconds),
        max_tree_nodes=facts.max_tree_nodes,
        feature_transports=list(transports) if facts.needs_features else [],
        prefix_caching=prefix_caching, page_size=page_size,
        propose_cost=[common_pb2.CostPoint(tokens=a, seconds=s) for a, s in propose_cost.chains],
        propose_cost_tree=[common_pb2.CostPoint(tokens=a, seconds=s)
                           for a, s in propose_cost.trees])


def add_to_server(servicer: DraftServicer, server: grpc.aio.Server) -> list[str]:
    draft_pb2_grpc.add_DraftServicer_to_server(servicer, server)
    return [SERVICE_NAME]
