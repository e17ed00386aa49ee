"""python -m bench.tp_cpu: a tensor-parallel target against one rank, on this CPU.

SmolLM2-135M-Instruct fp32 as `python -m services.target` at --tensor-parallel-size 1 and 3 (3
is the only split of its 9 heads / 3 KV heads; gloo, each rank cores / 3 threads - at least 1),
side by side on loopback: greedy decoding through Prefill + Verify of the anchor (tokens/s), and
Verify blocks of 16 (latency), the sizes taking turns round by round. The output of both must be
identical (asserted). On a 2-core host this measures what the split costs - one all-reduce per
attention and MLP block, 60 per forward, and three processes on two cores - not a speed-up:
tensor parallelism is for targets too big for one device (the GPU measurement is issue 40's).
Writes bench/results/tp_cpu.json and the "Tensor-parallel target (CPU)" section of
docs/benchmarks.md. --tiny: 8 tokens, 1 round (a smoke test; outputs to a temporary folder)."""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.report import add_output_flags, machine, render_only, save
from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs

SECTION = "## Tensor-parallel target (CPU)"
PROMPT_TEXT = "Explain how photosynthesis works in simple terms."


def start(model: Path, logs: Path, size: int):
    from support.procs import start_target  # tests/support (as bench.target_cpu)
    return start_target(model, logs, "--tensor-parallel-size", str(size),
                        "--kv-budget", "128MiB", "--max-block-size", "16")


def greedy_s(client, seq: str, prompt: list[int], n: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    out = client.greedy(seq, prompt, n)
    return time.perf_counter() - t0, out


def block_ms(client, seq: str, prompt: list[int], repeats: int) -> float:
    """Median round trip of a Verify of 16 tokens (the anchor and 15 drafts, mostly refused)."""
    first = client.prefill(seq, prompt).next_token
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        r = client.verify(seq, [first] + [(7 * i + j) % 1000 + 10 for j in range(15)])
        times.append(time.perf_counter() - t0)
        first = r.committed_tokens[-1]
    client.release(seq)
    return 1e3 * statistics.median(times)


def run(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support.target_client import TargetClient

    from dflash.prepare.smollm2 import prepare_smollm2
    from runtime.tokenizer import ChatTokenizer
    model = prepare_smollm2(["float32"], progress=False)["float32"]
    tok = ChatTokenizer(model)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT_TEXT}]))
    sizes = (1, 3)
    per = {s: {"decode_s": [], "verify16_ms": []} for s in sizes}
    outputs: dict[int, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        procs = {s: start(model, Path(tmp), s) for s in sizes}
        clients = {s: TargetClient(p.address) for s, p in procs.items()}
        try:
            for r in range(args.rounds):
                for s in sizes[:: -1 if r % 2 else 1]:
                    seconds, out = greedy_s(clients[s], f"g{r}", prompt, args.tokens)
                    per[s]["decode_s"].append(seconds)
                    outputs.setdefault(s, out)
                    per[s]["verify16_ms"].append(block_ms(clients[s], f"v{r}", prompt,
                                                          args.repeats))
        finally:
            for c in clients.values():
                c.close()
            for p in procs.values():
                p.stop()
    if outputs[1] != outputs[3]:
        raise AssertionError("3 ranks decoded other tokens than 1 rank")
    rows = [{"ranks": s, "decode_tokens_per_s": round(args.tokens / statistics.median(
                 per[s]["decode_s"]), 2),
             "verify16_ms": round(statistics.median(per[s]["verify16_ms"]), 2),
             "decode_s": [round(x, 3) for x in per[s]["decode_s"]]} for s in sizes]
    return {"machine": machine(), "date": datetime.date.today().isoformat(),
            "command": "python -m bench.tp_cpu" + (" --tiny" if args.tiny else ""),
            "tokens": args.tokens, "rounds": args.rounds, "rows": rows,
            "identical_outputs": True, **(tiny_fields() if args.tiny else {})}


NOTE = ("On 2 cores three ranks share two cores and pay 60 all-reduces (gloo over loopback) per "
        "forward: the split costs here (each collective waits for all three processes to be "
        "scheduled); it exists for targets that do not fit one device (the two-GPU measurement "
        "is issue 40's).")


def markdown(r: dict) -> str:
    m = r["machine"]
    setup = (f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}; {r['date']}; "
             f"`{r['command']}`. SmolLM2-135M-Instruct fp32, greedy decoding of {r['tokens']} "
             f"tokens through Prefill + Verify (median of {r['rounds']} rounds) and the round "
             f"trip of a Verify of 16 tokens; the outputs of 1 and 3 ranks are identical.")
    lines = [SECTION, "", setup, "", "| ranks | decode tokens/s | Verify of 16 (ms) |", "|---|---|---|"]
    lines += [f"| {row['ranks']} | {row['decode_tokens_per_s']} | {row['verify16_ms']} |"
              for row in r["rows"]]
    lines += ["", NOTE]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    add_output_flags(p, "tp_cpu")
    add_tiny_flag(p)
    args = p.parse_args(argv)
    if render_only(args, SECTION, markdown):
        return
    if args.tiny:
        args.tokens, args.rounds, args.repeats = 8, 1, 2
        tiny_outputs(args, p, "tp_cpu")
    r = run(args)
    save(r, Path(args.out), Path(args.doc), SECTION, markdown)
    print(markdown(r))


if __name__ == "__main__":
    main()
