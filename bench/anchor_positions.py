"""python -m bench.anchor_positions --work DIR: where along the target's greedy held-out answers a
drafter is accepted, and where the speculative loop starts its blocks.

For every answer position p the drafter's block is drafted once (context = target features
before p) and its accepted length a(p) read against the answer. Three sets of anchors are then
compared: every position ("uniform", what `train-draft` samples by default), the positions the
greedy speculative loop visits from the answer's start (p -> p + a(p) + 1, what τ is measured
on), and one or two such hops from every position (what `--loop-hops 1` / `2` train on). Also
τ by offset in the answer (16-token buckets), and the first draft's acceptance by how sure the
target is of its own next token there (and how often a rejected first draft was the target's
second choice). CPU, fp32 features. Writes JSON to --out.

--tiny (here and in bench.tree_acceptance): --work defaults to a folder of a few greedy SmolLM2
answers generated on the spot (bench/tiny.py, with train/generate.py), 2 per split, cut to 24
tokens (a smoke test; --out defaults to a temporary folder)."""
from __future__ import annotations

import argparse
import json
import time
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path

import torch

from bench.report import machine, write_json
from runtime.models.dflash import TargetHead, load_dflash
from train.blocks import accepted_drafts, block_inputs, draft_hidden
from train.evaluate import default_target
from train.features import FeatureExtractor
from train.generate import Example, load_examples, shuffled


@dataclass
class AnswerDrafts:
    """Per answer position p = prompt_len .. len-2 (index 0 is the answer's start)."""
    accepted: list[int]      # a(p): the drafts of the block anchored at p that the target accepts
    target_next: list[int]    # the target's most likely next token (on a greedy answer, the label)
    target_top1: list[float]  # its probability
    second_choice: list[bool]  # the draft at k = 1 is the target's second most likely token


def blocks_everywhere(draft, head, extractor, example: Example
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter's block anchored at every answer position p = prompt_len .. len-2:
    (hidden [1, nb, B, H], labels [1, nb, B-1] from the answer, the target's final hidden
    states [1, L, H])."""
    seq = example.ids
    p0 = len(example.prompt_ids)
    out = extractor([seq], greedy=False, final=True)
    ids, lens = torch.tensor([seq]), torch.tensor([len(seq)])
    anchors = torch.arange(p0, len(seq) - 1)[None]
    bids, bpos, labels = block_inputs(ids, anchors, draft.cfg.block_size,
                                      draft.cfg.mask_token_id, lens)
    with torch.no_grad():
        hidden = draft_hidden(draft, head, out.feats, bids, bpos)
    return hidden, labels, out.final


def drafts_everywhere(draft, head, extractor, example: Example) -> AnswerDrafts:
    """The drafter's block at every answer position, read against the answer."""
    seq = example.ids
    p0 = len(example.prompt_ids)
    hidden, labels, final = blocks_everywhere(draft, head, extractor, example)
    with torch.no_grad():
        accepted = accepted_drafts(hidden, labels, head)[0]
        first = head.greedy(hidden[0, :, 1])                            # [nb] drafts at k = 1
        top = head.logits(final[0, p0: len(seq) - 1]).softmax(-1).topk(2, dim=-1)  # [nb, 2]
    return AnswerDrafts(accepted.tolist(), top.indices[:, 0].tolist(), top.values[:, 0].tolist(),
                        (first == top.indices[:, 1]).tolist())


def by_target_confidence(drafts: list[tuple[int, float, bool]],
                         edges: tuple[float, ...] = (0.3, 0.5, 0.7, 0.9)) -> dict[str, dict]:
    """(accepted, target top-1 probability, k=1 draft is the target's #2) at some anchors ->
    per band of the target's confidence in its next token: the share of anchors in it, the
    acceptance at k = 1, and how often a rejected first draft was the target's second choice."""
    bounds = (0.0, *edges, 1.0)
    bands: dict[str, list[tuple[int, bool]]] = defaultdict(list)
    for a, p1, second in drafts:
        i = bisect_right(edges, p1)                 # p1 in [bounds[i], bounds[i+1]), 1.0 in the last
        bands[f"{bounds[i]:.1f}-{bounds[i + 1]:.1f}"].append((a, second))
    n = max(1, len(drafts))
    out = {}
    for band, rows in sorted(bands.items()):
        rejected = [second for a, second in rows if a == 0]
        out[band] = {"share": round(len(rows) / n, 4),
                     "acceptance_k1": round(sum(a >= 1 for a, _ in rows) / len(rows), 4),
                     "rejected_k1_is_target_second": round(sum(rejected) / max(1, len(rejected)),
                                                           4)}
    return out


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
    confidence: dict[str, list[tuple[int, float, bool]]] = {"uniform": [], "loop": []}
    for e in examples:
        if len(e.response_ids) < 2:
            continue
        d = drafts_everywhere(draft, head, extractor, e)
        acc = d.accepted
        visited = loop_offsets(acc)
        uniform += [(off, a) for off, a in enumerate(acc)]
        loop += [(off, acc[off]) for off in visited]
        for name, offsets in (("uniform", range(len(acc))), ("loop", visited)):
            confidence[name] += [(acc[o], d.target_top1[o], d.second_choice[o]) for o in offsets]
        for hops, into in ((1, hop1), (2, hop2)):
            for p in range(len(acc)):
                q = hop(acc, p, hops)
                if q is not None:
                    into.append((q, acc[q]))
    return {"sequences": len(examples),
            "anchors": {name: summary([a for _, a in pairs]) for name, pairs in
                        (("uniform", uniform), ("loop", loop), ("one_hop", hop1),
                         ("two_hops", hop2))},
            "loop_by_offset": by_offset(loop), "uniform_by_offset": by_offset(uniform),
            "first_position_by_target_confidence": {
                name: by_target_confidence(rows) for name, rows in confidence.items()}}


def cpu_models(draft_model: str) -> tuple:
    """(the drafter, the target's head, a feature extractor of its taps): CPU, fp32."""
    target = str(default_target("float32"))
    draft = load_dflash(Path(draft_model), torch.float32, "cpu")
    head = TargetHead.load(target, torch.float32, "cpu")
    extractor = FeatureExtractor(target, draft.cfg.target_layer_ids, 4096, torch.float32, "cpu")
    return draft, head, extractor


def add_held_out_args(ap: argparse.ArgumentParser, per_split: int, max_new_tokens: int) -> None:
    """--work, --draft-model, --per-split, --max-new-tokens, --seed (held_out, cpu_models);
    --tiny (tiny_held_out)."""
    ap.add_argument("--work", help="folder with the held-out greedy answers "
                    "({eval_in,eval_unseen}_t0.0.jsonl, as train-draft writes them; required "
                    "but with --tiny)")
    ap.add_argument("--draft-model", default="models/smollm2-135m-instruct-dflash")
    ap.add_argument("--per-split", type=int, default=per_split)
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                    help="cut answers (0 = as generated)")
    ap.add_argument("--seed", type=int, default=0)
    from bench.tiny import add_tiny_flag
    add_tiny_flag(ap)


