"""python -m bench.hybrid_gpu [--out DIR/hybrid_gpu.json]: the verify step of a Qwen3.5-9B-shaped
hybrid target (Gated DeltaNet + gated attention; random bf16 weights) against the dense
Qwen3-8B shape, in-process on one GPU - issue 41's "cost of keeping per-position states".

Each model is loaded alone (TargetWorker, triton attention; the dense one with its verify CUDA
graphs, the hybrid eagerly: its recurrent layers have no graphs), a batch of 1, 8 or 32
sequences prefilled with 512 random tokens, then a verify block of 1 or 16 tokens timed (forward
+ logits of every row + the state commit or the KV trim), as bench.hybrid_cpu does on the CPU.
The hybrid's verify of 16 keeps the recurrent state after every row (the state pool: live + 16
states per sequence). --tiny: CPU-sized shapes of both on the CPU (a smoke test)."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from bench.h200_micro import QWEN3_5_9B, QWEN3_8B, TINY, tiny_hybrid
from bench.hybrid_cpu import VerifyRun
from services.target.config import TargetConfig
from services.target.hooks import TargetHooks
from services.target.worker import TargetWorker

SHAPES = {"qwen3.5-9b (hybrid)": QWEN3_5_9B, "qwen3-8b (dense)": QWEN3_8B}
BLOCKS, BATCHES = (1, 16), (1, 8, 32)


def load(model_dir: Path, device: str, block: int, slots: int, kv: int) -> TargetWorker:
    cfg = TargetConfig(model_dir=str(model_dir), device=device,
                       dtype="bfloat16" if device == "cuda" else "float32",
                       attention_backend="triton" if device == "cuda" else "torch",
                       kv_budget_bytes=kv, state_slots=slots, max_block_size=block,
                       graph_capture_layers=(), prefix_caching=False)
    worker = TargetWorker.started(cfg, TargetHooks(random_weights=True))
    worker.capture_cuda_graphs()        # no-op for the hybrid (eager) and on the CPU
    return worker


def measure(worker: TargetWorker, batch: int, block: int, prompt_len: int, repeats: int) -> dict:
    run = VerifyRun(worker, batch, block, prompt_len)
    try:
        times = [run.step() for _ in range(repeats + 3)][3:]
    finally:
        run.close()
    ms = 1e3 * statistics.median(times)
    return {"batch": batch, "block": block, "median_ms": round(ms, 3),
            "min_ms": round(1e3 * min(times), 3),
            "tokens_per_s_if_all_accepted": round(batch * block / ms * 1e3, 1)}


def run(args: argparse.Namespace) -> dict:
    shapes = ({f"{k} tiny": tiny_hybrid(v) if "hybrid" in k else TINY for k, v in SHAPES.items()}
              if args.tiny else SHAPES)
    rows, pools = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in shapes.items():
            d = Path(tmp) / name.split()[0]
            d.mkdir()
            (d / "config.json").write_text(json.dumps(cfg))
            for block in args.blocks:
                worker = load(d, args.device, block, max(args.batches), args.kv_bytes)
                if worker.state_pool is not None:
                    pools[f"{name} block {block}"] = worker.state_pool.nbytes
                for batch in args.batches:
                    rows.append({"model": name, **measure(worker, batch, block,
                                                           args.prompt_len, args.repeats)})
                    print(json.dumps(rows[-1]), flush=True)
                del worker
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "prompt_len": args.prompt_len, "repeats": args.repeats,
            "state_pool_bytes": pools, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hybrid_gpu", description=__doc__)
    p.add_argument("--out", default="bench/results/gpu/hybrid_gpu.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--kv-bytes", type=int, default=30 << 30)
    from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs
    add_tiny_flag(p)
    args = p.parse_args(argv)
    tiny_outputs(args, p, "hybrid_gpu", ("out",))
    args.blocks, args.batches = BLOCKS, BATCHES
    if args.tiny:
        args.device, args.prompt_len, args.repeats, args.kv_bytes = "cpu", 32, 2, 256 << 20
        args.batches = (1, 2)
    report = run(args)
    if args.tiny:
        report.update(tiny_fields())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
