"""python -m bench.scan_kernels_gpu [--out FILE.json] [--tiny]: the recurrent layers' scans,
our torch forms against fla-core's Triton kernels (runtime/layers/scan_kernels.py) on one GPU -
issue 41, part 4 ("GPU kernels from a maintained library"):
  delta  the Gated DeltaNet delta rule at one Qwen3.5-9B linear-attention layer's shape (32 value
         heads, 16 key heads repeated, a 128 x 128 state per head);
  ssd    Mamba2's SSD (fla's simple GLA) at one Bamba-9B mamba layer's shape (128 heads of 64,
         state 128, one group repeated).

For prefill (the chunked form; b sequences of L tokens from a random state) and one-token
decode steps: each kernel's output and final state against the torch form in fp32 (max abs
difference, relative to the reference's max), and the median time of a call (CUDA events).
For the delta rule fla also runs with q/k/v in bf16 (as transformers calls it); for Mamba2's
decode step fla's recurrent simple GLA runs beside ours (the registry keeps ours: faster). Verify blocks
keep every position's state and always run our closed forms (delta_block, ssd_block): timed
for reference. --tiny: small shapes on the CPU, torch only (a smoke test; fla is recorded as
skipped). Results of the lent GPU: bench/results/gpu/session35/."""
from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.h200_micro import timed
from runtime.layers.gated_deltanet import delta_block, l2_normalize
from runtime.layers.mamba2 import ssd_block
from runtime.layers.scan_kernels import KERNELS, ScanKernels, fla_importable

CASES = {"prefill": [(1, 512), (1, 4096), (8, 512)], "decode": [1, 8, 32],
         "verify": [(1, 16), (8, 16), (32, 16)]}
TINY_CASES = {"prefill": [(1, 70), (2, 16)], "decode": [1, 2], "verify": [(2, 4)]}
SHAPES = {"delta": {"heads": 32, "dk": 128, "dv": 128}, "ssd": {"heads": 128, "dk": 128, "dv": 64}}
TINY_SHAPES = {"delta": {"heads": 4, "dk": 16, "dv": 16}, "ssd": {"heads": 4, "dk": 16, "dv": 8}}


