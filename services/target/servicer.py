"""dflash.v1.Target servicer: protobuf <-> domain objects; validation; nothing else."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from dflash.v1 import common_pb2, target_pb2, target_pb2_grpc
from runtime.draft_tree import DraftTree, tree_problem
from runtime.logprobs import TokenLogprobs
from runtime.token_mask import mask_problem
from services.common import call_stream, callers, tensor_codec, validation
from services.common.errors import (
    InvalidArgument,
    NotFound,
    NotReady,
    ServiceError,
    failure_status,
    observed,
    rpc,
)
from services.common.feature_plane import PlaneInfo, PlaneRef
from services.common.feature_stream import StreamFeed
from services.target.calls import Features
from services.target.engine import PrefillCall, TargetEngine
from services.target.worker import TargetWorker

PROTOCOL_VERSION = 1
SERVICE_NAME = "dflash.v1.Target"
# worker stage -> what start-up still has to do before the target answers
PENDING = {"loaded": "memory pools, attention backends, warm-up",
           "pools": "attention backends, warm-up", "backends": "warm-up"}


class TargetServicer(target_pb2_grpc.TargetServicer):
    """worker/engine are attached as start-up reaches them; until the worker is ready every RPC
    answers UNAVAILABLE saying which stage is missing."""

    def __init__(self) -> None:
        self.worker: TargetWorker | None = None
        self.engine: TargetEngine | None = None
        self.call_socket = self.call_socket_id = ""  # --call-socket, in the capabilities

    def _ready_engine(self) -> tuple[TargetWorker, TargetEngine]:
        if self.worker is None:
            raise NotReady("target not ready: the model is still loading")
        if not self.worker.ready or self.engine is None:
            stage = self.worker.stage
            raise NotReady(f"target not ready: start-up stage '{stage}'; still to do: "
                           f"{PENDING.get(stage, 'warm-up')}")
        return self.worker, self.engine

    @rpc
    async def GetCapabilities(self, request, context) -> target_pb2.TargetCapabilities:
        worker, engine = self._ready_engine()
        caps = capabilities(worker, engine.publisher.planes())
        caps.call_socket, caps.call_socket_id = self.call_socket, self.call_socket_id
        return caps

    @rpc
    async def Prefill(self, request: target_pb2.PrefillRequest, context) -> target_pb2.PrefillResponse:
        worker, engine = self._ready_engine()
        f = worker.facts
        ids = validation.token_ids(request.token_ids, f.vocab_size)
        if not ids:
            raise InvalidArgument("token_ids is empty: a prompt needs at least one token")
        if len(ids) >= f.max_context:
            raise InvalidArgument(f"prompt of {len(ids)} tokens does not fit: the max context is "
                                  f"{f.max_context} tokens, and at least one must be left to generate")
        layers = tuple(request.capture_layers)
        bad = [layer for layer in layers if layer >= f.num_layers]
        if bad or len(set(layers)) != len(layers):
            raise InvalidArgument(f"capture_layers {list(layers)} invalid: ids must be distinct and "
                                  f"in [0, {f.num_layers})")
        if request.features_from > len(ids):
            raise InvalidArgument(f"features_from {request.features_from} is past the prompt's "
                                  f"{len(ids)} tokens")
        if request.num_generated > len(ids):
            raise InvalidArgument(f"num_generated {request.num_generated} exceeds the "
                                  f"{len(ids)} tokens given")
        call = PrefillCall(
            seq_id=callers.key(callers.owner(context), validation.sequence_id(request.sequence_id)),
            token_ids=ids,
            sampling=validation.sampling(request.sampling, f.vocab_size), capture_layers=layers,
            feature_dtype=tensor_codec.wire_dtype(request.feature_dtype or "bfloat16"),
            num_generated=request.num_generated, feature_plane=request.feature_plane,
            token_mask=_masks([request.token_mask], f.vocab_size)[0] if request.token_mask
            else b"", features_from=request.features_from)
        result = await engine.prefill(call)
        return target_pb2.PrefillResponse(
            next_token=result.next_token, seq_len=result.seq_len, **_features(result.features),
            logprobs=_logprobs_pb(result.logprobs) if result.logprobs else None,
            cached_tokens=result.cached_tokens, load=engine.load())

    Verify, VerifyStream = call_stream.unary_and_stream("Verify", "verify",
                                                        target_pb2.VerifyStreamResponse)

    async def verify(self, request: target_pb2.VerifyRequest, owner: str
                     ) -> target_pb2.VerifyResponse:
        """Request -> engine call -> response: the one path of Verify and VerifyStream.
        owner: the caller's tag (callers.py); another caller's sequence is NOT_FOUND."""
        worker, engine = self._ready_engine()
        seq_id = callers.key(owner, validation.sequence_id(request.sequence_id))
        ids = validation.token_ids(request.token_ids, worker.facts.vocab_size)
        tree = None
        if request.parents:
            tree = _checked_tree(ids, list(request.parents), worker)
        elif not 1 <= len(ids) <= worker.config.max_block_size:
            max_b = worker.config.max_block_size
            raise InvalidArgument(f"a verify block has {len(ids)} tokens; allowed 1..{max_b} "
                                  f"(anchor + up to {max_b - 1} drafts)")
        masks = ()
        if request.token_masks:
            masks = _block_masks(list(request.token_masks), len(ids), worker.facts.vocab_size)
        result = await engine.verify(seq_id, ids, tree, request.features_consumed, masks)
        return target_pb2.VerifyResponse(
            accepted=result.accepted, committed_tokens=result.committed, seq_len=result.seq_len,
            **_features(result.features),
            logprobs=[_logprobs_pb(lp) for lp in result.logprobs or ()],
            batch_tokens=result.batch_tokens, batch_seconds=result.batch_seconds,
            queue_seconds=result.queue_seconds, load=engine.load())

    @rpc
    async def Release(self, request: common_pb2.ReleaseRequest, context) -> common_pb2.ReleaseResponse:
        _, engine = self._ready_engine()
        seq_key = callers.key(callers.owner(context), validation.sequence_id(request.sequence_id))
        return common_pb2.ReleaseResponse(released=await engine.release(seq_key))

    async def FeatureStream(self, request: common_pb2.FeatureStreamRequest, context
                            ) -> AsyncIterator[common_pb2.FeatureStreamMessage]:
        """A draft's subscription to a stream plane: runs until the draft goes (or we stop).
        Counted and logged as one RPC when it ends."""
        with observed("FeatureStream", "") as outcome:
            try:
                feed = self._feed(request.plane_id, request.commits)
            except ServiceError as e:
                outcome.code = e.code
                await context.abort(e.code, str(e))
            messages = feed.subscribe(request.commits)
            try:
                async for msg in messages:
                    yield msg
            except asyncio.CancelledError:
                outcome.code = grpc.StatusCode.CANCELLED
                raise
            except Exception as e:  # noqa: BLE001 - a bug: INTERNAL, logged with its traceback
                outcome.code, details = failure_status(e, "FeatureStream", "")
                await context.abort(outcome.code, details)
            finally:
                await messages.aclose()

    def _feed(self, plane_id: str, commits: bool) -> StreamFeed:
        """A stream plane's feed (rows), or any plane's when only its commits are asked for."""
        _, engine = self._ready_engine()
        feeds = {k: f for k, f in engine.publisher.feeds.items() if commits or f.carries_rows}
        feed = feeds.get(plane_id)
        if feed is None:
            kind = "feature plane" if commits else "stream feature plane"
            raise NotFound(f"no {kind} {plane_id!r} here (this target's: {sorted(feeds) or 'none'}"
                           f"): it restarted since, or offers none (--feature-plane)")
        return feed


def _features(features: Features) -> dict:
    """An answer's features: in the message (TensorData), or a reference into a plane."""
    if features is None:
        return {}
    if isinstance(features, PlaneRef):
        return {"feature_ref": features.to_pb()}
    return {"features": tensor_codec.encode(features)}


