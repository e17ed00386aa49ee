"""python -m services.target --model DIR --port P [...]: the target-model gRPC service."""
from __future__ import annotations

import argparse
import asyncio
import logging
import time

from runtime import threads
from runtime.config import default_model_id
from runtime.sampling import SamplingConfig
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
from services.target import servicer as target_servicer
from services.target.config import TargetConfig
from services.target.engine import PrefillCall, TargetEngine
from services.target.worker import TargetWorker

log = logging.getLogger("dflash.target")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m services.target", description=__doc__)
    flags.add(p, "--model", help="HF-format model directory (config.json + safetensors)")
    add_model_service_flags(
        p, port=50051, kv_budget="1GiB", kv_help="memory for KV pages (and state pool)",
        token_budget=512, token_help="tokens per engine iteration (chunked prefill)",
        drain_help="SIGTERM: seconds for the sequences it holds to finish (new Prefills are "
                   "refused meanwhile) before it exits")
    flags.add(p, "--max-context", 0, int, "max tokens per sequence (0 = the model's)")
    flags.add(p, "--max-block-size", 32, int, "largest verify block (anchor + drafts)")
    flags.add(p, "--max-tree-nodes", 255, int, "most draft nodes in a tree Verify (greedy "
              "sequences; 0 = chains only; at most --token-budget - 1)")
    flags.add(p, "--state-slots", 64, int, "hybrid models: sequences the recurrent state pool holds")
    flags.add(p, "--graph-block-sizes", "1,16", _int_list, "verify block sizes captured as graphs")
    flags.add(p, "--graph-tree-sizes", "16,64", _int_list, "tree verifies (anchor + drafts) "
              "captured as graphs (trees of other sizes run eagerly)")
    flags.add(p, "--graph-capture-layers", "", _int_list,
              "feature layers the graphed verify returns (the drafter's target_layer_ids)")
    flags.add(p, "--hybrid-wrapper", action="store_true", help="wrap the backend in the hybrid wrapper")
    flags.add(p, "--no-mamba-commit", action="store_true",
              help="testing: build a hybrid backend that cannot commit recurrent state")
    flags.add(p, "--verify-state-slots", -1, int, "hybrid models: sequences that can verify blocks "
              "of 2+ tokens (intermediate states; -1 = --state-slots)")
    flags.add(p, "--unsafe-skip-mamba-commit", action="store_true",
              help="TESTING ONLY, wrong output: advertise the mamba verify commit but skip it")
    args = p.parse_args(argv)
    if not args.model:
        p.error("--model (or DFLASH_MODEL) is required")
    try:
        tls.check_readable(tls.server_from_args(args))
    except tls.TlsConfigError as e:
        p.error(str(e))
    return args


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).split(",") if x.strip())


def config_from_args(args: argparse.Namespace) -> TargetConfig:
    return TargetConfig(
        model_dir=args.model, device=args.device, dtype=args.dtype,
        attention_backend=args.attention_backend, kv_budget_bytes=args.kv_budget,
        page_size=args.page_size, max_context=args.max_context,
        max_block_size=args.max_block_size, max_tree_nodes=args.max_tree_nodes,
        token_budget=args.token_budget, lease_seconds=args.lease_seconds, state_slots=args.state_slots, model_id=args.model_id,
        warmup_delay_s=args.warmup_delay, hybrid_wrapper=args.hybrid_wrapper,
        cuda_graphs=not args.no_cuda_graphs, graph_block_sizes=args.graph_block_sizes,
        graph_tree_sizes=args.graph_tree_sizes,
        graph_capture_layers=args.graph_capture_layers,
        mamba_commit=not args.no_mamba_commit, verify_state_slots=args.verify_state_slots,
        unsafe_skip_mamba_commit=args.unsafe_skip_mamba_commit, cpu_gemm=args.cpu_gemm)


async def warmup(engine: TargetEngine, worker: TargetWorker) -> None:
    """A real prefill and a verify of the largest block that fits (max context and KV pool)
    through the engine, then release."""
    t0 = time.monotonic()
    room = min(worker.facts.max_context, worker.kv_cache.usable_pages * worker.config.page_size)
    block = max(1, min(worker.config.max_block_size, room // 2))
    n = max(1, min(8, room - block))
    layers = tuple(range(min(2, worker.facts.num_layers)))
    bos = worker.facts.bos_token_id
    import torch
    await engine.prefill(PrefillCall("__warmup__", [bos] * n, SamplingConfig(), layers,
                                     torch.bfloat16))
    await engine.verify("__warmup__", [bos] * block)
    await engine.release("__warmup__")
    if worker.config.warmup_delay_s:
        await asyncio.sleep(worker.config.warmup_delay_s)
    log.info("warm-up done", extra={"seconds": round(time.monotonic() - t0, 2)})


async def serve(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    metrics.init(config.model_id or default_model_id(config.model_dir), "target")
    readiness = Readiness(target_servicer.SERVICE_NAME)
    await readiness.start()
    servicer = target_servicer.TargetServicer()
    # draining: no new sequences (Prefill); Verify and Release go on until none is left
    drain = Drain(args.drain_grace, idle=lambda: not _live_sequences(servicer),
                  refuse=lambda method, request: method == "Prefill")
    server = build_server(args.port, args.host, args.max_message_mib * MiB, readiness,
                          lambda s: target_servicer.add_to_server(servicer, s),
                          tls=tls.server_from_args(args), drain=drain)
    await server.start()
    log.info("listening (NOT_SERVING until ready)", extra={"port": args.port})
    stop = asyncio.Event()
    install_stop_signals(stop)
    start_metrics(args.metrics_port)
    worker = await asyncio.to_thread(threads.serially, TargetWorker, config)
    servicer.worker = worker
    await asyncio.to_thread(threads.serially, worker.alloc_memory_pools)
    await asyncio.to_thread(threads.serially, worker.init_attention_backends)
    engine = TargetEngine(worker)
    engine.start()
    servicer.engine = engine
    await asyncio.to_thread(threads.serially, worker.capture_cuda_graphs)   # before SERVING: readiness waits
    await warmup(engine, worker)
    worker.mark_ready()
    await readiness.set(True)
    try:
        await serve_until_stopped(server, readiness, stop, drain)
    finally:
        engine.stop()


def _live_sequences(servicer: target_servicer.TargetServicer) -> int:
    engine = servicer.engine
    return len(engine.seqs) if engine is not None else 0


def main(argv: list[str] | None = None) -> None:
    threads.serial()            # only the engine thread computes in parallel (runtime/threads.py)
    args = parse_args(argv)
    setup_logging(args.log_level, "target")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
