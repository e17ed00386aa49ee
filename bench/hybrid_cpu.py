"""python -m bench.hybrid_cpu [--out bench/results/hybrid_cpu.json]: verify time and memory of a
hybrid (Bamba: Mamba2 + attention) target against a dense (Llama) target of similar size, on CPU.

Both models are random-initialised (transformers writes them), loaded by the runtime and run
through TargetWorker.forward as the target engine does: a prompt is prefilled once, then a verify
block of B tokens (B = 1, 8, 16) is timed for batches of 1 and 4 sequences - for the hybrid
model the forward keeps B intermediate states and the commit copies one back; for the dense
model rejected KV pages are trimmed. Memory: the state pool (live + B intermediate states per
sequence) next to the KV cache per token. --tiny: blocks 1 and 4, batches 1 and 2, 32 prompt
tokens, 2 repeats (a smoke test; --out defaults to a temporary folder)."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from runtime.attention.metadata import SeqSlice
from runtime.kv_cache import PageTable
from runtime.state_pool import verify_positions
from services.target.config import TargetConfig
from services.target.worker import TargetWorker

HIDDEN, LAYERS = 256, 8
COMMON = {"vocab_size": 4096, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
          "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
          "tie_word_embeddings": False}
HYBRID = {**COMMON, "attn_layer_indices": [3, 7], "mamba_n_heads": 8,
          "mamba_d_head": 2 * HIDDEN // 8, "mamba_n_groups": 1, "mamba_d_state": 64,
          "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 64}
# the dense model's wider MLP matches the hybrid's parameter count (mamba layers are larger)
DENSE = {**COMMON, "intermediate_size": 736}
BLOCKS, BATCHES = (1, 8, 16), (1, 4)


def write_models(root: Path) -> dict[str, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash.prepare.tiny_hybrid import make_tiny_hybrid
    hybrid = make_tiny_hybrid(root / "hybrid", **HYBRID)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**DENSE)).save_pretrained(root / "dense")
    return {"hybrid": hybrid, "dense": root / "dense"}


def load(model_dir: Path, slots: int, max_block: int) -> TargetWorker:
    return TargetWorker.started(TargetConfig(model_dir=str(model_dir), kv_budget_bytes=256 << 20,
                                             state_slots=slots, max_block_size=max_block))


class Seq:
    def __init__(self, worker: TargetWorker, name: str) -> None:
        self.table, self.len = PageTable(), 0
        self.slot = worker.state_pool.allocate(name) if worker.facts.hybrid else None


def forward(worker: TargetWorker, seqs: list[Seq], tokens: list[list[int]], verify: bool):
    slices, ids, pos = [], [], []
    for s, t in zip(seqs, tokens):
        worker.kv_cache.ensure(s.table, s.len + len(t))
        slices.append(SeqSlice(s.table, s.len, len(t)))
        ids += t
        pos += range(s.len, s.len + len(t))
    out = worker.forward(slices, torch.tensor(ids), torch.tensor(pos), (),
                         [s.slot for s in seqs], [verify] * len(seqs))
    return worker.logits(out.hidden)


class VerifyRun:
    """`batch` sequences prefilled with `prompt_len` random tokens; step() times one verify of a
    random block (forward + logits + commit / trim), accepting one draft when there is one, so
    every step runs at a fresh position and the context grows slowly."""

    def __init__(self, worker: TargetWorker, batch: int, block: int, prompt_len: int) -> None:
        self.worker, self.block = worker, block
        self.g = torch.Generator().manual_seed(block)
        self.seqs = [Seq(worker, f"s{i}") for i in range(batch)]
        vocab = worker.facts.vocab_size
        prompts = [torch.randint(3, vocab, (prompt_len,), generator=self.g).tolist()
                   for _ in self.seqs]
        forward(worker, self.seqs, prompts, verify=False)
        for s in self.seqs:
            s.len = prompt_len

    def step(self) -> float:
        worker, vocab = self.worker, self.worker.facts.vocab_size
        blocks = [torch.randint(3, vocab, (self.block,), generator=self.g).tolist()
                  for _ in self.seqs]
        t0 = time.perf_counter()
        forward(worker, self.seqs, blocks, verify=True)
        keep = min(1, self.block - 1)
        if worker.facts.hybrid:
            worker.commit_mamba_state([(s.slot, keep) for s in self.seqs])
        if worker.device.type == "cuda":
            torch.cuda.synchronize()
        for s in self.seqs:
            s.len += keep + 1
            worker.kv_cache.trim(s.table, s.len)
        return time.perf_counter() - t0

    def close(self) -> None:
        for s in self.seqs:
            self.worker.kv_cache.release(s.table)
            if s.slot is not None:
                self.worker.state_pool.free(s.slot)


def time_pair(workers: dict[str, TargetWorker], batch: int, block: int, prompt_len: int,
              repeats: int) -> dict[str, list[float]]:
    """Seconds per verify step of each model, steps interleaved (order alternating) so that
    both see the same machine load."""
    runs = {name: VerifyRun(w, batch, block, prompt_len) for name, w in workers.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats + 2):
        for name in (list(runs) if i % 2 else list(runs)[::-1]):
            t = runs[name].step()
            if i >= 2:                               # two warm-up steps
                times[name].append(t)
    for r in runs.values():
        r.close()
    return times


def memory(worker: TargetWorker) -> dict[str, int]:
    cfg = worker.model.cfg
    kv_per_token = 2 * worker.num_attention_layers * cfg.num_kv_heads * cfg.head_dim * 4
    out = {"kv_bytes_per_token": kv_per_token, "attention_layers": worker.num_attention_layers,
           "params": sum(p.numel() for p in worker.model.parameters())}
    pool = worker.state_pool
    if pool is not None:
        per_state = pool.nbytes // (pool.num_slots
                                    + pool.num_verify_slots * verify_positions(pool.max_block_size))
        out.update(state_bytes_per_sequence_live=per_state,
                   state_bytes_per_sequence_verify=per_state * pool.max_block_size,
                   mamba_layers=pool.num_layers,
                   kv_tokens_equivalent_of_live_state=per_state // kv_per_token)
    return out


def run(args: argparse.Namespace, blocks: tuple[int, ...] = BLOCKS,
        batches: tuple[int, ...] = BATCHES) -> dict:
    torch.set_num_threads(args.threads)
    results, models = [], {}
    pool_bytes: dict[int, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = write_models(Path(tmp))
        for block in blocks:
            workers = {name: load(path, slots=max(batches), max_block=block)
                       for name, path in dirs.items()}
            models = {name: memory(w) for name, w in workers.items()}
            pool_bytes[block] = workers["hybrid"].state_pool.nbytes
            for batch in batches:
                for name, t in time_pair(workers, batch, block, args.prompt_len,
                                         args.repeats).items():
                    results.append({
                        "model": name, "block": block, "batch": batch,
                        "median_ms": round(1e3 * statistics.median(t), 3),
                        "min_ms": round(1e3 * min(t), 3),
                        "p90_ms": round(1e3 * sorted(t)[int(0.9 * (len(t) - 1))], 3),
                        "tokens_per_s": round(batch * block / statistics.median(t), 1)})
                    print(json.dumps(results[-1]), flush=True)
    models["hybrid"][f"state_pool_bytes_{max(batches)}_slots_by_block"] = pool_bytes
    return {"machine": {"cpu": platform.processor() or platform.machine(),
                        "cpus": torch.get_num_threads(), "torch": torch.__version__},
            "setup": {"hidden": HIDDEN, "layers": LAYERS, "prompt_len": args.prompt_len,
                      "repeats": args.repeats, "dtype": "float32",
                      "hybrid_attention_layers": HYBRID["attn_layer_indices"]},
            "models": models, "verify": results}


def markdown(report: dict) -> str:
    """The docs/benchmarks.md tables of a report."""
    rows = {(r["model"], r["block"], r["batch"]): r for r in report["verify"]}
    blocks = sorted({r["block"] for r in report["verify"]})      # BLOCKS, BATCHES but --tiny
    batches = sorted({r["batch"] for r in report["verify"]})
    lines = [("| block B | batch | hybrid ms (median / min) | dense ms (median / min) "
              "| hybrid / dense |"), "|---|---|---|---|---|"]
    for block in blocks:
        for batch in batches:
            h, d = rows[("hybrid", block, batch)], rows[("dense", block, batch)]
            lines.append(f"| {block} | {batch} | {h['median_ms']:.1f} / {h['min_ms']:.1f} | "
                         f"{d['median_ms']:.1f} / {d['min_ms']:.1f} | "
                         f"{h['median_ms'] / d['median_ms']:.2f} |")
    m = report["models"]
    hyb, den = m["hybrid"], m["dense"]
    pools = hyb[f"state_pool_bytes_{max(batches)}_slots_by_block"]
    live = hyb["state_bytes_per_sequence_live"] / 2**20
    lines += ["", "| memory | hybrid | dense |", "|---|---|---|",
              f"| parameters | {hyb['params'] / 1e6:.2f} M | {den['params'] / 1e6:.2f} M |",
              (f"| layers (attention + mamba) | {hyb['attention_layers']} + "
               f"{hyb['mamba_layers']} | {den['attention_layers']} + 0 |"),
              (f"| KV cache per token | {hyb['kv_bytes_per_token'] / 1024:.0f} KiB | "
               f"{den['kv_bytes_per_token'] / 1024:.0f} KiB |"),
              (f"| live state per sequence | {live:.2f} MiB (= KV of "
               f"{hyb['kv_tokens_equivalent_of_live_state']} tokens) | 0 |")]
    for block, size in pools.items():
        lines.append(f"| state pool, {max(batches)} slots, B = {block} | "
                     f"{int(size) / 2**20:.1f} MiB | 0 |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hybrid_cpu", description=__doc__)
    p.add_argument("--out", default="bench/results/hybrid_cpu.json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    from bench.tiny import add_tiny_flag, tiny_fields, tiny_outputs
    add_tiny_flag(p)
    args = p.parse_args(argv)
    tiny_outputs(args, p, "hybrid_cpu", ("out",))
    if args.tiny:
        args.prompt_len, args.repeats = 32, 2
        report = {**run(args, (1, 4), (1, 2)), **tiny_fields()}
    else:
        report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(json.loads(out.read_text())))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
