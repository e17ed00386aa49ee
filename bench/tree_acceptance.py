"""python -m bench.tree_acceptance --work DIR: how many tokens a verify step would commit if the
target checked a tree of drafts instead of the one greedy block (greedy, simulated on the CPU).

The drafter proposes, at every block position k = 1..B-1, a distribution q_k over the vocabulary
given the context and the anchor (not given the drafts before it: one parallel forward). A tree
of N nodes takes the N token prefixes with the largest product of those marginals, q_1(t_1) x
... x q_i(t_i) (prefix-closed: a prefix scores at least what its extensions do); the target
verifies all N nodes in one forward under a tree attention mask and commits the longest path
that equals its own greedy chain, plus its bonus token. The chain the service verifies today is
the one path of argmax drafts. Along the target's greedy held-out answers, from the answer's
start, the loop hops p -> p + a(p) + 1 with each policy's own accepted length a(p), as
bench.anchor_positions does for the chain. Exactness is untouched at T = 0 (the committed path is
the target's own chain); at T > 0 a tree needs multi-draft rejection sampling (SpecInfer), which
this does not simulate. Writes JSON to --out. --tiny: as in bench.anchor_positions (a few greedy
answers generated on the spot), budgets 0, 7, 3/3 (a smoke test)."""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from datetime import date

import torch

from bench.anchor_positions import (
    add_held_out_args,
    blocks_everywhere,
    cpu_models,
    held_out,
    summary,
    tiny_held_out,
)
from bench.report import machine, write_json
from runtime.draft_tree import best_prefixes
from runtime.models.dflash import TargetHead
from train.generate import Example

TOP_K = 16                      # candidates kept per draft position (enough for N <= 256)
CHUNK = 64                      # anchors per logits pass: [CHUNK, B-1, V] fp32 at a time


def ranked_drafts(head: TargetHead, hidden: torch.Tensor, labels: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [1, nb, B, H], labels [1, nb, B-1] -> (log q_k of each position's TOP_K drafts,
    best first [nb, B-1, TOP_K]; the label's rank among them [nb, B-1], TOP_K where it is not
    among them or the position has no label)."""
    h = hidden[0, :, 1:]
    logps, ranks = [], []
    for i in range(0, h.shape[0], CHUNK):
        part = h[i: i + CHUNK]                                   # [n, B-1, H]
        lp = torch.log_softmax(head.logits(part.reshape(-1, part.shape[-1])), -1)
        top = lp.topk(TOP_K, dim=-1)
        idx = top.indices.view(*part.shape[:2], TOP_K)
        lab = labels[0, i: i + CHUNK, :, None]                   # [n, B-1, 1]
        hit = (idx == lab) & (lab >= 0)
        rank = torch.where(hit.any(-1), hit.int().argmax(-1), torch.full_like(lab[..., 0], TOP_K))
        logps.append(top.values.view(*part.shape[:2], TOP_K))
        ranks.append(rank)
    return torch.cat(logps), torch.cat(ranks)


def tree_accepted(logp: list[list[float]], label_ranks: list[int], n: int) -> int:
    """How many drafts a tree of n nodes gets accepted: the longest label prefix in the tree.
    n = 0 is the chain of argmax drafts (B-1 nodes)."""
    if n == 0:
        a = 0
        while a < len(label_ranks) and label_ranks[a] == 0:
            a += 1
        return a
    tree = set(best_prefixes(logp, n))
    a = 0
    while a < len(label_ranks) and tuple(label_ranks[: a + 1]) in tree:
        a += 1
    return a


@dataclass(frozen=True)
class Budget:
    """A verify policy: a tree of `nodes` drafts (0 = the chain of argmax drafts) no deeper than
    `depth` draft positions (the block size the service verifies, minus its anchor)."""
    nodes: int
    depth: int

    @staticmethod
    def parse(text: str, block: int) -> Budget:
        """"N" or "N/D" (D defaults to the drafter's B-1)."""
        n, _, d = text.partition("/")
        return Budget(int(n), int(d) if d else block - 1)

    @property
    def name(self) -> str:
        return f"{self.nodes}/{self.depth}"

    @property
    def verify_tokens(self) -> int:
        return 1 + (self.nodes or self.depth)


def measure_split(draft, head, extractor, examples: list[Example], budgets: list[Budget]
                  ) -> dict:
    loop: dict[Budget, list[int]] = {b: [] for b in budgets}
    for e in examples:
        if len(e.response_ids) < 2:
            continue
        hidden, labels, _ = blocks_everywhere(draft, head, extractor, e)
        with torch.no_grad():
            logp, ranks = ranked_drafts(head, hidden, labels)
        logp_l, ranks_l = logp.tolist(), ranks.tolist()
        for b in budgets:
            p = 0                                  # the loop from the answer's start
            while p < len(ranks_l):
                a = tree_accepted(logp_l[p][: b.depth], ranks_l[p][: b.depth], b.nodes)
                loop[b].append(a)
                p += a + 1
    return {"sequences": len(examples),
            "trees": {b.name: {"nodes": b.nodes or b.depth, "depth": b.depth,
                               "verify_tokens": b.verify_tokens, **summary(v)}
                      for b, v in loop.items()}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_held_out_args(ap, per_split=128, max_new_tokens=96)
    ap.add_argument("--budgets", default="0,15,31,63,127,255,0/3,3/3,7,7/4",
                    help="verify policies: N or N/D, a tree of N draft nodes at most D deep "
                    "(0 = the chain of argmax drafts; D defaults to the block size - 1)")
    ap.add_argument("--out", default="bench/results/drafter_tree_acceptance_96.json")
    args = ap.parse_args(argv)
    tiny_held_out(ap, args, "tree_acceptance")
    if args.tiny and args.budgets == ap.get_default("budgets"):
        args.budgets = "0,7,3/3"
    draft, head, extractor = cpu_models(args.draft_model)
    budgets = [Budget.parse(b, draft.cfg.block_size) for b in args.budgets.split(",")]
    t0 = time.monotonic()
    splits = {}
    for split in ("eval_in", "eval_unseen"):
        examples = held_out(args.work, split, args.per_split, args.max_new_tokens, args.seed)
        splits[split] = measure_split(draft, head, extractor, examples, budgets)
        print(split, json.dumps({n: t["tau"] for n, t in splits[split]["trees"].items()}),
              flush=True)
    out = {"date": str(date.today()), "machine": machine(), "draft_model": args.draft_model,
           "per_split": args.per_split, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
           "top_k_per_position": TOP_K, "seconds": round(time.monotonic() - t0, 1),
           "splits": splits}
    write_json(args.out, out, args)


if __name__ == "__main__":
    main()
