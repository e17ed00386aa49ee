"""The recurrent-state pool of hybrid models, beside the paged KV pool.

Per recurrent layer l (Mamba2 or Gated DeltaNet; layer-major, so one layer's slots are one
contiguous tensor; S = the layer's state shape: Mamba2 [nh, hd, N], Gated DeltaNet [nv, dk, dv]):
  conv[l]         [num_slots, C, K-1]          live conv window of each sequence (model dtype)
  ssm[l]          [num_slots, *S]              live recurrent state of each sequence (fp32)
  verify_conv[l]  [num_verify_slots, B, C, K-1]   window after each position of a verify block
  verify_ssm[l]   [num_verify_slots, B, *S]    state after each position of a verify block
B = max_block_size (0 when it is 1: 1-token blocks need no verify states). A sequence holds
one live slot from Prefill to release, and one verify slot when one was free at Prefill
(verify states are B times the live state, so there may be fewer); without one it can only
verify 1-token blocks (those advance the live state directly)."""
from __future__ import annotations

import math

import torch

from runtime.layers.gated_deltanet import GatedDeltaNetConfig
from runtime.layers.mamba2 import Mamba2Config

# what a recurrent layer's states look like: conv_state_shape and ssm_state_shape
StateConfig = Mamba2Config | GatedDeltaNetConfig


def verify_positions(max_block_size: int) -> int:
    """States kept per verify slot: one per block position, none when blocks have 1 token."""
    return max_block_size if max_block_size > 1 else 0


class OutOfStateSlots(Exception):
    """No live state slot is free."""


class MambaStatePool:
    def __init__(self, cfg: StateConfig, num_layers: int, num_slots: int, num_verify_slots: int,
                 max_block_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_slots < 1 or not 1 <= num_verify_slots <= num_slots:
            raise ValueError(f"the state pool needs >= 1 state slots and 1..{num_slots} verify "
                             f"state slots, got {num_slots} and {num_verify_slots}")
        self.cfg, self.num_layers, self.max_block_size = cfg, num_layers, max_block_size
        self.num_slots, self.num_verify_slots = num_slots, num_verify_slots
        conv, ssm = cfg.conv_state_shape, cfg.ssm_state_shape
        per_slot = verify_positions(max_block_size)
        self.conv = torch.zeros((num_layers, num_slots, *conv), dtype=dtype, device=device)
        self.ssm = torch.zeros((num_layers, num_slots, *ssm), dtype=torch.float32, device=device)
        self.verify_conv = torch.zeros((num_layers, num_verify_slots, per_slot, *conv),
                                       dtype=dtype, device=device)
        self.verify_ssm = torch.zeros((num_layers, num_verify_slots, per_slot, *ssm),
                                      dtype=torch.float32, device=device)
        self._free = list(range(num_slots - 1, -1, -1))          # pop() hands out low ids first
        self._free_verify = list(range(num_verify_slots - 1, -1, -1))
        self.owner: dict[int, str] = {}                           # live slot -> sequence id
        self.verify_of: dict[int, int] = {}                       # live slot -> verify slot

    @staticmethod
    def bytes_needed(cfg: StateConfig, num_layers: int, num_slots: int, num_verify_slots: int,
                     max_block_size: int, dtype: torch.dtype) -> int:
        conv = num_layers * math.prod(cfg.conv_state_shape) * dtype.itemsize
        ssm = num_layers * math.prod(cfg.ssm_state_shape) * 4
        return (conv + ssm) * (num_slots + num_verify_slots * verify_positions(max_block_size))

    @property
    def bytes_per_state(self) -> int:
        """One sequence's live state (conv window and SSM state of every layer)."""
        return self.bytes_needed(self.cfg, self.num_layers, 1, 0, self.max_block_size,
                                 self.conv.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.conv, self.ssm, self.verify_conv, self.verify_ssm))

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def used_verify_slots(self) -> int:
        return self.num_verify_slots - len(self._free_verify)

    def usage(self) -> float:
        return self.used_slots / self.num_slots

    def allocate(self, seq_id: str) -> int:
        """A zeroed live slot (and a verify slot when one is free) for a new sequence."""
        if not self._free:
            raise OutOfStateSlots(
                f"recurrent state pool full: all {self.num_slots} state slots are held by live "
                f"sequences; release one (or start the target with more --state-slots)")
        slot = self._free.pop()
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()
        self.owner[slot] = seq_id
        if self._free_verify:
            self.verify_of[slot] = self._free_verify.pop()
        return slot

    def free(self, slot: int) -> None:
        if self.owner.pop(slot, None) is None:
            raise ValueError(f"state slot {slot} is not allocated")
        self._free.append(slot)
        if slot in self.verify_of:
            self._free_verify.append(self.verify_of.pop(slot))

    def verify_slot(self, slot: int) -> int | None:
        """The verify slot of live slot `slot`, or None when it has none."""
        return self.verify_of.get(slot)
