"""python -m bench.invariant_gemm_gpu [--out FILE.json] [--tiny]: the batch-invariant GEMM of
--deterministic (runtime/layers/invariant_gemm.py) against cuBLAS (F.linear) on one GPU, bf16,
at the weight shapes of a Qwen3-8B-shaped and a SmolLM2-135M target and the row counts serving
meets (1: a decode step, 16: a verify block, 64 to 512: batches of them) - issue 38's cost.

For every shape and row count: the median ms of cuBLAS, of the shipped tile (`tile_for`, which
on a GPU may follow the row count) and of other tiles, K splits and TMA loads (candidates for
`tile_for`); each tile's largest difference from cuBLAS; whether each tile's rows are bitwise
the same computed alone (1 row), in a block of 16 and in the largest batch ("invariant"); and
whether the tiles without a K split agree bitwise with one another at every row count ("family":
what lets `tile_for` follow the row count). The per-model sums weight each shape by its layers
(the LM head once). --tiny: small shapes on the CPU through Triton's interpreter (a smoke test)."""
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
ROWS, TINY_ROWS = (1, 16, 64, 128, 256, 384, 512), (1, 16, 40)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, K splits, TMA)
CANDIDATES = [(64, 64, 128, 4, 3, 1, False), (64, 64, 64, 4, 4, 1, True),
              (64, 128, 64, 4, 3, 1, False), (64, 128, 64, 4, 3, 1, True),
              (128, 128, 64, 8, 3, 1, False), (128, 128, 64, 8, 3, 1, True),
              (128, 128, 64, 8, 4, 1, True), (128, 256, 64, 8, 3, 1, True),
              (128, 128, 64, 8, 3, 2, True), (64, 64, 128, 4, 3, 2, False)]
TINY_CANDIDATES = [(64, 64, 128, 4, 3, 1, False), (64, 64, 32, 4, 3, 2, False),
                   (32, 64, 32, 4, 3, 1, True)]


def run_tile(x, w, tile):
    """invariant_linear with a given tile instead of tile_for's."""
    from runtime.layers.invariant_gemm import launch
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    launch(x, w, None, y, tile)
    return y


def shape_rows(n: int, k: int, rows: tuple[int, ...], tiles: list, device: str, dtype) -> dict:
    from bench.h200_micro import timed
    from runtime.layers.invariant_gemm import Tile, tile_for
    gpu = device == "cuda"
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype)
    x = torch.randn(max(rows), k, generator=g).to(device, dtype)
    tiles = sorted({Tile(*t) for t in tiles} | {tile_for(n, k, m, gpu) for m in rows})
    out: dict = {"shipped_tile": {m: str(tile_for(n, k, m, gpu)) for m in rows}, "rows": {},
                 "errors": {}}
    iters = 3 if device == "cpu" else 20
    ys: dict = {}                                    # tile -> its full-batch output
    for tile in list(tiles):
        try:
            ys[tile] = run_tile(x, w, tile)
        except Exception as e:  # noqa: BLE001 - a tile this GPU or Triton cannot build: recorded
            out["errors"][str(tile)] = f"{type(e).__name__}: {e}"[:300]
            tiles.remove(tile)
    for m in rows:
        xm = x[:m].contiguous()
        ref = F.linear(xm, w)
        row = {"cublas_ms": timed(lambda xm=xm: F.linear(xm, w), device, 1, iters), "tiles": {},
               "shipped": str(tile_for(n, k, m, gpu))}
        if tile_for(n, k, m, gpu) not in ys:
            raise RuntimeError(f"the shipped tile {row['shipped']} fails: {out['errors']}")
        family = [t for t in tiles if t.splits == 1]
        first = run_tile(xm, w, family[0])
        row["family_agrees"] = all(torch.equal(run_tile(xm, w, t), first) for t in family)
        for tile in tiles:
            y = run_tile(xm, w, tile)
            row["tiles"][str(tile)] = {
                "ms": timed(lambda tile=tile, xm=xm: run_tile(xm, w, tile), device, 1, iters),
                "max_abs_diff_vs_cublas": float((y.float() - ref.float()).abs().max()),
                "rows_equal_full_batch": bool(torch.equal(y, ys[tile][:m]))}
        out["rows"][m] = row
    for tile in tiles:                     # rows alone / in a block of 16 / in the largest batch
        alone = torch.cat([run_tile(x[i:i + 1].contiguous(), w, tile) for i in range(16)])
        block = run_tile(x[:16].contiguous(), w, tile)
        out.setdefault("invariant", {})[str(tile)] = bool(
            torch.equal(alone, ys[tile][:16]) and torch.equal(block, ys[tile][:16]))
    # what --deterministic computes: each row count with its own tile, against the largest batch
    big = ys.get(tile_for(n, k, max(rows), gpu))
    out["shipped_invariant"] = big is not None and all(
        torch.equal(run_tile(x[:m].contiguous(), w, tile_for(n, k, m, gpu)), big[:m])
        for m in rows)
    return out


def _ms(row: dict, key: str) -> float:
    return row["cublas_ms"] if key == "cublas_ms" else row["tiles"][key]["ms"]


def model_sums(shapes: dict, results: dict, rows: tuple[int, ...], tiles: list[str]) -> dict:
    """Per row count: the forward's GEMM milliseconds (each shape times its layers) by cuBLAS,
    by the shipped tiles (tile_for per shape and row count), by the fastest tile per shape
    ("best") and by each candidate tile used for every shape."""
    sums = {}
    for m in rows:
        def total(key_of, m=m) -> float:
            return round(sum(_ms(results[name]["rows"][m], key_of(name)) * shapes[name][2]
                             for name in shapes), 3)
        best = {name: min(results[name]["rows"][m]["tiles"].items(), key=lambda t: t[1]["ms"])[0]
                for name in shapes}
        row = {"cublas_ms": total(lambda name: "cublas_ms"),
               "shipped_ms": total(lambda name, m=m: results[name]["rows"][m]["shipped"]),
               "best_ms": total(lambda name, best=best: best[name]), "best_tiles": best}
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
        from runtime.triton_interpreter import make_dots_row_independent
        make_dots_row_independent()                  # a row's dot not the host BLAS's
    from runtime.layers.invariant_gemm import has_tma
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
            tiles = TINY_CANDIDATES if args.tiny else [t for t in CANDIDATES
                                                        if not t[6] or has_tma()]
            results[name] = shape_rows(n, k, rows, tiles, device, dtype)
            r = results[name]
            print(json.dumps({model: name, "invariant": r["invariant"], "errors": r["errors"],
                              "shipped_invariant": r["shipped_invariant"],
                              "family_agrees": {m: row["family_agrees"]
                                                for m, row in r["rows"].items()}}), flush=True)
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
