"""One engine iteration's forward, planned: the works admitted to it, their tokens flattened in
order, the positions they run at, each sequence's slice of the KV cache, and the rows of the
forward whose logits are needed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.attention.metadata import SeqSlice
from runtime.penalties import apply_penalties
from runtime.sampling import suppress_tokens
from runtime.token_mask import apply_masks
from services.common.engine_loop import Work
from services.target.calls import PrefillCall, VerifyCall
from services.target.sequence import TargetSequence


@dataclass(frozen=True)
class Scheduled:
    """A work admitted to this iteration's forward: n of its tokens run, for `seq`."""
    work: Work
    n: int
    seq: TargetSequence

    @property
    def is_verify(self) -> bool:
        return self.work.kind == "verify"

    @property
    def verify(self) -> VerifyCall:
        return self.work.payload

    @property
    def prefill(self) -> PrefillCall:
        return self.work.payload

    @property
    def start(self) -> int:
        """Position of its first token (a prefill chunk continues where the last one ended)."""
        return self.seq.seq_len if self.is_verify else self.work.done_tokens

    @property
    def finishes(self) -> bool:
        """Its answer comes from this forward: a verify, or the prompt's last chunk."""
        return self.is_verify or self.start + self.n == len(self.prefill.token_ids)

    @property
    def logit_rows(self) -> int:
        """Rows it needs logits for: every block row of a verify, the last prompt token."""
        return self.n if self.is_verify else int(self.finishes)

    def outputs_before_rows(self) -> list[list[int]]:
        """Per logits row, the outputs without KV before the position it predicts: a verify's
        anchor and the drafts on the way to the row (a chain: those before it; a tree: the
        node's ancestors and itself); none for a prefill's row."""
        if not self.is_verify:
            return [[] for _ in range(self.logit_rows)]
        tokens, tree = self.verify.tokens, self.verify.tree
        if tree is None:
            return [tokens[: i + 1] for i in range(self.n)]
        paths = [[tokens[0]]]
        for i, p in enumerate(tree.parents, start=1):
            paths.append(paths[p] + [tokens[i]])
        return paths


@dataclass(frozen=True)
class Part:
    item: Scheduled
    row: int                  # its first row in the forward (hidden states, features)
    logit_row: int            # its first row in the batch's logits


@dataclass(frozen=True)
class BatchPlan:
    parts: list[Part]
    ids: list[int]            # [T] every part's tokens, flattened in order
    positions: list[int]      # [T] a tree's nodes run at (context + depth)
    slices: list[SeqSlice]
    logit_rows: list[int]     # forward rows whose logits are computed, in order
    capture: tuple[int, ...]  # feature layers any sequence asked for, sorted

    @staticmethod
    def build(items: list[Scheduled], pad_to: int = 0) -> BatchPlan:
        """pad_to: every item is a chain verify of at most pad_to tokens, or the batch is one
        prompt chunk; each runs pad_to rows (its tokens, then copies of its last token at the
        next positions: causal attention keeps them out of the real rows, their K/V lands past
        the committed length - trimmed with the rejected drafts', or where the prompt's next
        chunk writes its own), so that the batch fits one captured graph."""
        parts, ids, positions, slices, logit_rows = [], [], [], [], []
        capture = BatchPlan.capture_of(items)
        for item in items:
            parts.append(Part(item, len(ids), len(logit_rows)))
            start, tree = item.start, None
            if item.is_verify:
                ids.extend(item.verify.tokens)
                positions.extend(start + d for d in item.verify.depths)
                tree = item.verify.tree.ancestor_mask() if item.verify.tree is not None else None
            else:
                ids.extend(item.prefill.token_ids[start: start + item.n])
                positions.extend(range(start, start + item.n))
            last = len(ids) - item.logit_rows
            logit_rows.extend(range(last, len(ids)))
            rows = max(pad_to, item.n)
            ids.extend(ids[-1:] * (rows - item.n))
            positions.extend(range(start + item.n, start + rows))
            slices.append(SeqSlice(item.seq.table, start, rows, tree))
        return BatchPlan(parts, ids, positions, slices, logit_rows, capture)

    @staticmethod
    def capture_of(items: list[Scheduled]) -> tuple[int, ...]:
        """The feature layers any of the items' sequences asked for, sorted."""
        return tuple(sorted({layer for i in items for layer in i.seq.capture_layers}))

    def apply_penalties(self, logits: torch.Tensor) -> None:
        """In place: each penalizing sequence's rows, with its own counts per row
        (runtime/penalties.py)."""
        for part in self.parts:
            item = part.item
            state = item.seq.penalties
            if state is not None and item.logit_rows:
                apply_penalties(logits[part.logit_row: part.logit_row + item.logit_rows], state,
                                item.seq.sampling.penalties, item.outputs_before_rows())

    def apply_token_masks(self, logits: torch.Tensor) -> None:
        """Structured output: in place, each logits row of a masked work keeps only the tokens
        its mask allows (a verify: one mask per block row; a finishing prefill: its one row)."""
        rows: list[int] = []
        masks: list[bytes] = []
        for part in self.parts:
            item = part.item
            given = (item.verify.token_masks if item.is_verify else
                     (item.prefill.token_mask,) if item.finishes and item.prefill.token_mask
                     else ())
            rows.extend(range(part.logit_row, part.logit_row + len(given)))
            masks.extend(given)
        apply_masks(logits, rows, masks)

    def suppress_stop_tokens(self, logits: torch.Tensor, eos_ids: list[int]) -> None:
        """min_tokens: in place, forbids a sequence's stop tokens (EOS and its stop_token_ids)
        in the logits rows that predict outputs below its minimum; a block row predicts output
        num_generated + its depth."""
        for part in self.parts:
            seq, item, row = part.item.seq, part.item, part.logit_row
            stops = sorted(set(eos_ids) | set(seq.sampling.stop_token_ids)) \
                if seq.sampling.min_tokens > 0 else []
            if not stops or not item.logit_rows:
                continue
            if item.is_verify and item.verify.tree is not None:
                below = seq.suppress_rows(item.n)
                for i, depth in enumerate(item.verify.depths):
                    if depth < below:
                        suppress_tokens(logits[row + i: row + i + 1], stops, 1)
            else:
                rows = item.logit_rows
                suppress_tokens(logits[row: row + rows], stops, seq.suppress_rows(rows))
