"""The mamba side of HybridAttnBackend: per forward, which pool slots each sequence reads and
writes, the gather/scatter around Mamba2Mixer.scan, and the verify-time commit.

Per forward each sequence is in one of two modes:
  advance  prefill chunks, decode steps and 1-token verify blocks: the live state moves to the
           last token (a 1-token block's only token, the anchor, is always committed).
  verify   blocks of 2+ tokens: the live state is left alone; the window and SSM state after
           each block position i go to the sequence's verify slot at index i. A tree of drafts
           (the metadata's tree mask): each position continues its parent's state
           (runtime/layers/tree_scan.py), so index i holds the state after i's whole path.
After acceptance, commit_verified_state([(slot, a), ...]) copies index a (the last committed
block position: the accepted path's last node in a tree) into the live state - it must run
before the next forward's plan replaces this one. MambaStatePath cannot commit (it has no commit_verified_state, so a HybridAttnBackend
around it reports can_commit_mamba_state() False); MambaStateBackend can."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.attention.metadata import AttentionMetadata
from runtime.layers.mamba2 import Mamba2Mixer
from runtime.layers.tree_scan import parents_from_mask
from runtime.state_pool import MambaStatePool


class MissingVerifyStates(RuntimeError):
    """A verify block of 2+ tokens on a sequence that holds no verify slot."""


@dataclass(frozen=True)
class ScanGroup:
    """Sequences scanned together: same length and mode.
    rows [b, L] token indices in the flattened forward; slots / verify_slots [b]."""
    keep_states: bool
    rows: torch.Tensor
    slots: torch.Tensor
    verify_slots: torch.Tensor | None
    parents: torch.Tensor | None = None     # [b, L] each row's parent row, when a member
                                            # verifies a tree (chains: j - 1); None: chains


@dataclass(frozen=True)
class StatePlan:
    meta: AttentionMetadata
    groups: list[ScanGroup]
    verified: dict[int, tuple[int, int]]    # live slot -> (verify slot, block length)
    advanced: frozenset[int]                # live slots of 1-token verify blocks


class MambaStatePath:
    def __init__(self, pool: MambaStatePool) -> None:
        self.pool = pool
        self._plan: StatePlan | None = None

    def plan(self, meta: AttentionMetadata, state_slots: list[int], verify: list[bool]) -> None:
        """Before each forward: state_slots[i] is sequence i's live slot, verify[i] whether its
        tokens are a verify block (see the modules' docstring)."""
        if len(state_slots) != meta.batch_size or len(verify) != meta.batch_size:
            raise ValueError(f"{len(state_slots)} state slots / {len(verify)} verify flags for "
                             f"a batch of {meta.batch_size} sequences")
        keyed: dict[tuple[bool, int], list[Member]] = {}
        verified, advanced, start = {}, set(), 0
        trees = meta.tree_masks or [None] * meta.batch_size
        for slot, is_verify, q_len, tree in zip(state_slots, verify, meta.q_lens, trees):
            keep, vslot = self._mode(slot, is_verify, q_len)
            if keep:
                verified[slot] = (vslot, q_len)
            elif is_verify:
                advanced.add(slot)
            parents = parents_from_mask(tree) if keep and tree is not None else None
            keyed.setdefault((keep, q_len), []).append(Member(start, slot, vslot, parents))
            start += q_len
        device = self.pool.ssm.device
        groups = [_group(keep, q_len, members, device) for (keep, q_len), members in keyed.items()]
        self._plan = StatePlan(meta, groups, verified, frozenset(advanced))

    def _mode(self, slot: int, is_verify: bool, q_len: int) -> tuple[bool, int | None]:
        if slot is None or slot not in self.pool.owner:
            raise ValueError(f"state slot {slot} is not allocated")
        if not is_verify or q_len == 1:
            return False, None
        if q_len > self.pool.max_block_size:
            raise ValueError(f"verify block of {q_len} tokens exceeds the "
                             f"{self.pool.max_block_size} intermediate states per verify slot")
        vslot = self.pool.verify_slot(slot)
        if vslot is None:
            raise MissingVerifyStates(f"state slot {slot} holds no verify slot, so a verify block "
                                      f"of {q_len} tokens has nowhere to keep its intermediate "
                                      f"states")
        return True, vslot

    def prepare(self, meta: AttentionMetadata) -> None:
        if self._plan is None or self._plan.meta is not meta:
            raise RuntimeError("a hybrid forward needs model.set_state_context(meta, ...) for the "
                               "same metadata before the backend's prepare(meta)")

    def forward(self, mixer: Mamba2Mixer, xbc: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        """xbc [T, C], dt [T, nh] of the planned forward -> y [T, nh*hd] fp32; reads and writes
        this layer's states in the pool."""
        pool, layer = self.pool, mixer.state_index
        y = torch.empty(xbc.shape[0], mixer.cfg.intermediate_size, dtype=torch.float32,
                        device=xbc.device)
        for g in self._plan.groups:
            out = mixer.scan(pool.conv[layer, g.slots], pool.ssm[layer, g.slots], xbc[g.rows],
                             dt[g.rows], g.keep_states, g.parents)
            y[g.rows.flatten()] = out.y.flatten(0, 1)
            if g.keep_states:
                q_len = g.rows.shape[1]
                pool.verify_conv[layer, g.verify_slots, :q_len] = out.conv.to(pool.conv.dtype)
                pool.verify_ssm[layer, g.verify_slots, :q_len] = out.ssm
            else:
                pool.conv[layer].index_copy_(0, g.slots, out.conv.to(pool.conv.dtype))
                pool.ssm[layer].index_copy_(0, g.slots, out.ssm)
        return y


class MambaStateBackend(MambaStatePath):
    def commit_verified_state(self, commits: list[tuple[int, int]]) -> None:
        """(live slot, last committed block index) per sequence of the last verify forward:
        the verify states at that index become the live state, in every mamba layer."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("commit_verified_state before any forward")
        slots, vslots, index = [], [], []
        for slot, last in commits:
            if slot in plan.advanced and last == 0:
                continue                        # 1-token block: already advanced in place
            if slot not in plan.verified:
                raise ValueError(f"state slot {slot} was not verified in the last forward")
            vslot, q_len = plan.verified[slot]
            if not 0 <= last < q_len:
                raise ValueError(f"commit index {last} outside the verified block of {q_len}")
            slots.append(slot), vslots.append(vslot), index.append(last)
        if not slots:
            return
        device = self.pool.ssm.device
        s, v, i = (torch.tensor(x, dtype=torch.int64, device=device)
                   for x in (slots, vslots, index))
        self.pool.conv[:, s] = self.pool.verify_conv[:, v, i]
        self.pool.ssm[:, s] = self.pool.verify_ssm[:, v, i]


@dataclass(frozen=True)
class Member:
    """One sequence of a scan group: its first row in the forward, live and verify slots, and
    its tree's parent rows (None: a chain, or not a verify)."""
    start: int
    slot: int
    vslot: int | None
    parents: list[int] | None = None


def _group(keep: bool, q_len: int, members: list[Member], device: torch.device) -> ScanGroup:
    rows = torch.tensor([[m.start + j for j in range(q_len)] for m in members],
                        dtype=torch.int64, device=device)
    slots = torch.tensor([m.slot for m in members], dtype=torch.int64, device=device)
    vslots = (torch.tensor([m.vslot for m in members], dtype=torch.int64, device=device)
              if keep else None)
    parents = None
    if any(m.parents is not None for m in members):
        chain = list(range(-1, q_len - 1))
        parents = torch.tensor([m.parents if m.parents is not None else chain for m in members],
                               dtype=torch.int64, device=device)
    return ScanGroup(keep, rows, slots, vslots, parents)
