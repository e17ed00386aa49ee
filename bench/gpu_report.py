"""python -m bench.gpu_report: renders the "GPU: one NVIDIA H200" section of docs/benchmarks.md
and its plot from the JSON the GPU benchmarks wrote (bench/results/gpu/, bench/results/
h200_micro.json). The numbers come only from those files; the prose around them is here."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.gpu_side_by_side import LEVELS, plot
from bench.report import write_section

SECTION = "## GPU: one NVIDIA H200 (issue 7)"
RESULTS = Path("bench/results")


def load(name: str) -> dict:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else {}


def _row(rows: list[dict], config: str, c: int, tau=None, wire=None) -> dict:
    for r in rows:
        if (r.get("config") == config and r.get("concurrency") == c
                and r.get("forced_tau") == tau and r.get("wire") == wire):
            return r
    return {}


def _tps(r: dict) -> str:
    return f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "—"


def throughput_table(rows: list[dict], floor: dict) -> list[str]:
    out = ["| configuration | forced τ | c = 1 | c = 8 | c = 32 | c = 1: ms per step (draft / verify / wire + gateway) | c = 1: share of the bandwidth floor |",
           "|---|---|---|---|---|---|---|"]
    floor_ms = floor["floor_ms_per_step"]
    target_floor = floor["target_floor_ms"]
    lines = [("(b) transformers `generate`, static cache (compiled)", "transformers-static", None, None),
             ("(b) transformers `generate`, dynamic cache", "transformers-dynamic", None, None),
             ("(a) autoregressive through our target service", "AR service", None, "unary")]
    for tau in (6.4, 3.0):
        lines += [("(c) speculative, in-process", "in-process", tau, None),
                  ("(d) speculative through 3 services, unary calls", "spec services", tau, "unary"),
                  ("(d) speculative through 3 services, one stream per upstream", "spec services", tau, "stream")]
    for label, config, tau, wire in lines:
        cells = [_row(rows, config, c, tau, wire) for c in LEVELS]
        r1 = cells[0]
        if not r1:
            continue
        split, share = "—", "—"
        if config == "in-process":
            split = f"{r1['draft_ms']:.1f} / {r1['verify_ms']:.1f} / 0"
            step_ms = r1["seconds"] * 1000 / r1["steps"]   # c = 1: one request after another
            share = f"{100 * floor_ms / step_ms:.0f} %"
        elif config in ("spec services", "AR service"):
            split = (f"{r1['propose_handler_ms']:.1f} / {r1['verify_handler_ms']:.1f} / "
                     f"{r1['overhead_ms']:.1f} ({r1['overhead_pct']:.0f} %)")
            share = f"{100 * (floor_ms if config != 'AR service' else target_floor) / r1['step_ms']:.0f} %"
        elif "seconds" in r1:
            share = f"{100 * target_floor / (1000 / r1['tokens_per_s']):.0f} %"
        out.append(f"| {label} | {tau if tau else '—'} | {' | '.join(_tps(c) for c in cells)} | "
                   f"{split} | {share} |")
    return out


def goals(rows: list[dict], micro: dict) -> list[str]:
    c1 = max(_row(rows, "spec services", 1, 6.4, w).get("tokens_per_s", 0) for w in ("unary", "stream"))
    c32 = max(_row(rows, "spec services", 32, 6.4, w).get("tokens_per_s", 0) for w in ("unary", "stream"))
    inproc1 = _row(rows, "in-process", 1, 6.4).get("tokens_per_s", 0)
    ar1 = _row(rows, "AR service", 1, None, "unary").get("tokens_per_s", 0)
    tf1 = _row(rows, "transformers-static", 1).get("tokens_per_s", 0)
    tri, fi = micro.get("attn_triton_ms"), micro.get("attn_flashinfer_ms")
    met = lambda ok: "**met**" if ok else "**not met**"
    split = 100 * (1 - c1 / inproc1) if inproc1 else float("nan")
    return [
        (f"- c = 1, forced τ = 6.4, through gRPC ≥ 900 tokens/s: {met(c1 >= 900)} — {c1:,.0f} "
        f"tokens/s (in-process {inproc1:,.0f}); the gRPC split costs {split:.0f} % against "
        f"in-process (goal ≤ 10 %: {met(split <= 10)})."),
        (f"- our autoregressive path ≥ transformers' `generate` with a static cache at c = 1: "
        f"{met(ar1 >= tf1)} — {ar1:,.0f} vs {tf1:,.0f} tokens/s (ours through the target "
        f"service and the gateway; transformers in one process, compiled)."),
        (f"- c = 32, forced τ = 6.4, through gRPC ≥ 6 000 tokens/s: {met(c32 >= 6000)} — "
        f"{c32:,.0f} tokens/s."),
        (f"- Triton verify attention within 1.5× of FlashInfer at context 4 096, B = 16, batch "
         f"32: {met(tri is not None and fi is not None and tri <= 1.5 * fi)} — {tri} ms vs "
         f"{fi} ms."),
    ]


def ttft_lines(sbs: dict) -> list[str]:
    inproc = sbs.get("inproc_tau6.4_ttft") or {}
    svc = (sbs.get("services_tau6.4") or {}).get("ttft", {})
    ar = (sbs.get("services_ar") or {}).get("ttft", {})
    out = ["| path | time to first token, 1 000-token prompt (median of 3) |", "|---|---|"]
    if inproc:
        out.append(f"| in-process: target prefill with the 5 tapped layers' features | "
                   f"{inproc['ttft_ms']:.0f} ms (then the drafter's first append + propose: "
                   f"{sorted(r['first_propose_ms'] for r in inproc['runs'])[1]:.0f} ms) |")
    for wire, t in svc.items():
        out.append(f"| through the services, {wire} wire (features of the prompt shipped "
                   f"target → gateway, 41 MB bf16) | {t['ttft_ms']:.0f} ms |")
    for wire, t in ar.items():
        out.append(f"| through the services, no drafter (no features) | {t['ttft_ms']:.0f} ms |")
    return out


def health_lines(sbs: dict) -> list[str]:
    out = []
    for name in ("services_ar", "services_tau6.4"):
        part = sbs.get(name) or {}
        for svc, events in (part.get("health") or {}).items():
            seq = ", ".join(f"{status} at +{t:g} s" for t, status in events)
            out.append(f"- {name.replace('services_', '')} stack, {svc}: {seq}")
    return out


def markdown(sbs: dict, tf: dict, micro: dict, layer_ops: dict, png: str) -> str:
    rows = sbs.get("rows", []) + tf.get("rows", [])
    floor = sbs["floor"]
    setup = sbs["setup"]
    lines = [SECTION, "",
             ("Machine: one NVIDIA H200 (141 GB HBM3e), torch 2.11.0+cu130, triton 3.6.0, "
              "grpcio 1.84.0, transformers 5.17.0; 2026-11-30. Everything runs on the GPU "
              "machine's own 16 cores and one GPU."), "",
             ("**Side by side** — `python -m bench.gpu_side_by_side` (after `source "
              "scripts/h200/env.sh`; results in `bench/results/gpu/side_by_side_h200*.json`; the "
              "transformers rows came from a second invocation with `--parts transformers`). "
              "Qwen3-8B-shaped target (36 layers, hidden 4096, 32/8 heads, head_dim 128, FFN "
              "12288, vocab 151 936) and a DFlash-shaped drafter (5 layers, taps 1, 9, 17, 25, "
              "33, block 16), **random bf16 weights** (the benchmark hook `random_weights`; then "
              "the environment switch `DFLASH_BENCH_RANDOM_WEIGHTS=1`, since replaced by "
              "`dflash/harness.py`). "
              f"Requests: {setup['prompt_tokens']}-token prompts, {setup['max_tokens']} output "
              "tokens each, greedy, `ignore_eos`; concurrency c = requests in flight (at least 4 "
              "requests per level). Target: triton backend, CUDA graphs for B = 1 and B = 16 at "
              "batch buckets 1..32; draft: CUDA graphs for its context append and its block. "
              "**Acceptance is FORCED** (then the environment switch `DFLASH_BENCH_FORCE_TAU`; "
              "now the benchmark hook `TargetHooks.forced_acceptance`, set only through "
              "`dflash/harness.py`, which logs it loudly): every speculative row is at the forced "
              "τ in its "
              "row (measured committed tokens per step: 6.28–6.36 and 3.0; short of 6.4 only "
              "where the last block of a request is cut by max_tokens)."), "",
             "![side by side](img/gpu_side_by_side.png)", "",
             "Output tokens/s:", ""]
    lines += throughput_table(rows, floor)
    lines += ["", ("JSON: `bench/results/gpu/side_by_side_h200.json` (rows a, c, d) and "
                   "`bench/results/gpu/side_by_side_h200_transformers.json` (rows b)."), "",
              ("Per-step split: for (d) from the gateway's stage timings and the services' "
               "handler times on their `/metrics` (draft = Propose handler, verify = Verify "
               "handler — both include their engine queue — and the rest, wire + gateway, is "
               "everything outside the two handlers); for (c) the time awaiting the draft and "
               "the target engines. Bandwidth floor: the bytes of weights one step reads "
               f"(target {floor['target_bytes'] / 1e9:.1f} GB incl. its LM head; drafter "
               f"{floor['draft_bytes'] / 1e9:.1f} GB incl. the target LM head it borrows) over "
               f"the measured copy bandwidth {floor['copy_GBps']:,.0f} GB/s = "
               f"**{floor['floor_ms_per_step']:.2f} ms per speculative step** "
               f"({floor['target_floor_ms']:.2f} ms for a target-only step). At τ = 6.4 that "
               f"allows {6.4 * 1000 / floor['floor_ms_per_step']:,.0f} tokens/s at c = 1."), "",
              "**Time to first token** (c = 1; in-process vs through the services):", ""]
    lines += ttft_lines(sbs)
    lines += ["", ("JSON: `bench/results/gpu/side_by_side_h200.json` (the readiness list below "
                   "too)."), "",
              ("**Readiness on the GPU path** (health transitions the benchmark recorded "
              "from process start; warm-up = Triton JIT + CUDA-graph capture, readiness waits for "
              "it):"), ""]
    lines += health_lines(sbs)
    if layer_ops:
        lines += ["", ("**Fused layer ops** (`python -m bench.gpu_layer_ops --decoder`, "
                       "`bench/results/gpu/layer_ops_h200.json`): Triton add+RMSNorm, q/k norm, "
                       "rotary and SiLU·mul replace 4–8 torch kernels each inside the graphs; a "
                       "36-layer decoder step in a CUDA graph (attention stubbed) went from "
                       "7.65 to 4.49 ms at 1 token and 8.86 to 4.64 ms at 16 tokens.")]
    if micro:
        lines += ["", ("**In-process micro-measurements** (`python -m bench.h200_micro`, "
                       "`bench/results/h200_micro.json`, before the fused ops): verify "
                       f"attention at context 4 096, B = 16, batch 32: Triton "
                       f"{micro.get('attn_triton_ms')} ms, FlashInfer "
                       f"{micro.get('attn_flashinfer_ms')} ms.")]
    lines += ["", "Goals of issue 7, plainly:", ""] + goals(rows, micro)
    lines += ["", WHY]
    return "\n".join(lines) + "\n"


WHY = """Where the time goes (from `python -m bench.gpu_profile`, a torch.profiler trace of the
in-process loop at c = 1): the GPU is busy about 6.4 ms of each speculative step, not far above
the 4.5 ms floor, but a step takes about 10 ms in-process and 14 ms through the services (stream
wire). The rest is host work between the device's bursts: Python in two engine threads and the
event loop, one graph launch of ~2 000 nodes (0.9 ms of CPU just to launch it), the acceptance
read-back and the feature copy, and (through the services) two gRPC round trips with protobuf
copies of the features per step. Capturing the drafter's context append as CUDA graphs (row
buckets) took the draft's part of a step from 4.3 to 2.4 ms; packing the graph inputs into two
pinned copies and deciding acceptance on the device are in the same run. What would close the
rest, in order of size: launch the next draft right after the verify on the device without a host
round trip in between (overlap scheduling as in SGLang), keep the per-step scheduling out of
Python, and ship features from the target to the draft without passing through the gateway. The
time to first token through the services is dominated by shipping the prompt's features
(1 000 × 5 × 4 096 bf16 = 41 MB) through gRPC in one message; a prompt without features (no
drafter) answers in about the in-process time."""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", default="docs/benchmarks.md")
    ap.add_argument("--png", "--out", dest="png", default="docs/img/gpu_side_by_side.png",
                    help="the plot written (--out: the same)")
    args = ap.parse_args(argv)
    sbs = load("gpu/side_by_side_h200.json")
    tf = load("gpu/side_by_side_h200_transformers.json")
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    plot({**sbs, "rows": sbs.get("rows", []) + tf.get("rows", [])}, Path(args.png))
    write_section(Path(args.doc), SECTION, markdown(sbs, tf, load("h200_micro.json"),
                                                    load("gpu/layer_ops_h200.json"), args.png))


if __name__ == "__main__":
    main()
