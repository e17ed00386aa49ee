"""Step 2 of training: the target's tapped-layer features for whole sequences, and its greedy
next token at every position, computed on the fly (frozen target, one batched forward)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.attention.metadata import SeqSlice
from services.draft.training.target_runner import TargetRunner


@dataclass
class SequenceFeatures:
    feats: torch.Tensor                # [S, Lmax, K*H]; rows past a sequence's end are zero
    greedy: torch.Tensor | None        # int64 [S, Lmax]: the target's argmax after position t


class FeatureExtractor:
    def __init__(self, target_dir: str, layers: tuple[int, ...], max_tokens: int,
                 dtype: torch.dtype, device: str, backend: str = "torch") -> None:
        self.runner = TargetRunner(target_dir, max_tokens, dtype, device, backend)
        self.layers = layers

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]], greedy: bool = True) -> SequenceFeatures:
        """greedy=False skips the LM head (features only, e.g. for evaluation)."""
        runner = self.runner
        tables = runner.tables([len(s) for s in seqs])
        try:
            ids = torch.tensor([i for s in seqs for i in s], device=runner.device)
            out = runner.forward([SeqSlice(t, 0, len(s)) for t, s in zip(tables, seqs)], ids,
                                 self.layers)
        finally:
            runner.release(tables)
        argmax = runner.greedy(out.hidden) if greedy else None
        lmax = max(len(s) for s in seqs)
        feats = out.captured.new_zeros(len(seqs), lmax, out.captured.shape[-1])
        nxt = torch.zeros(len(seqs), lmax, dtype=torch.long, device=runner.device) \
            if greedy else None
        offset = 0
        for i, s in enumerate(seqs):
            feats[i, : len(s)] = out.captured[offset: offset + len(s)]
            if nxt is not None:
                nxt[i, : len(s)] = argmax[offset: offset + len(s)]
            offset += len(s)
        return SequenceFeatures(feats, nxt)