def _logprobs_pb(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                                    top_logprobs=[v for _, v in lp.top])


def _masks(masks: list[bytes], vocab_size: int) -> tuple[bytes, ...]:
    """Structured output's token masks, each checked (runtime/token_mask.py)."""
    for i, mask in enumerate(masks):
        problem = mask_problem(mask, vocab_size)
        if problem is not None:
            where = f"token_masks[{i}]" if len(masks) > 1 else "token mask"
            raise InvalidArgument(f"{where}: {problem}")
    return tuple(masks)


def _block_masks(masks: list[bytes], rows: int, vocab_size: int) -> tuple[bytes, ...]:
    """A Verify's token_masks: one per block row (the anchor, then each draft or tree node)."""
    if len(masks) != rows:
        raise InvalidArgument(f"token_masks has {len(masks)} masks for a block of {rows} tokens: "
                              f"one per block row (the anchor and each draft or tree node)")
    return _masks(masks, vocab_size)


def _checked_tree(ids: list[int], parents: list[int], worker: TargetWorker) -> DraftTree:
    """A tree Verify's drafts: one parent per draft, each before its child, within the node and
    depth limits - checked here, the one place a tree is validated (the gateway forwards what
    the draft proposed, the engine trusts this)."""
    max_nodes, max_b = worker.max_tree_nodes, worker.config.max_block_size
    if max_nodes == 0:
        raise InvalidArgument("this target verifies chains only (--max-tree-nodes 0, or a "
                              "hybrid model with --max-block-size 1): send no parents")
    tree = DraftTree(ids[1:], parents)
    problem = tree_problem(tree, max_nodes, max_b - 1)
    if problem is not None:
        raise InvalidArgument(f"a tree Verify: {problem} (nodes: max_tree_nodes {max_nodes}; "
                              f"depth: --max-block-size {max_b} minus the anchor)")
    return tree


