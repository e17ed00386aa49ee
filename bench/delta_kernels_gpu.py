"""python -m bench.delta_kernels_gpu [--out DIR/delta_kernels_gpu.json] [--tiny]: the Gated
DeltaNet delta rule at one Qwen3.5-9B linear-attention layer's shape (32 value heads, 16 key
heads repeated, 128 x 128 state per head), our torch forms against fla-core's Triton kernels
(runtime/layers/delta_kernels.py) on one GPU - issue 41, part 4 ("GPU kernels from a
maintained library").

For prefill (the chunked form; b sequences of L tokens from a random state) and one-token
decode steps: each kernel's output and final state against the torch form in fp32 (max abs
difference, relative to the reference's max), and the median time of a call (CUDA events).
fla runs with q/k/v in bf16 (as the model calls it) and in fp32. Verify blocks keep every
position's state and always run the torch closed form (delta_block): timed for reference.
--tiny: small shapes on the CPU, torch only (a smoke test; fla is recorded as skipped).
Results of the lent GPU: bench/results/gpu/session35/delta_kernels_gpu.json."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.layers.delta_kernels import KERNELS, DeltaKernels, fla_importable
from runtime.layers.gated_deltanet import delta_block, l2_normalize

FULL = {"nv": 32, "dk": 128, "dv": 128, "prefill": [(1, 512), (1, 4096), (8, 512)],
        "decode": [1, 8, 32], "verify": [(1, 16), (8, 16), (32, 16)]}
TINY = {"nv": 4, "dk": 16, "dv": 16, "prefill": [(1, 70), (2, 16)], "decode": [1, 2],
        "verify": [(2, 4)]}


def inputs(b: int, L: int, nv: int, dk: int, dv: int, device: str, seed: int = 0):
    """Random layer inputs as GatedDeltaNet.scan prepares them (fp32)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(device)
    q = l2_normalize(r(b, L, nv, dk)) * dk ** -0.5
    k = l2_normalize(r(b, L, nv, dk))
    v = r(b, L, nv, dv)
    g = -F.softplus(r(b, L, nv)) * 0.5          # log decay < 0
    beta = r(b, L, nv).sigmoid()
    S = r(b, nv, dk, dv) * 0.1
    return S, q, k, v, g, beta


def timed(fn, device: str, reps: int) -> float:
    """Median ms of fn() over reps calls after two warm-ups."""
    fn(), fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def fla_bf16() -> DeltaKernels:
    """fla with q, k, v and beta in bf16 (as transformers calls it), the state fp32: the
    variant the target does not use, measured beside it."""
    fla = KERNELS["fla"]()

    def bf16(q, k, v, g, beta):
        return (*(x.to(torch.bfloat16) for x in (q, k, v)), g, beta.to(torch.bfloat16))

    def chunked(S, q, k, v, g, beta, chunk):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        o, S = chunk_gated_delta_rule(*bf16(q, k, v, g, beta), scale=1.0, initial_state=S,
                                      output_final_state=True)
        return o.float(), S

    def step(S, q, k, v, g, beta):
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        q, k, v, g, beta = bf16(q, k, v, g, beta)
        o, S = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=1.0,
                                                initial_state=S, output_final_state=True)
        return o.float(), S
    return DeltaKernels(f"{fla.name} bf16", chunked, step)


def compare(kind: str, b: int, L: int, shape: dict, device: str, kernels: dict, reps: int
            ) -> list[dict]:
    """One case: every kernel variant against the torch form (the first in kernels)."""
    args = inputs(b, L, shape["nv"], shape["dk"], shape["dv"], device)
    ref_o = ref_S = None
    rows = []
    for label, k in kernels.items():
        call = partial(k.chunked, *args, 64) if kind == "prefill" else partial(k.step, *args)
        o, S = call()
        if ref_o is None:
            ref_o, ref_S = o, S
        rows.append({"kind": kind, "batch": b, "tokens": L, "kernel": label,
                     "ms": round(timed(call, device, reps), 4),
                     "out_rel_err": rel_err(o, ref_o), "state_rel_err": rel_err(S, ref_S)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    from bench.tiny import NO_CUDA, add_tiny_flag, tiny_fields, tiny_outputs
    ap = argparse.ArgumentParser(prog="python -m bench.delta_kernels_gpu", description=__doc__)
    ap.add_argument("--out", default="bench/results/gpu/delta_kernels_gpu.json")
    ap.add_argument("--reps", type=int, default=20)
    add_tiny_flag(ap)
    a = ap.parse_args()
    tiny_outputs(a, ap, "delta_kernels_gpu", ("out",))
    shape, device = (TINY, "cpu") if a.tiny else (FULL, "cuda")
    kernels = {"torch fp32": KERNELS["torch"]()}
    why = fla_importable() if device == "cuda" else "not on a CUDA device"
    if why is None:
        kernels |= {"fla bf16": fla_bf16(), "fla fp32": KERNELS["fla"]()}
    rows = []
    for b, L in shape["prefill"]:
        rows += compare("prefill", b, L, shape, device, kernels, a.reps)
    for b in shape["decode"]:
        rows += compare("decode", b, 1, shape, device, kernels, a.reps)
    for b, L in shape["verify"]:
        args = inputs(b, L, shape["nv"], shape["dk"], shape["dv"], device)
        mask = torch.ones(L, L, dtype=torch.bool, device=device).tril().expand(b, L, L)
        ms = timed(partial(delta_block, *args, mask), device, a.reps)
        rows.append({"kind": "verify (every position's state)", "batch": b, "tokens": L,
                     "kernel": "torch fp32", "ms": round(ms, 4)})
        print(json.dumps(rows[-1]), flush=True)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "shape": {k: shape[k] for k in ("nv", "dk", "dv")},
            "fla": why or "imported"}
    try:
        import fla
        meta["fla_version"] = getattr(fla, "__version__", "?")
    except ImportError:
        pass
    report = {"meta": meta, "rows": rows,
              **(tiny_fields({"fla": NO_CUDA, "cuda_events": NO_CUDA}) if a.tiny else {})}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
