"""python -m services.draft --model DIR --target-model DIR --port P [...]: the draft gRPC service.

Start-up: the server listens first (health NOT_SERVING for dflash.v1.Draft, "" SERVING), then
loads the drafter (refusing an incompatible one: exit code 2), builds its KV cache and backend,
warms up with a real append + propose, and only then reports SERVING."""
from __future__ import annotations

import argparse
import asyncio
import logging
import time

import torch

from dflash.v1 import draft_pb2
from runtime.config import default_model_id
from services.common import bootstrap, flags, tls
from services.common.call_socket import SocketMethod
from services.common.hooks import NO_HOOKS, ServiceHooks
from services.common.service_flags import add_model_service_flags, check_server_tls
from services.draft import propose_calibration
from services.draft import servicer as draft_servicer
from services.draft.config import DRAFT_AHEAD, DraftConfig
from services.draft.drafter import DRAFTERS, Drafter, make_drafter
from services.draft.engine import DraftEngine, ProposeCall

log = logging.getLogger("dflash.draft")

WARMUP_ID = "__warmup__"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.draft", description=__doc__.splitlines()[0])
    flags.add(p, "--model", "", str, "drafter checkpoint directory (z-lab DFlash format)")
    flags.add(p, "--target-model", "", str, "the target's HF directory (embedding, LM head, "
                                            "tokenizer fingerprint)")
    flags.add(p, "--drafter", "dflash", str, " | ".join(DRAFTERS))
    add_model_service_flags(
        p, port=50052, kv_budget="256MiB", kv_help="memory for context KV pages",
        token_budget=4096, token_help="feature rows + block tokens per engine iteration",
        drain_help="SIGTERM: seconds for the sequences it holds to be released (Proposes that "
                   "start a sequence are refused meanwhile) before it exits",
        dtype_help="float32 | bfloat16 | float16 | auto (bfloat16 where the device computes it "
                   "natively: CUDA, or a CPU with AVX-512; else float32)")
    flags.add(p, "--max-block-size", 0, int, "largest Propose block (0 = the drafter's block size)")
    flags.add(p, "--max-tree-nodes", 255, int, "dflash: most drafts in a tree Propose (0 = chains "
              "only)")
    flags.add(p, "--draft-vocab", -1, int, "dflash: the tokens drafts come from: -1 = the "
              "drafter's draft_vocab.json ranking when it ships one (else all), 0 = every target "
              "token, N = the ranking's N most frequent")
    flags.add(p, "--block-size", 8, int, "prompt lookup: the block size it advertises")
    flags.add(p, "--max-ngram", 4, int, "prompt lookup: longest suffix n-gram matched")
    flags.add(p, "--min-ngram", 1, int, "prompt lookup: shortest suffix n-gram matched")
    flags.add(p, "--lookup-tree-nodes", 0, int, "prompt lookup: most drafts in a tree of the "
              "continuations of the suffix's earlier occurrences (0 = chains only)")
    flags.add(p, "--feature-dtype", "bfloat16", str, "dtype Propose features arrive in")
    flags.add(p, "--draft-ahead", "auto", str, "dflash: draft a sequence's next block from the "
              "target's commit notice, before the gateway's Propose comes, in the draft's idle "
              "time: auto (on a CUDA device; on the CPU the ahead forward takes the target's "
              "cores) | on | off", choices=list(DRAFT_AHEAD))
    tls.add_client_flags(p)          # the link to a target's feature stream (another host)
    args = p.parse_args(argv)
    if not args.target_model:
        p.error("--target-model (or DFLASH_TARGET_MODEL) is required")
    if args.drafter == "dflash" and not args.model:
        p.error("--model (or DFLASH_MODEL) is required for --drafter dflash")
    check_server_tls(p, args)
    try:
        tls.check_readable(tls.client_from_args(args))
    except tls.TlsConfigError as e:
        p.error(str(e))
    return args