def tiny_held_out(ap: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> None:
    """After parsing add_held_out_args' flags: --work is required but with --tiny, where it
    defaults to a few greedy answers generated now, 2 per split (and --out goes to a temporary
    folder unless given)."""
    from bench.tiny import greedy_answers_work, tiny_outputs
    if not args.work and not args.tiny:
        ap.error("the following arguments are required: --work")
    tiny_outputs(args, ap, name, ("out",))
    if args.tiny:
        args.per_split = min(args.per_split, 2)
        if not args.work:
            args.work = str(greedy_answers_work(Path(args.out).parent / f"{name}-work",
                                                per_split=args.per_split))


def held_out(work: str, split: str, per_split: int, max_new_tokens: int, seed: int
             ) -> list[Example]:
    """A seeded random per_split of a split's greedy answers, cut to max_new_tokens (0: whole)."""
    examples = shuffled(load_examples(Path(work) / f"{split}_t0.0.jsonl"), seed)[:per_split]
    if max_new_tokens:
        examples = [replace(e, response_ids=e.response_ids[:max_new_tokens]) for e in examples]
    return examples


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_held_out_args(ap, per_split=96, max_new_tokens=0)
    ap.add_argument("--out", default="bench/results/drafter_anchor_positions.json")
    args = ap.parse_args(argv)
    tiny_held_out(ap, args, "anchor_positions")
    draft, head, extractor = cpu_models(args.draft_model)
    t0 = time.monotonic()
    splits = {}
    for split in ("eval_in", "eval_unseen"):
        examples = held_out(args.work, split, args.per_split, args.max_new_tokens, args.seed)
        splits[split] = measure_split(draft, head, extractor, examples)
        print(split, json.dumps(splits[split]["anchors"]), flush=True)
    out = {"date": str(date.today()), "machine": machine(), "draft_model": args.draft_model,
           "per_split": args.per_split, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
           "seconds": round(time.monotonic() - t0, 1), "splits": splits}
    write_json(args.out, out, args)


if __name__ == "__main__":
    main()
