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

from runtime import threads
from runtime.config import default_model_id
from services.common import flags, metrics, tls
from services.common.guard import Drain
from services.common.logs import setup_logging
from services.common.metrics_server import start_metrics
from services.common.server import (
    MiB,
    Readiness,
    build_server,
    install_stop_signals,
    serve_until_stopped,
)
from services.common.service_flags import add_model_service_flags
from services.draft import servicer as draft_servicer
from services.draft.config import DraftConfig
from services.draft.drafter import DRAFTERS, Drafter, DrafterRefused, make_drafter
from services.draft.engine import DraftEngine, ProposeCall

log = logging.getLogger("dflash.draft")

EXIT_REFUSED = 2
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
    flags.add(p, "--block-size", 8, int, "prompt lookup: the block size it advertises")
    flags.add(p, "--max-ngram", 4, int, "prompt lookup: longest suffix n-gram matched")
    flags.add(p, "--min-ngram", 1, int, "prompt lookup: shortest suffix n-gram matched")
    flags.add(p, "--feature-dtype", "bfloat16", str, "dtype Propose features arrive in")
    args = p.parse_args(argv)
    if not args.target_model:
        p.error("--target-model (or DFLASH_TARGET_MODEL) is required")
    if args.drafter == "dflash" and not args.model:
        p.error("--model (or DFLASH_MODEL) is required for --drafter dflash")
    try:
        tls.check_readable(tls.server_from_args(args))
    except tls.TlsConfigError as e:
        p.error(str(e))
    return args


def config_from_args(args: argparse.Namespace) -> DraftConfig:
    return DraftConfig(
        target_dir=args.target_model, model_dir=args.model, drafter=args.drafter,
        device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
        kv_budget_bytes=args.kv_budget, page_size=args.page_size,
        max_block_size=args.max_block_size, max_tree_nodes=args.max_tree_nodes,
        block_size=args.block_size,
        max_ngram=args.max_ngram, min_ngram=args.min_ngram, token_budget=args.token_budget,
        lease_seconds=args.lease_seconds, feature_dtype=args.feature_dtype,
        model_id=args.model_id, warmup_delay_s=args.warmup_delay,
        cuda_graphs=not args.no_cuda_graphs, cpu_gemm=args.cpu_gemm)


def metrics_name(config: DraftConfig) -> str:
    if config.model_id:
        return config.model_id
    if config.drafter == "dflash":
        return default_model_id(config.model_dir)
    return f"{config.drafter}:{default_model_id(config.target_dir)}"


async def warmup(engine: DraftEngine, drafter: Drafter, config: DraftConfig) -> None:
    """A real append of a few context rows and a propose of the largest block, then release."""
    t0 = time.monotonic()
    f = drafter.facts
    n = 4
    features = (torch.zeros(n, f.feature_width, dtype=getattr(torch, f.feature_dtype))
                if f.needs_features else None)
    await engine.propose(ProposeCall(WARMUP_ID, 0, n, features, [0] * n, 0, f.max_block_size))
    await engine.release(WARMUP_ID)
    if config.warmup_delay_s:
        await asyncio.sleep(config.warmup_delay_s)
    log.info("warm-up done", extra={"seconds": round(time.monotonic() - t0, 2)})


async def start_engine(servicer: draft_servicer.DraftServicer, config: DraftConfig) -> DraftEngine:
    servicer.stage = "loading the drafter"
    drafter = await asyncio.to_thread(threads.serially, make_drafter, config)
    servicer.stage = "building the KV cache and attention backend"
    await asyncio.to_thread(threads.serially, drafter.init_backend)
    servicer.stage = "capturing CUDA graphs"
    await asyncio.to_thread(threads.serially, drafter.capture_cuda_graphs)     # before SERVING: readiness waits
    engine = DraftEngine(drafter, config)
    engine.start()
    servicer.stage = "warming up"
    try:
        await warmup(engine, drafter, config)
    except BaseException:
        engine.stop()
        raise
    return engine


async def serve(args: argparse.Namespace, config: DraftConfig) -> int:
    metrics.init(metrics_name(config), "draft")
    readiness = Readiness(draft_servicer.SERVICE_NAME)
    await readiness.start()
    servicer = draft_servicer.DraftServicer(config.lease_seconds)
    # draining: no new sequences (a Propose from position 0); the others go on until released
    drain = Drain(args.drain_grace, idle=lambda: not _live_sequences(servicer),
                  refuse=_starts_sequence)
    server = build_server(args.port, args.host, args.max_message_mib * MiB, readiness,
                          lambda s: draft_servicer.add_to_server(servicer, s),
                          tls=tls.server_from_args(args), drain=drain)
    await server.start()
    log.info("listening (NOT_SERVING until ready)", extra={"port": args.port})
    stop = asyncio.Event()
    install_stop_signals(stop)
    start_metrics(args.metrics_port)
    try:
        engine = await start_engine(servicer, config)
    except DrafterRefused as e:
        log.error("refusing to serve: %s", e)
        await server.stop(0)
        return EXIT_REFUSED
    servicer.engine, servicer.stage = engine, "ready"
    await readiness.set(True)
    log.info("serving", extra={"drafter": engine.drafter.facts.kind,
                               "model": engine.drafter.facts.model_id})
    try:
        await serve_until_stopped(server, readiness, stop, drain)
    finally:
        engine.stop()
    return 0


def _live_sequences(servicer: draft_servicer.DraftServicer) -> int:
    engine = servicer.engine
    return len(engine.seqs) if engine is not None else 0


def _starts_sequence(method: str, request) -> bool:
    return method == "Propose" and len(request.positions) > 0 and request.positions[0] == 0


def main(argv: list[str] | None = None) -> int:
    threads.serial()            # only the engine thread computes in parallel (runtime/threads.py)
    args = parse_args(argv)
    setup_logging(args.log_level, "draft")
    try:
        config = config_from_args(args)
    except ValueError as e:
        log.error("bad configuration: %s", e)
        return EXIT_REFUSED
    return asyncio.run(serve(args, config))


if __name__ == "__main__":
    raise SystemExit(main())