def config_from_args(args: argparse.Namespace) -> DraftConfig:
    return DraftConfig(
        target_dir=args.target_model, model_dir=args.model, drafter=args.drafter,
        device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
        kv_budget_bytes=args.kv_budget, page_size=args.page_size,
        max_block_size=args.max_block_size, max_tree_nodes=args.max_tree_nodes,
        draft_vocab=args.draft_vocab, block_size=args.block_size, max_ngram=args.max_ngram,
        min_ngram=args.min_ngram,
        lookup_tree_nodes=args.lookup_tree_nodes,
        token_budget=args.token_budget, lease_seconds=args.lease_seconds,
        feature_dtype=args.feature_dtype, model_id=args.model_id,
        cuda_graphs=not args.no_cuda_graphs, cpu_gemm=args.cpu_gemm,
        prefix_caching=args.enable_prefix_caching,
        prefix_cache_max_pages=args.prefix_cache_max_pages, deterministic=args.deterministic,
        draft_ahead=args.draft_ahead)


def metrics_name(config: DraftConfig) -> str:
    if config.model_id:
        return config.model_id
    if config.drafter == "dflash":
        return default_model_id(config.model_dir)
    return f"{config.drafter}:{default_model_id(config.target_dir)}"


async def warmup(engine: DraftEngine, drafter: Drafter, delay_s: float) -> None:
    """A real append of a few context rows and a propose of the largest block, then release
    (and the hooks' extra delay: start-up tests)."""
    t0 = time.monotonic()
    f = drafter.facts
    n = 4
    features = (torch.zeros(n, f.feature_width, dtype=getattr(torch, f.feature_dtype))
                if f.needs_features else None)
    await engine.propose(ProposeCall(WARMUP_ID, 0, n, features, [0] * n, 0, f.max_block_size))
    await engine.release(WARMUP_ID)
    await asyncio.sleep(delay_s)
    log.info("warm-up done", extra={"seconds": round(time.monotonic() - t0, 2)})


def service(args: argparse.Namespace, hooks: ServiceHooks) -> bootstrap.ModelService:
    config = config_from_args(args)
    servicer = draft_servicer.DraftServicer(config.lease_seconds, config.device,
                                            tls.client_from_args(args), args.internal_token,
                                            ahead=config.ahead)

    async def start() -> DraftEngine:
        """Drafter (refused when incompatible: DrafterRefused), its KV cache and backend, CUDA
        graphs, engine, warm-up; the servicer names the stage until the engine is attached."""
        servicer.stage = "loading the drafter"
        drafter = await bootstrap.stage(make_drafter, config, hooks.random_weights)
        servicer.stage = "building the KV cache and attention backend"
        await bootstrap.stage(drafter.init_backend)
        servicer.stage = "capturing CUDA graphs"
        await bootstrap.stage(drafter.capture_cuda_graphs)   # before SERVING: readiness waits
        engine = DraftEngine(drafter, config)
        engine.start()
        servicer.stage = "warming up"
        try:
            await engine.on_engine_thread(drafter.calibrate_cpu_gemm)   # --cpu-gemm auto, CPU
            await warmup(engine, drafter, hooks.warmup_delay_s)
            servicer.propose_cost = await propose_calibration.calibrate(engine, drafter)
        except BaseException:
            engine.stop()
            raise
        servicer.engine, servicer.stage = engine, "ready"
        log.info("serving", extra={"drafter": drafter.facts.kind, "model": drafter.facts.model_id})
        return engine

    return bootstrap.ModelService(
        role="draft", service_name=draft_servicer.SERVICE_NAME,
        metrics_model=metrics_name(config), servicer=servicer,
        register=lambda server: draft_servicer.add_to_server(servicer, server),
        refuse_while_draining=_starts_sequence, start=start,
        socket_methods={"Propose": SocketMethod(servicer.ProposeStream,
                                                draft_pb2.ProposeStreamRequest)})


def _starts_sequence(method: str, request) -> bool:
    """Draining: no new sequences (a Propose from position 0); the others go on until released."""
    return method == "Propose" and len(request.positions) > 0 and request.positions[0] == 0


def main(argv: list[str] | None = None, hooks: ServiceHooks = NO_HOOKS) -> int:
    """hooks: tests and benchmarks only (dflash/harness.py); a deployment never sets them."""
    return bootstrap.run("draft", argv, parse_args, lambda args: service(args, hooks))


if __name__ == "__main__":
    raise SystemExit(main())
