"""python -m bench.gpu_layer_ops [--device cuda|cpu] [--out PATH] [--tokens 1,16,512] [--decoder]

The fused Triton layer ops (runtime.layers.triton_ops) against the torch code they replace, at
Qwen3-8B sizes in bf16 (H 4096, I 12288, 32 q heads, 8 kv heads, head_dim 128), per T tokens:

  add_rms_norm   x + residual, then RMSNorm [T, H]       (2 per layer)
  qk_norm        per-head RMSNorm of q and k, strided views of the qkv output   (1 per layer)
  rotary         RoPE of q and k                         (1 per layer)
  silu_and_mul   [T, 2I] -> [T, I]                       (1 per layer)

Accuracy: max |diff| of each against torch in bf16, and of both against torch in fp32 on the
same inputs (the fused op should be no further from it than torch is). Time (µs per call,
median): `eager`, CUDA events around 20 back-to-back calls (includes the host's launch cost);
`graph`, the same 20 calls captured once in a CUDA graph and replayed, which is what a captured
decode step pays. `per_step` adds (torch - triton) graph time over one layer's ops x 36 layers.
--decoder also times a whole 36-layer Qwen3-8B-shaped DenseDecoder forward in a CUDA graph
(random weights, attention replaced by a cheap stub) with the kernels on and off.

--device cpu is a smoke test: small sizes, the kernels through Triton's interpreter, accuracy
only (no timing). --tiny is that smoke test with its JSON marked `"tiny": true` and --out
defaulting to a temporary folder. Prints the JSON and writes it to --out; exits 1 if an op is
not close."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

QWEN3_8B = {"H": 4096, "I": 12288, "NH": 32, "NKV": 8, "HD": 128, "LAYERS": 36, "MAX_POS": 40960}
SMOKE = {"H": 576, "I": 1536, "NH": 4, "NKV": 2, "HD": 64, "LAYERS": 2, "MAX_POS": 256}
PER_LAYER = {"add_rms_norm": 2, "qk_norm": 1, "rotary": 1, "silu_and_mul": 1}
EPS = 1e-6
REPS, ITERS = 20, 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cuda", "cpu"])
    p.add_argument("--out", type=Path, default=Path("gpu_layer_ops.json"))
    p.add_argument("--tokens", default=None, help="comma-separated T (default 1,16,512; cpu 1,5)")
    p.add_argument("--decoder", action="store_true", help="also time a whole decoder forward")
    from bench.tiny import add_tiny_flag, tiny_outputs
    add_tiny_flag(p)
    args = p.parse_args(argv)
    if args.tiny:
        args.device = "cpu"
    tiny_outputs(args, p, "gpu_layer_ops", ("out",))
    return args


# -- the ops: (triton, torch) callables over the same inputs -----------------------------------
def op_cases(s: dict, t: int, device: str) -> dict[str, tuple[Callable, Callable, tuple]]:
    from runtime.config import RopeConfig
    from runtime.layers import triton_ops as tri
    from runtime.layers.mlp import silu_and_mul_torch
    from runtime.layers.norm import rms_norm_torch
    from runtime.layers.rope import RotaryEmbedding, rope_torch
    g = torch.Generator(device=device).manual_seed(t)

    def randn(*shape, scale=1.0):
        return torch.randn(shape, generator=g, device=device).mul_(scale).to(torch.bfloat16)

    hd, nq, nkv = s["HD"], s["NH"] * s["HD"], s["NKV"] * s["HD"]
    q, k, _ = randn(t, nq + 2 * nkv).split([nq, nkv, nkv], dim=-1)
    q, k = q.view(t, s["NH"], hd), k.view(t, s["NKV"], hd)
    w_h, w_q, w_k = (1 + randn(n, scale=0.2) for n in (s["H"], hd, hd))
    rope = RotaryEmbedding(hd, s["MAX_POS"], RopeConfig(theta=1e6))
    rope.init_buffers(torch.device(device))
    pos = torch.randint(0, s["MAX_POS"], (t,), generator=g, device=device)

    def add_norm_torch(x, r, w):
        summed = x + r
        return rms_norm_torch(summed, w, EPS), summed

    return {
        "add_rms_norm": (lambda x, r, w: tri.add_rms_norm(x, r, w, EPS), add_norm_torch,
                         (randn(t, s["H"], scale=4.0), randn(t, s["H"]), w_h)),
        "qk_norm": (lambda q, k, wq, wk: (tri.rms_norm(q, wq, EPS), tri.rms_norm(k, wk, EPS)),
                    lambda q, k, wq, wk: (rms_norm_torch(q, wq, EPS), rms_norm_torch(k, wk, EPS)),
                    (q, k, w_q, w_k)),
        "rotary": (lambda p, q, k: tri.rotary(p, q, k, rope.cos, rope.sin, hd),
                   lambda p, q, k: rope_torch(p, q, k, rope.cos, rope.sin, hd), (pos, q, k)),
        "silu_and_mul": (tri.silu_and_mul, silu_and_mul_torch, (randn(t, 2 * s["I"], scale=3.0),)),
    }


def _outputs(result) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]


def _max_diff(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(_outputs(a), _outputs(b)))


def accuracy(fused: Callable, ref: Callable, args: tuple) -> dict:
    """max |diff| fused vs torch (bf16), and each vs torch on the fp32 copies of the inputs."""
    got, want = fused(*args), ref(*args)
    exact = ref(*(a.float() if a.is_floating_point() else a for a in args))
    close = all(torch.allclose(x.float(), y.float(), atol=2e-2, rtol=2e-2)
                for x, y in zip(_outputs(got), _outputs(want)))
    return {"max_abs_vs_torch": _max_diff(got, want), "triton_vs_fp32": _max_diff(got, exact),
            "torch_vs_fp32": _max_diff(want, exact), "ok": close}


# -- timing ------------------------------------------------------------------------------------
def _event_median_us(run: Callable[[], None], per_run: int) -> float:
    times = []
    for _ in range(ITERS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per_run)
    return statistics.median(times)


def _graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn captured REPS times in a row (after a warm-up that compiles the kernels)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    return graph


def time_us(fn: Callable, args: tuple) -> dict:
    """µs per call of fn(*args): eager (REPS calls between two events), replayed from a graph."""
    def eager():
        for _ in range(REPS):
            fn(*args)
    eager()
    graph = _graph_of(lambda: fn(*args))
    return {"eager_us": round(_event_median_us(eager, REPS), 2),
            "graph_us": round(_event_median_us(graph.replay, REPS), 2)}


# -- the whole decoder ---------------------------------------------------------------------------
class _StubAttention:
    """Attention stand-in without a cache (same cost with the kernels on or off)."""

    def forward(self, layer_id, q, k, v, **_):
        return q + (k + v).repeat_interleave(q.shape[1] // k.shape[1], dim=1)


def decoder_step_ms(s: dict, t: int) -> dict:
    """A Qwen3-8B-shaped forward of t tokens in a CUDA graph, fused kernels on and off."""
    from runtime.config import ModelConfig
    from runtime.layers import fused
    from runtime.models.dense import DenseDecoder
    from runtime.models.forward import ForwardBatch
    cfg = ModelConfig.from_dict({
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": s["H"],
        "intermediate_size": s["I"], "num_hidden_layers": s["LAYERS"],
        "num_attention_heads": s["NH"], "num_key_value_heads": s["NKV"], "head_dim": s["HD"],
        "max_position_embeddings": s["MAX_POS"], "rope_theta": 1e6})
    with torch.device("meta"):
        model = DenseDecoder(cfg)
    model = model.to_empty(device="cuda").to(torch.bfloat16).requires_grad_(False)
    model.rope.init_buffers(torch.device("cuda"))
    for p in model.parameters():
        p.normal_(1.0 if p.dim() == 1 else 0.0, 0.02)
    ids, pos = torch.randint(0, 1000, (t,), device="cuda"), torch.arange(t, device="cuda") + 100
    batch = ForwardBatch(_StubAttention())
    row, outs = {}, {}
    with torch.inference_mode():
        for name, on in (("torch", False), ("triton", True)):
            fused.enabled = on
            outs[name] = model(ids, pos, batch).hidden
            graph = _graph_of(lambda: model(ids, pos, batch))
            row[f"{name}_ms"] = round(_event_median_us(graph.replay, REPS) / 1e3, 3)
            del graph
    fused.enabled = True
    row["hidden_max_abs_diff"] = _max_diff(outs["triton"], outs["torch"])
    return row


# -- main ------------------------------------------------------------------------------------------
def measure(s: dict, tokens: list[int], device: str) -> dict:
    rows, per_step = [], {}
    for t in tokens:
        saved_us = 0.0
        for name, (fused_fn, ref_fn, args) in op_cases(s, t, device).items():
            row = {"op": name, "T": t, **accuracy(fused_fn, ref_fn, args)}
            if device == "cuda":
                row["triton"] = time_us(fused_fn, args)
                row["torch"] = time_us(ref_fn, args)
                saved_us += PER_LAYER[name] * (row["torch"]["graph_us"] - row["triton"]["graph_us"])
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        if device == "cuda":
            per_step[t] = {"saved_ms_per_step": round(saved_us * s["LAYERS"] / 1e3, 3)}
    return {"ops": rows, "per_step": per_step}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"        # before triton_ops (and triton) is imported
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device (use --device cpu for the smoke test)")
    s = QWEN3_8B if args.device == "cuda" else SMOKE
    default = "1,16,512" if args.device == "cuda" else "1,5"
    tokens = [int(x) for x in (args.tokens or default).split(",")]
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "dtype": "bfloat16", "sizes": s, "per_layer": PER_LAYER, "reps": REPS,
              **measure(s, tokens, args.device)}
    if args.decoder and args.device == "cuda":
        report["decoder"] = {t: decoder_step_ms(s, t) for t in tokens if t <= 64}
    report["ok"] = all(row["ok"] for row in report["ops"])
    if args.tiny:
        from bench.tiny import NO_CUDA, tiny_fields
        report.update(tiny_fields({
            "timing": NO_CUDA + " (CUDA events, CUDA graphs): accuracy only",
            "decoder": NO_CUDA + " (a whole decoder forward in a CUDA graph)",
            "kernels": "through Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors"}))
    text = json.dumps(report, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