def inputs(family: str, b: int, L: int, shape: dict, device: str, seed: int = 0) -> tuple:
    """Random layer inputs as the layers' scan() prepares them (fp32). delta: (S, q, k, v, g,
    beta); ssd: (h, x, dt, dA, B, C, D) with dk the state size N and dv the head size."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen).to(device)
    nh, dk, dv = shape["heads"], shape["dk"], shape["dv"]
    if family == "delta":
        q = l2_normalize(r(b, L, nh, dk)) * dk ** -0.5
        return (r(b, nh, dk, dv) * 0.1, q, l2_normalize(r(b, L, nh, dk)), r(b, L, nh, dv),
                -F.softplus(r(b, L, nh)) * 0.5, r(b, L, nh).sigmoid())
    dt = F.softplus(r(b, L, nh) - 2.0)
    return (r(b, nh, dv, dk) * 0.1, r(b, L, nh, dv), dt, -dt * 0.5, r(b, L, nh, dk) * 0.1,
            r(b, L, nh, dk) * 0.1, r(nh))


def call(family: str, kind: str, k: ScanKernels, args: tuple):
    """The registry entry for this family and kind, bound to args (None: the variant has
    none)."""
    fn = {("delta", "prefill"): k.delta_chunked, ("delta", "decode"): k.delta_step,
          ("ssd", "prefill"): k.ssd_chunked, ("ssd", "decode"): k.ssd_step}[family, kind]
    if fn is None:
        return None
    if family == "delta":
        return partial(fn, *args, 64) if kind == "prefill" else partial(fn, *args)
    if kind == "prefill":
        return partial(fn, *args, 256)
    h, x, dt, dA, B, C, D = args
    return partial(fn, h, x[:, 0], dt[:, 0], dA[:, 0], B[:, 0], C[:, 0], D)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def fla_recurrent_ssd() -> ScanKernels:
    """fla's recurrent simple GLA as Mamba2's one-token step: measured beside ours, which the
    registry keeps (it was faster at small batches)."""
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    def step(h, x, dt, dA, B, C, D):
        C, B, xdt, dA = (t[:, None].float().contiguous()
                         for t in (C, B, x * dt[..., None], dA))
        o, h = fused_recurrent_simple_gla(C, B, xdt, g=dA, scale=1.0,
                                          initial_state=h.contiguous(),
                                          output_final_state=True, state_v_first=True)
        return o[:, 0].float() + D[:, None] * x, h.float()
    return ScanKernels("fla recurrent", None, None, None, step)


def fla_bf16() -> ScanKernels:
    """fla's delta rule with q, k, v and beta in bf16 (as transformers calls it), the state
    fp32: the variant the target does not use, measured beside it (delta rule only)."""
    from fla.ops.gated_delta_rule import (
        chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule,
    )

    def bf16(q, k, v, g, beta):
        return (*(x.to(torch.bfloat16) for x in (q, k, v)), g, beta.to(torch.bfloat16))

    def chunked(S, q, k, v, g, beta, chunk):
        o, S = chunk_gated_delta_rule(*bf16(q, k, v, g, beta), scale=1.0, initial_state=S,
                                      output_final_state=True)
        return o.float(), S

    def step(S, q, k, v, g, beta):
        q, k, v, g, beta = bf16(q, k, v, g, beta)
        o, S = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=1.0,
                                                initial_state=S, output_final_state=True)
        return o.float(), S
    return ScanKernels("fla bf16", chunked, step, None, None)


def compare(family: str, kind: str, b: int, L: int, shape: dict, device: str, kernels: dict,
            reps: int) -> list[dict]:
    """One case: every kernel variant against the torch form (the first in kernels)."""
    args = inputs(family, b, L, shape, device)
    ref = None
    rows = []
    for label, k in kernels.items():
        fn = call(family, kind, k, args)
        if fn is None:
            continue
        out, state = fn()
        ref = ref or (out, state)
        rows.append({"family": family, "kind": kind, "batch": b, "tokens": L, "kernel": label,
                     "ms": round(timed(fn, device, iters=reps), 4),
                     "out_rel_err": rel_err(out, ref[0]), "state_rel_err": rel_err(state, ref[1])})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def verify_row(family: str, b: int, L: int, shape: dict, device: str, reps: int) -> dict:
    args = inputs(family, b, L, shape, device)
    if family == "delta":
        mask = torch.ones(L, L, dtype=torch.bool, device=device).tril().expand(b, L, L)
        fn = partial(delta_block, *args, mask)
    else:
        fn = partial(ssd_block, *args, keep_states=True)
    return {"family": family, "kind": "verify (every position's state)", "batch": b,
            "tokens": L, "kernel": "torch fp32", "ms": round(timed(fn, device, iters=reps), 4)}


def main() -> None:
    from bench.tiny import NO_CUDA, add_tiny_flag, tiny_fields, tiny_outputs
    ap = argparse.ArgumentParser(prog="python -m bench.scan_kernels_gpu", description=__doc__)
    ap.add_argument("--out", default="bench/results/gpu/scan_kernels_gpu.json")
    ap.add_argument("--reps", type=int, default=20)
    add_tiny_flag(ap)
    a = ap.parse_args()
    tiny_outputs(a, ap, "scan_kernels_gpu", ("out",))
    cases, shapes, device = ((TINY_CASES, TINY_SHAPES, "cpu") if a.tiny
                             else (CASES, SHAPES, "cuda"))
    kernels = {"torch fp32": KERNELS["torch"]()}
    why = fla_importable() if device == "cuda" else "not on a CUDA device"
    if why is None:
        kernels |= {"fla fp32": KERNELS["fla"](), "fla bf16": fla_bf16(),
                    "fla recurrent": fla_recurrent_ssd()}
    rows = []
    for family, shape in shapes.items():
        for b, L in cases["prefill"]:
            rows += compare(family, "prefill", b, L, shape, device, kernels, a.reps)
        for b in cases["decode"]:
            rows += compare(family, "decode", b, 1, shape, device, kernels, a.reps)
        for b, L in cases["verify"]:
            rows.append(verify_row(family, b, L, shape, device, a.reps))
            print(json.dumps(rows[-1]), flush=True)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "shapes": shapes, "fla": why or "imported"}
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
