"""python -m bench.smollm2_gpu: issue 8's end-to-end tokens/s on a GPU, with the real model.

SmolLM2-135M-Instruct (bf16, triton backend, CUDA graphs) through `dflash up`'s stack with the
shipped trained DFlash drafter and with no drafter (our autoregressive path), against
transformers' greedy `generate` (dynamic and static cache) on the same prompts: one request at
a time, streamed through the OpenAI API, prefill included. Prompts: the first N of each held-out
split (chat template). Whether each system's output equals transformers' greedy is reported
(bf16 kernels differ, so a near-tie can flip a token; the CPU fp32 runs in CI check identity).

Writes OUT/smollm2_gpu.json; the table goes into docs/benchmarks.md with --doc.

--tiny: the same on the CPU (fp32, torch attention backend, so no CUDA graphs), one prompt per
split and 8 tokens; --out defaults to a temporary folder."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from bench.gateway_cpu import Services, drive, grpc_generate, system_options, transformers_run
from bench.tiny import NO_CUDA, add_tiny_flag, tiny_fields, tiny_outputs


def grpc_stack_run(drafter: str, ids: list[list[int]], max_tokens: int, log_dir: Path,
                   levels: tuple[int, ...] = (), profile_seconds: float = 0, **options) -> dict:
    """One request at a time through the gateway's gRPC API (streamed; the GPU image has no
    `openai` package), greedy, prefill included; then, per concurrency level c in `levels`,
    2c requests of the same prompts with c in flight (EOS ignored: max_tokens each); then, with
    profile_seconds, py-spy on the three processes while requests run one at a time
    (bench/host_profile.py: where the host time of a step goes). The one-at-a-time runs'
    breakdown: the services' histograms over them (bench.prefix_cache.breakdown)."""
    from bench.prefix_cache import breakdown
    runs, outputs, loaded = [], [], []
    tag = "-".join([drafter, *(str(v) for v in options.values() if v)]).replace("/", "_")
    with Services(drafter, log_dir / f"e2e-{tag}", **options) as svc:
        address = f"127.0.0.1:{svc.opts.port}"
        grpc_generate(address, ids[0], 8)                          # warm-up
        before = svc.snapshot()
        for prompt in ids:
            t0 = time.perf_counter()
            tokens, usage = grpc_generate(address, prompt, max_tokens)
            runs.append({"tokens": len(tokens), "seconds": time.perf_counter() - t0,
                         "verify_steps": usage.verify_steps,
                         "mean_acceptance_length": 1 + usage.accepted_tokens / max(1, usage.draft_steps)})
            outputs.append(tokens)
        one_at_a_time = breakdown(before, svc.snapshot())         # where a step's time went
        for c in levels:
            batch = [ids[i % len(ids)] for i in range(2 * c)]
            got: list[list[int]] = []
            produced, seconds = asyncio.run(drive(address, batch, c, max_tokens, got))
            # the same prompt alone (which may have stopped at EOS) is a prefix of it under load
            same = sum(g[:len(outputs[i % len(ids)])] == outputs[i % len(ids)]
                       for i, g in enumerate(got))
            loaded.append({"concurrency": c, "requests": len(batch), "tokens": produced,
                           "seconds": round(seconds, 3), "tokens_per_s": round(produced / seconds, 1),
                           "identical_to_one_at_a_time": f"{same}/{len(batch)}"})
            print(json.dumps({"drafter": tag, **loaded[-1]}), flush=True)
        travel = svc.features_travel()
        ahead = svc.ahead_outcomes()
        profile = (profile_stack(svc, address, ids, max_tokens, profile_seconds, log_dir / tag)
                   if profile_seconds else None)
    return {"runs": runs, "output_ids": outputs, "concurrency": loaded, "features_travel": travel,
            "breakdown": one_at_a_time,
            **({"draft_ahead": ahead} if ahead else {}),
            **({"host_profile": profile} if profile else {})}


def profile_stack(svc: Services, address: str, ids: list[list[int]], max_tokens: int,
                  seconds: float, out: Path) -> dict:
    """py-spy on the stack's three processes while its prompts run one at a time."""
    from bench import host_profile as hp
    pids = {c.name: c.proc.pid for c in svc.stack.children
            if c.name in ("target", "draft", "gateway")}
    return hp.while_driving(pids, seconds, out, lambda i: asyncio.run(
        drive(address, [ids[i % len(ids)]], 1, max_tokens))[0])


