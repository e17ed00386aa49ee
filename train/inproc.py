"""Speculative decoding over in-process engines (no gRPC): the loop of docs/architecture.md §5
reduced to what evaluation and benchmarks need (EOS and max_tokens stops; no stop strings, no
detokenization).
The serving loop with recovery, fallback and streaming is gateway/generation.py."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from runtime.draft_tree import DraftTree
from runtime.sampling import SamplingConfig
from services.common.hooks import NO_HOOKS, ServiceHooks
from services.draft.config import DraftConfig
from services.draft.drafter import make_drafter
from services.draft.engine import DraftEngine, ProposeCall
from services.target.config import TargetConfig
from services.target.engine import PrefillCall, TargetEngine
from services.target.hooks import NO_TARGET_HOOKS, TargetHooks
from services.target.worker import TargetWorker


@dataclass
class SpecResult:
    tokens: list[int]
    steps: int = 0                                   # verify steps after the prefill
    accepted: list[int] = field(default_factory=list)   # accepted drafts per step
    seconds: float = 0.0
    draft_seconds: float = 0.0                       # awaiting Propose (queue + forward)
    verify_seconds: float = 0.0                      # awaiting Verify (queue + forward)

    @property
    def tau(self) -> float:
        """Committed tokens per verify step, bonus included."""
        return (sum(self.accepted) + self.steps) / max(1, self.steps)


@dataclass
class Engines:
    target: TargetEngine
    draft: DraftEngine | None

    def stop(self) -> None:
        self.target.stop()
        if self.draft is not None:
            self.draft.stop()


def start_engines(target_cfg: TargetConfig, draft_cfg: DraftConfig | None,
                  target_hooks: TargetHooks = NO_TARGET_HOOKS,
                  draft_hooks: ServiceHooks = NO_HOOKS) -> Engines:
    """hooks: benchmarks (random weights, forced acceptance; services/common/hooks.py)."""
    target = TargetEngine(TargetWorker.started(target_cfg, target_hooks))
    target.start()
    draft = None
    if draft_cfg is not None:
        drafter = make_drafter(draft_cfg, draft_hooks.random_weights)
        drafter.init_backend()
        draft = DraftEngine(drafter, draft_cfg)
        draft.start()
    return Engines(target, draft)


async def speculate(engines: Engines, seq_id: str, prompt: list[int], max_new: int, block: int,
                    sampling: SamplingConfig, eos: set[int], tree_nodes: int = 0) -> SpecResult:
    """Greedy or sampled generation of up to max_new tokens; block 1 = autoregressive.
    tree_nodes > 0: each step drafts a tree of that many nodes, at most b-1 deep (greedy: the
    target's greedy path; sampled: recursive rejection sampling, runtime/tree_sampling.py)."""
    t0 = time.perf_counter()
    draft = engines.draft if block > 1 else None
    facts = draft.drafter.facts if draft is not None else None
    layers = tuple(facts.target_layer_ids) if facts and facts.needs_features else ()
    fdtype = getattr(torch, facts.feature_dtype) if facts else torch.bfloat16
    pre = await engines.target.prefill(PrefillCall(seq_id, prompt, sampling, layers, fdtype))
    res = SpecResult(tokens=[pre.next_token])
    new_ids, new_feats, start = list(prompt), pre.features, 0
    try:
        while res.tokens[-1] not in eos and len(res.tokens) < max_new:
            b = min(block, max_new - len(res.tokens) + 1)
            drafts: list[int] = []
            parents: list[int] = []
            t0_step = time.perf_counter()
            if draft is not None and b > 1:
                proposal = await draft.propose(ProposeCall(
                    seq_id, start, len(new_ids), new_feats, new_ids, res.tokens[-1], b,
                    tree_nodes))
                start += len(new_ids)
                drafts, parents = proposal.draft_tokens, proposal.draft_parents
            anchor = res.tokens[-1]
            t1_step = time.perf_counter()
            tree = DraftTree(drafts, parents) if parents else None
            v = await engines.target.verify(seq_id, [anchor] + drafts, tree)
            res.draft_seconds += t1_step - t0_step
            res.verify_seconds += time.perf_counter() - t1_step
            res.steps += 1
            res.accepted.append(v.accepted)
            new_ids, new_feats = [anchor] + v.committed[:-1], v.features
            res.tokens.extend(v.committed)
    finally:
        await engines.target.release(seq_id)
        if draft is not None:
            await draft.release(seq_id)
    cut = next((i + 1 for i, t in enumerate(res.tokens) if t in eos), len(res.tokens))
    res.tokens = res.tokens[: min(cut, max_new)]
    res.seconds = time.perf_counter() - t0
    return res
