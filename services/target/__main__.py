"""python -m services.target --model DIR --port P [...]: the target-model gRPC service."""
from __future__ import annotations

import argparse
import asyncio
import logging
import time

import torch

from dflash.v1 import target_pb2
from runtime import tensor_parallel
from runtime.config import default_model_id, read_config_json
from runtime.layers import scan_kernels
from runtime.models.dense import DenseDecoder
from runtime.models.registry import model_class
from runtime.sampling import SamplingConfig
from services.common import bootstrap, flags
from services.common.call_socket import SocketMethod
from services.common.service_flags import add_model_service_flags, check_server_tls
from services.target import cost_calibration
from services.target import servicer as target_servicer
from services.target.config import TargetConfig
from services.target.engine import PrefillCall, TargetEngine
from services.target.hooks import NO_TARGET_HOOKS, TargetHooks
from services.target.ranks import TensorParallelRanks
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
    flags.add(p, "--graph-prefill-sizes", "32,64,128,256,512", _int_list, "prompt chunks "
              "captured as graphs for one sequence: a lone chunk is padded to the smallest that "
              "holds it (sizes above --token-budget are not captured; empty: none)")
    flags.add(p, "--mixed-batches", action="store_true", help="prompt chunks share forwards "
              "with verifies even where CUDA graphs are captured (without it they take turns, "
              "each forward a graph replay; a mixed batch runs eagerly)")
    flags.add(p, "--prompt-batch", 1, int, "without --mixed-batches where graphs are captured: "
              "at most this many sequences' prompt chunks in one prompts' forward (1: a lone "
              "chunk, a graph replay; more: the prompts waiting together in one eager forward)")
    flags.add(p, "--graph-capture-layers", "", _int_list,
              "feature layers the graphed verify returns (the drafter's target_layer_ids)")
    flags.add(p, "--verify-state-slots", -1, int, "hybrid models: sequences that can verify blocks "
              "of 2+ tokens (intermediate states; -1 = --state-slots)")
    flags.add(p, "--feature-plane", "auto", str, "where features of committed positions are "
              "published for the draft instead of sent through the gateway: auto (cuda-ipc on "
              "CUDA, shm, and stream; the gateway takes the first the draft reaches) | shm (this "
              "host) | cuda-ipc (this GPU) | stream (pushed to a draft on another host over "
              "Target.FeatureStream) | off (always in messages)")
    flags.add(p, "--cost-calibration-s", 1.5, float, "start-up seconds at most spent measuring the "
              "verify time by batch size, reported in the capabilities for the gateway's "
              "--speculation auto (0 = off: the gateway then uses fixed speculation)")
    flags.add(p, "--feature-plane-mib", 512, int, "size of each feature plane (full: features "
              "go in messages)")
    flags.add(p, "--kv-cache-dtype", "auto", str, "auto | fp8_e4m3: KV pages in the model's dtype, "
              "or float8 e4m3 with per-layer scales from the checkpoint's k_scale / v_scale "
              "(else 1.0): half the bytes of bf16 (attention backends: torch, triton)")
    flags.add(p, "--prefix-state-checkpoints", 16, int, "hybrid models with prefix caching: "
              "recurrent states kept at page boundaries of cached prefixes (each the size of "
              "one sequence's state, within --kv-budget); 0 = none, prefix caching off for them")
    flags.add(p, "--tensor-parallel-size", 1, int, "split the model's attention heads and MLP "
              "columns over this many ranks of this host (processes: NCCL on GPUs 0..N-1, gloo "
              "on the CPU, each rank a share of the cores); dense Llama / Qwen2 / Qwen3 only")
    flags.add(p, "--linear-attention-kernels", "auto", str, "hybrid targets' recurrent layers "
              "(Gated DeltaNet, Mamba2): prefill and decode kernels - auto (fla on CUDA where "
              "the fla-core package imports, else torch) | torch | fla (flash-linear-attention's "
              "Triton kernels; CUDA only). Verify blocks always run our closed forms")
    args = p.parse_args(argv)
    if not args.model:
        p.error("--model (or DFLASH_MODEL) is required")
    check_server_tls(p, args)
    return args


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).split(",") if x.strip())


def config_from_args(args: argparse.Namespace) -> TargetConfig:
    return TargetConfig(
        model_dir=args.model, device=args.device, dtype=args.dtype,
        attention_backend=args.attention_backend, kv_budget_bytes=args.kv_budget,
        kv_cache_dtype=args.kv_cache_dtype, page_size=args.page_size, max_context=args.max_context,
        max_block_size=args.max_block_size, max_tree_nodes=args.max_tree_nodes,
        token_budget=args.token_budget, lease_seconds=args.lease_seconds,
        state_slots=args.state_slots, model_id=args.model_id,
        cuda_graphs=not args.no_cuda_graphs, graph_block_sizes=args.graph_block_sizes,
        graph_tree_sizes=args.graph_tree_sizes, graph_prefill_sizes=args.graph_prefill_sizes,
        mixed_batches=args.mixed_batches, prompt_batch=args.prompt_batch,
        graph_capture_layers=args.graph_capture_layers,
        verify_state_slots=args.verify_state_slots, cpu_gemm=args.cpu_gemm,
        feature_plane=args.feature_plane, feature_plane_mib=args.feature_plane_mib,
        cost_calibration_s=args.cost_calibration_s, prefix_caching=args.enable_prefix_caching,
        prefix_cache_max_pages=args.prefix_cache_max_pages,
        prefix_state_checkpoints=args.prefix_state_checkpoints,
        tensor_parallel_size=args.tensor_parallel_size,
        linear_attention_kernels=args.linear_attention_kernels, deterministic=args.deterministic)


