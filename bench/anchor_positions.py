"""python -m bench.anchor_positions --work DIR: where along the target's greedy held-out answers a
drafter is accepted, and where the speculative loop starts its blocks.

For every answer position p the drafter's block is drafted once (context = target features
before p) and its accepted length a(p) read against the answer. Three sets of anchors are then
compared: every position ("uniform", what `train-draft` samples by default), the positions the
greedy speculative loop visits from the answer's start (p -> p + a(p) + 1, what τ is measured
on), and one or two such hops from every position (what `--loop-hops 1` / `2` train on). Also
τ by offset in the answer (16-token buckets). CPU, fp32 features. Writes JSON to --out."""
from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import replace
from datetime import date
from pathlib import Path

import torch

from bench.report import machine
from runtime.models.dflash import TargetHead, load_dflash
from services.draft.training.blocks import accepted_drafts, block_inputs, draft_hidden
from services.draft.training.evaluate import default_target
from services.draft.training.features import FeatureExtractor
from services.draft.training.generate import Example, load_examples, shuffled


def accepted_everywhere(draft, head, extractor, example: Example) -> list[int]:
    """a(p) for every answer position p = prompt_len .. len-2 (index 0 is the answer's start)."""
    seq = example.ids
    p0 = len(example.prompt_ids)
    feats = extractor([seq], greedy=False).feats
    ids, lens = torch.tensor([seq]), torch.tensor([len(seq)])
    anchors = torch.arange(p0, len(seq) - 1)[None]
    bids, bpos, labels = block_inputs(ids, anchors, draft.cfg.block_size,
                                      draft.cfg.mask_token_id, lens)
    with torch.no_grad():
        return accepted_drafts(draft_hidden(draft, head, feats, bids, bpos), labels,
                               head)[0].tolist()


def hop(accepted: list[int], p: int, hops: int) -> int | None:
    """p after `hops` loop steps (p -> p + a(p) + 1), or None past the last anchor."""
    for _ in range(hops):
        p += accepted[p] + 1
        if p >= len(accepted):
            return None
    return p


def loop_offsets(accepted: list[int]) -> list[int]:
    """The answer offsets the greedy speculative loop drafts from, starting at 0."""
    out: list[int] = []
    p: int | None = 0
    while p is not None:
        out.append(p)
        p = hop(accepted, p, 1)
    return out


def summary(values: list[int]) -> dict:
    """Accepted lengths at a set of anchors -> their count, mean, τ and acceptance at k = 1..4."""
    n = max(1, len(values))
    return {"anchors": len(values), "mean_accepted": round(sum(values) / n, 3),
            "tau": round(1 + sum(values) / n, 3),
            "acceptance": [round(sum(v >= k for v in values) / n, 4) for k in range(1, 5)]}


def by_offset(pairs: list[tuple[int, int]], width: int = 16) -> dict[str, dict]:
    """(offset, accepted) pairs -> {bucket start: {anchors, tau}}."""
    buckets: dict[int, list[int]] = defaultdict(list)
    for off, a in pairs:
        buckets[off // width * width].append(a)
    return {str(k): {"anchors": len(v), "tau": round(1 + sum(v) / len(v), 3)}
            for k, v in sorted(buckets.items())}


def measure_split(draft, head, extractor, examples: list[Example]) -> dict:
    uniform, loop, hop1, hop2 = [], [], [], []
    for e in examples:
        if len(e.response_ids) < 2:
            continue
        acc = accepted_everywhere(draft, head, extractor, e)
        uniform += [(off, a) for off, a in enumerate(acc)]
        loop += [(off, acc[off]) for off in loop_offsets(acc)]
        for hops, into in ((1, hop1), (2, hop2)):
            for p in range(len(acc)):
                q = hop(acc, p, hops)
                if q is not None:
                    into.append((q, acc[q]))
    return {"sequences": len(examples),
            "anchors": {name: summary([a for _, a in pairs]) for name, pairs in
                        (("uniform", uniform), ("loop", loop), ("one_hop", hop1),
                         ("two_hops", hop2))},
            "loop_by_offset": by_offset(loop), "uniform_by_offset": by_offset(uniform)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="folder with the held-out greedy answers "
                    "({eval_in,eval_unseen}_t0.0.jsonl, as train-draft writes them)")
    ap.add_argument("--draft-model", default="models/smollm2-135m-instruct-dflash")
    ap.add_argument("--per-split", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=0, help="cut answers (0 = as generated)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/drafter_anchor_positions.json")
    args = ap.parse_args(argv)
    target = str(default_target("float32"))
    draft = load_dflash(Path(args.draft_model), torch.float32, "cpu")
    head = TargetHead.load(target, torch.float32, "cpu")
    extractor = FeatureExtractor(target, draft.cfg.target_layer_ids, 4096, torch.float32, "cpu")
    t0 = time.monotonic()
    splits = {}
    for split in ("eval_in", "eval_unseen"):
        examples = shuffled(load_examples(Path(args.work) / f"{split}_t0.0.jsonl"),
                            args.seed)[: args.per_split]
        if args.max_new_tokens:
            examples = [replace(e, response_ids=e.response_ids[: args.max_new_tokens])
                        for e in examples]
        splits[split] = measure_split(draft, head, extractor, examples)
        print(split, json.dumps(splits[split]["anchors"]), flush=True)
    out = {"date": str(date.today()), "machine": machine(), "draft_model": args.draft_model,
           "per_split": args.per_split, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
           "seconds": round(time.monotonic() - t0, 1), "splits": splits}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
