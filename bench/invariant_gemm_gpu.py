"""python -m bench.invariant_gemm_gpu [--out FILE.json] [--tiny]: the batch-invariant GEMM of
--deterministic (runtime/layers/invariant_gemm.py) against cuBLAS (F.linear) on one GPU, bf16,
at the weight shapes of a Qwen3-8B-shaped and a SmolLM2-135M target and the row counts serving
meets (1: a decode step, 16: a verify block, 128 and 512: batches of them) - issue 38's cost.

For every shape and row count: the median ms of cuBLAS, of the shipped tile (`tile_for`) and of
a few other fixed tiles and K splits (candidates for `tile_for`: they may depend on the
weight's shape, never on the row count); whether each tile's rows are bitwise the same computed alone (1 row),
in a block of 16 and in a batch of 512; its largest difference from cuBLAS. The per-model sums
weight each shape by its layers (the LM head once). --tiny: small shapes on the CPU through
Triton's interpreter (a smoke test)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs

# name -> (N, K, times per forward)
MODELS = {
    "qwen3-8b": {"qkv": (6144, 4096, 36), "o": (4096, 4096, 36), "gate_up": (24576, 4096, 36),
                 "down": (4096, 12288, 36), "lm_head": (151936, 4096, 1)},
    "smollm2-135m": {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30),
                     "down": (576, 1536, 30), "lm_head": (49152, 576, 1)},
}
TINY_MODELS = {"tiny": {"qkv": (96, 64, 2), "lm_head": (200, 64, 1)}}
ROWS, TINY_ROWS = (1, 16, 128, 512), (1, 16, 40)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, K splits)
CANDIDATES = [(64, 64, 128, 4, 3, 1), (64, 128, 64, 4, 3, 1), (128, 128, 64, 8, 4, 1),
              (128, 128, 64, 8, 4, 2), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 3, 4)]
TINY_CANDIDATES = [(64, 64, 128, 4, 3, 1), (64, 64, 32, 4, 3, 2)]   # one with its K split


def run_tile(x, w, tile):
    """invariant_linear with a given tile instead of tile_for's."""
    from runtime.layers.invariant_gemm import launch
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    launch(x, w, None, y, tile)
    return y


def shape_rows(n: int, k: int, rows: tuple[int, ...], tiles: list, device: str, dtype) -> dict:
    from bench.h200_micro import timed
    from runtime.layers.invariant_gemm import tile_for
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype)
    x = torch.randn(max(rows), k, generator=g).to(device, dtype)
    out = {"shipped_tile": list(tile_for(n, k)), "rows": {}}
    iters = 3 if device == "cpu" else 20
    for m in rows:
        xm = x[:m].contiguous()
        ref = F.linear(xm, w)
        row = {"cublas_ms": timed(lambda xm=xm: F.linear(xm, w), device, 1, iters), "tiles": {}}
        for tile in tiles:
            y = run_tile(xm, w, tile)
            row["tiles"][",".join(map(str, tile))] = {
                "ms": timed(lambda tile=tile, xm=xm: run_tile(xm, w, tile), device, 1, iters),
                "max_abs_diff_vs_cublas": float((y.float() - ref.float()).abs().max())}
        out["rows"][m] = row
    for tile in tiles:                     # rows alone / in a block of 16 / in the largest batch
        full = run_tile(x, w, tile)
        alone = torch.cat([run_tile(x[i:i + 1].contiguous(), w, tile) for i in range(16)])
        block = run_tile(x[:16].contiguous(), w, tile)
        out.setdefault("invariant", {})[",".join(map(str, tile))] = bool(
            torch.equal(alone, full[:16]) and torch.equal(block, full[:16]))
    return out


def _ms(row: dict, key: str) -> float:
    return row["cublas_ms"] if key == "cublas_ms" else row["tiles"][key]["ms"]


def model_sums(shapes: dict, results: dict, rows: tuple[int, ...], tiles: list[str]) -> dict:
    """Per row count: the forward's GEMM milliseconds (each shape times its layers) by cuBLAS,
    by the shipped tiles (tile_for per shape) and by each candidate tile used for every shape."""
    sums = {}
    for m in rows:
        def total(key_of, m=m) -> float:
            return round(sum(_ms(results[name]["rows"][m], key_of(name)) * shapes[name][2]
                             for name in shapes), 3)
        row = {"cublas_ms": total(lambda name: "cublas_ms"),
               "shipped_ms": total(lambda name: ",".join(map(str, results[name]["shipped_tile"])))}
        row.update({tile: total(lambda name, tile=tile: tile) for tile in tiles})
        row["shipped_vs_cublas"] = round(row["shipped_ms"] / row["cublas_ms"], 3)
        sums[m] = row
    return sums


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp") + "/invariant_gemm_gpu.json")
    add_tiny_flag(ap)
    args = ap.parse_args(argv)
    tiny_outputs(args, ap, "invariant_gemm_gpu", ("out",))
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"         # before triton's first kernel is built
    from runtime.layers.invariant_gemm import tile_for
    models = TINY_MODELS if args.tiny else MODELS
    rows = TINY_ROWS if args.tiny else ROWS
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "dtype": str(dtype), "models": {}}
    if args.tiny:
        result.update(tiny_fields({"timings": "Triton's interpreter on the CPU, fp32"}))
    for model, shapes in models.items():
        results = {}
        for name, (n, k, _) in shapes.items():
            tiles = sorted({tile_for(n, k), *(TINY_CANDIDATES if args.tiny else CANDIDATES)})
            results[name] = shape_rows(n, k, rows, tiles, device, dtype)
            print(json.dumps({model: name, "invariant": results[name]["invariant"]}), flush=True)
        common = set.intersection(*(set(r["rows"][rows[0]]["tiles"]) for r in results.values()))
        result["models"][model] = {"shapes": {k: list(v) for k, v in shapes.items()},
                                   "results": results,
                                   "forward_gemm_ms": model_sums(shapes, results, rows,
                                                                 sorted(common))}
        print(json.dumps({model: result["models"][model]["forward_gemm_ms"]}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