async def warmup(engine: TargetEngine, worker: TargetWorker) -> None:
    """A real prefill and a verify of the largest block that fits (max context and KV pool)
    through the engine, then release (and the hooks' extra delay: start-up tests)."""
    t0 = time.monotonic()
    room = min(worker.facts.max_context, worker.kv_cache.usable_pages * worker.config.page_size)
    block = max(1, min(worker.config.max_block_size, room // 2))
    n = max(1, min(8, room - block))
    layers = tuple(range(min(2, worker.facts.num_layers)))
    bos = worker.facts.bos_token_id
    await engine.prefill(PrefillCall("__warmup__", [bos] * n, SamplingConfig(), layers,
                                     torch.bfloat16))
    await engine.verify("__warmup__", [bos] * block)
    await engine.release("__warmup__")
    await asyncio.sleep(worker.hooks.warmup_delay_s)
    log.info("warm-up done", extra={"seconds": round(time.monotonic() - t0, 2)})


def service(args: argparse.Namespace, hooks: TargetHooks) -> bootstrap.ModelService:
    config = config_from_args(args)
    check_tensor_parallel(config)
    scan_kernels.select(config.linear_attention_kernels, config.device)   # fla: CUDA + fla-core
    servicer = target_servicer.TargetServicer()

    async def start() -> TargetEngine:
        """The start-up order (docs/architecture.md §7): (tensor-parallel ranks,) weights,
        memory pools, attention backends (every rank's), engine (and the CPU GEMM measured on
        its thread), CUDA graphs, warm-up; the servicer names the stage reached until the
        worker is ready."""
        ranks = None
        if config.tensor_parallel_size > 1:
            ranks = await bootstrap.stage(TensorParallelRanks.launch, config, hooks)
        servicer.worker = worker = await bootstrap.stage(TargetWorker, config, hooks)
        worker.ranks = ranks
        await bootstrap.stage(worker.alloc_memory_pools)
        await bootstrap.stage(worker.init_attention_backends)
        if ranks is not None:
            await bootstrap.stage(ranks.wait_ready, worker.kv_cache.usable_pages)
            ranks.watch()
        servicer.engine = engine = TargetEngine(worker)
        engine.start()
        await engine.on_engine_thread(worker.calibrate_cpu_gemm)   # --cpu-gemm auto, CPU
        await bootstrap.stage(worker.capture_cuda_graphs)      # before SERVING: readiness waits
        await warmup(engine, worker)
        worker.verify_cost = await cost_calibration.calibrate(engine, worker,
                                                              config.cost_calibration_s)
        # what warm-up and calibration cached is nobody's prefix
        await engine.on_engine_thread(worker.kv_cache.clear_prefix_cache)
        worker.mark_ready()
        return engine

    return bootstrap.ModelService(
        role="target", service_name=target_servicer.SERVICE_NAME,
        metrics_model=config.model_id or default_model_id(config.model_dir), servicer=servicer,
        register=lambda server: target_servicer.add_to_server(servicer, server),
        # draining: no new sequences (Prefill); Verify and Release go on until none is left
        refuse_while_draining=lambda method, request: method == "Prefill", start=start,
        socket_methods={"Verify": SocketMethod(servicer.VerifyStream,
                                               target_pb2.VerifyStreamRequest)})


def check_tensor_parallel(config: TargetConfig) -> None:
    """--tensor-parallel-size against the model before anything starts: a size that does not
    divide its heads, a model that cannot be split, more ranks than GPUs -> ValueError (the
    service exits refusing, saying what is allowed)."""
    n = config.tensor_parallel_size
    if n == 1:
        return
    raw = read_config_json(config.model_dir)
    cls, cfg = model_class(raw)
    tensor_parallel.shard_config(cfg, n, dense=cls is DenseDecoder,
                                 model_type=raw.get("model_type", ""))
    if config.device.startswith("cuda") and n > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {n} needs {n} GPUs; this host has "
                         f"{torch.cuda.device_count()}")
    if config.device not in ("cpu", "cuda"):
        raise ValueError(f"--tensor-parallel-size {n} places rank r on cuda:r: pass --device "
                         f"cuda, not {config.device}")


def main(argv: list[str] | None = None, hooks: TargetHooks = NO_TARGET_HOOKS) -> int:
    """hooks: tests and benchmarks only (dflash/harness.py); a deployment never sets them."""
    return bootstrap.run("target", argv, parse_args, lambda args: service(args, hooks))


if __name__ == "__main__":
    raise SystemExit(main())