def capabilities(worker: TargetWorker, planes: Sequence[PlaneInfo] = ()
                 ) -> target_pb2.TargetCapabilities:
    """planes: the engine's feature planes (none before it exists)."""
    f, cfg = worker.facts, worker.config
    return target_pb2.TargetCapabilities(
        protocol_version=PROTOCOL_VERSION, model_id=f.model_id, architecture=f.architecture,
        vocab_size=f.vocab_size, eos_token_ids=list(f.eos_token_ids), max_context=f.max_context,
        dtype=worker.dtype_name, kv_dtype=worker.dtype_name,
        attention_backend=getattr(worker.attn_backend, "inner_name", worker.attn_backend.name),
        hybrid=f.hybrid, mamba_verify_commit=worker.need_mamba_verify_commit,
        num_layers=f.num_layers, hidden_size=f.hidden_size, max_block_size=cfg.max_block_size,
        tokenizer_hash=f.tokenizer_hash, bos_token_id=f.bos_token_id,
        kv_pages_total=worker.kv_cache.usable_pages, kv_page_size=cfg.page_size,
        state_slots_total=worker.state_pool.num_slots if worker.state_pool is not None else 0,
        feature_dtypes=sorted(tensor_codec.WIRE_DTYPES), lease_seconds=int(cfg.lease_seconds),
        max_tree_nodes=worker.max_tree_nodes,
        feature_planes=[p.to_pb() for p in planes],
        verify_cost=[common_pb2.CostPoint(tokens=p.tokens, seconds=p.seconds)
                     for p in worker.verify_cost.chains],
        verify_cost_tree=[common_pb2.CostPoint(tokens=p.tokens, seconds=p.seconds)
                          for p in worker.verify_cost.trees],
        verify_padded_blocks=list(worker.padded_blocks), prefix_caching=worker.prefix_caching)


def add_to_server(servicer: TargetServicer, server: grpc.aio.Server) -> list[str]:
    target_pb2_grpc.add_TargetServicer_to_server(servicer, server)
    return [SERVICE_NAME]
