"""Step 2 of training: the target's tapped-layer features for whole sequences, its greedy next
token at every position and (for soft labels) its LM head's input there, computed on the fly
(frozen target, one batched forward)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.attention.metadata import SeqSlice
from train.target_runner import TargetRunner


@dataclass
class SequenceFeatures:
    feats: torch.Tensor                # [S, Lmax, K*H]; rows past a sequence's end are zero
    greedy: torch.Tensor | None        # int64 [S, Lmax]: the target's argmax after position t
    final: torch.Tensor | None = None  # [S, Lmax, H]: the target's normed last hidden at t (its
                                       # LM head's input: logits of the token after t)


class FeatureExtractor:
    def __init__(self, target_dir: str, layers: tuple[int, ...], max_tokens: int,
                 dtype: torch.dtype, device: str, backend: str = "torch") -> None:
        self.runner = TargetRunner(target_dir, max_tokens, dtype, device, backend)
        self.layers = layers
        self.dtype = dtype

    @property
    def width(self) -> int:
        """K*H: one token's features."""
        return len(self.layers) * self.hidden_size

    @property
    def hidden_size(self) -> int:
        """H: the target's hidden size (one tapped layer, or the LM head's input)."""
        return self.runner.model.cfg.hidden_size

    @torch.inference_mode()
    def __call__(self, seqs: list[list[int]], greedy: bool = True, final: bool = False
                 ) -> SequenceFeatures:
        """greedy=False skips the LM head (features only, e.g. for evaluation); final=True also
        returns the LM head's input at each position."""
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
        last = out.hidden.new_zeros(len(seqs), lmax, out.hidden.shape[-1]) if final else None
        offset = 0
        for i, s in enumerate(seqs):
            feats[i, : len(s)] = out.captured[offset: offset + len(s)]
            if nxt is not None:
                nxt[i, : len(s)] = argmax[offset: offset + len(s)]
            if last is not None:
                last[i, : len(s)] = out.hidden[offset: offset + len(s)]
            offset += len(s)
        return SequenceFeatures(feats, nxt, last)


class FeatureCache:
    """Every training sequence's features (and greedy chain, LM head inputs) computed once, kept
    on the device: the target is frozen, so each epoch would recompute the same tensors. Rows of
    all sequences are packed into one [N+1, K*H] tensor (the last row is zeros, the padding)."""

    def __init__(self, extractor: FeatureExtractor, seqs: list[list[int]], batch: int,
                 greedy: bool, final: bool = False) -> None:
        if not seqs:
            raise ValueError("no training sequences to compute features for")
        lens = [len(s) for s in seqs]
        self.offsets = [0]
        for n in lens:
            self.offsets.append(self.offsets[-1] + n)
        self.lengths = lens
        self.feats = torch.zeros(self.offsets[-1] + 1, extractor.width, dtype=extractor.dtype,
                                 device=extractor.runner.device)
        self.greedy = torch.zeros(self.offsets[-1] + 1, dtype=torch.long,
                                  device=extractor.runner.device) if greedy else None
        self.final = torch.zeros(self.offsets[-1] + 1, extractor.hidden_size,
                                 dtype=extractor.dtype, device=extractor.runner.device) \
            if final else None
        order = sorted(range(len(seqs)), key=lambda i: lens[i])   # similar lengths per forward
        for j in range(0, len(order), batch):
            chunk = order[j: j + batch]
            out = extractor([seqs[i] for i in chunk], greedy=greedy, final=final)
            for row, i in enumerate(chunk):
                a, b = self.offsets[i], self.offsets[i + 1]
                self.feats[a:b] = out.feats[row, : lens[i]]
                if self.greedy is not None:
                    self.greedy[a:b] = out.greedy[row, : lens[i]]
                if self.final is not None:
                    self.final[a:b] = out.final[row, : lens[i]]

    def __call__(self, indices: list[int]) -> SequenceFeatures:
        """The features of sequences `indices`, padded as FeatureExtractor returns them."""
        lmax = max(self.lengths[i] for i in indices)
        pad = self.feats.shape[0] - 1
        rows = torch.full((len(indices), lmax), pad, dtype=torch.long)
        for r, i in enumerate(indices):
            rows[r, : self.lengths[i]] = torch.arange(self.offsets[i], self.offsets[i + 1])
        rows = rows.to(self.feats.device)
        greedy = self.greedy[rows] if self.greedy is not None else None
        final = self.final[rows] if self.final is not None else None
        return SequenceFeatures(self.feats[rows], greedy, final)

    @staticmethod
    def nbytes(extractor: FeatureExtractor, seqs: list[list[int]], final: bool = False) -> int:
        """Device memory the features (and LM head inputs) of `seqs` take."""
        width = extractor.width + (extractor.hidden_size if final else 0)
        return sum(len(s) for s in seqs) * width * extractor.dtype.itemsize