def prompts(n: int) -> tuple[list[str], list[str]]:
    from train.prompts import load_prompts
    texts, kinds = [], []
    for split in ("eval_in", "eval_unseen"):
        recs = load_prompts(split)
        step = max(1, len(recs) // n)
        for r in recs[::step][:n]:
            texts.append(r.text)
            kinds.append(split)
    return texts, kinds


def summary(runs: list[dict], kinds: list[str]) -> dict:
    out = {}
    for kind in ("eval_in", "eval_unseen", "all"):
        sel = [r for r, k in zip(runs, kinds) if kind in ("all", k)]
        row = {"tokens_per_s": round(sum(r["tokens"] for r in sel) / sum(r["seconds"] for r in sel), 1)}
        mal = [r["mean_acceptance_length"] for r in sel if "mean_acceptance_length" in r]
        if mal:
            steps = sum(r["verify_steps"] for r in sel)
            row["tau"] = round(sum(r["tokens"] - 1 for r in sel) / max(1, steps), 3)  # prefill's token

        out[kind] = row
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-split", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--systems", nargs="+", default=["dflash", "none"],
                    help="our stacks, each DRAFTER[:DRAFT_DTYPE][,tree=N][,block=B] (the last "
                         "autoregressive one, 'none', is the identity reference)")
    ap.add_argument("--concurrency", nargs="*", type=int, default=[],
                    help="also run each of our stacks with this many requests in flight (2c "
                         "requests per level)")
    ap.add_argument("--profile-seconds", type=float, default=0,
                    help="after each of our stacks' runs, py-spy its three processes for this "
                         "long while requests run one at a time (bench/host_profile.py)")
    ap.add_argument("--no-transformers", action="store_true",
                    help="only our two stacks (e.g. to rerun them with another drafter)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp") + "/smollm2_gpu.json")
    add_tiny_flag(ap)
    args = ap.parse_args(argv)
    tiny_outputs(args, ap, "smollm2_gpu", ("out",))
    if args.tiny:                       # the CPU, one prompt per split, a few tokens
        args.device, args.dtype, args.backend = "cpu", "float32", "torch"
        args.per_split, args.max_tokens = 1, 8
    from dflash.prepare.smollm2 import prepare_smollm2
    from runtime.tokenizer import ChatTokenizer
    model_dir = prepare_smollm2([args.dtype], progress=False)[args.dtype]
    tok = ChatTokenizer(model_dir)
    texts, kinds = prompts(args.per_split)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    result: dict = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "backend": args.backend,
                    "max_tokens": args.max_tokens, "prompts": len(ids), "systems": {}}
    if args.tiny:
        result.update(tiny_fields({"cuda_graphs": NO_CUDA, "triton": NO_CUDA + " (torch backend)",
                                   "bf16": "fp32 on the CPU"}))
    options = {"device": args.device, "dtype": args.dtype, "attention_backend": args.backend,
                   "model_dir": str(model_dir)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-smollm2-") as tmp:
        for spec in args.systems:
            label, drafter, more = system_options(spec)
            r = grpc_stack_run(drafter, ids, args.max_tokens, Path(tmp), tuple(args.concurrency),
                               args.profile_seconds, **options, **more)
            result["systems"][label] = r
            print(json.dumps({label: summary(r["runs"], kinds)}), flush=True)
            print(json.dumps({label: {k: v["ms"] if isinstance(v, dict) else v
                                      for k, v in r["breakdown"].items()}}), flush=True)
            out.write_text(json.dumps(result) + "\n")          # partial results survive a timeout
    for cache in () if args.no_transformers else ("", "static"):
        r = transformers_run(model_dir, ids, args.max_tokens, device=args.device,
                             dtype=args.dtype, cache=cache)
        result["systems"][f"transformers generate ({cache or 'dynamic'} cache)"] = r
        print(json.dumps({cache or "dynamic": summary(r["runs"], kinds)}), flush=True)
        out.write_text(json.dumps(result) + "\n")
    reference = result["systems"].get("transformers generate (dynamic cache)", {}).get("output_ids")
    ars = {label: r["output_ids"] for label, r in result["systems"].items()
           if label.startswith("dflash up --drafter none")}
    for label, r in result["systems"].items():
        r["summary"] = summary(r["runs"], kinds)
        outs = r.pop("output_ids")
        if reference is not None:
            r["identical_to_transformers"] = sum(a == b for a, b in zip(outs, reference))
        # against our autoregressive stack of the same mode (--deterministic or not)
        det = "--deterministic" in label
        ar = next((a for lbl, a in ars.items() if ("--deterministic" in lbl) == det),
                  next(iter(ars.values()), None))
        if ar is not None:              # (no autoregressive stack in --systems: nothing to say)
            r["identical_to_our_ar"] = sum(a == b for a, b in zip(outs, ar))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v["summary"] for k, v in result["systems"].items()}, indent=1))


if __name__ == "__main__":
    main()
