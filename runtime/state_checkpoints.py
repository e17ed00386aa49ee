"""Recurrent-state checkpoints for prefix caching on hybrid targets.

A cached prefix gives a new sequence its attention layers' KV pages, but its mamba layers need
the recurrent state (conv window and SSM state) after the prefix's last token, which no page
holds. The target keeps that state at page boundaries it passes: a prompt's last full page
(its prefill is cut there), and every page boundary a verify commits past (the state after
each block position is at hand in the verify slot). A checkpoint is keyed by the prefix key of
the page it ends (runtime/prefix_cache.py): the state depends only on the tokens up to there,
so it stays right whether or not that page is still cached. A prefix hit on a hybrid target is
the deepest cached page that has a checkpoint; a prefix without one is a miss, never a wrong
state. Checkpoints are bounded (--prefix-state-checkpoints; each one is a live state's size)
and evicted least-recently-used on their own clock.

    conv[l]  [capacity, C, K-1]     (model dtype)
    ssm[l]   [capacity, nh, hd, N]  (fp32)"""
from __future__ import annotations

from collections import OrderedDict

import torch

from runtime.state_pool import MambaStatePool


class StateCheckpoints:
    def __init__(self, pool: MambaStatePool, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"state checkpoints need a capacity >= 1, got {capacity}")
        self.pool, self.capacity = pool, capacity
        self.conv = torch.zeros((pool.num_layers, capacity, *pool.cfg.conv_state_shape),
                                dtype=pool.conv.dtype, device=pool.conv.device)
        self.ssm = torch.zeros((pool.num_layers, capacity, *pool.cfg.ssm_state_shape),
                               dtype=torch.float32, device=pool.ssm.device)
        self._slot: OrderedDict[bytes, int] = OrderedDict()     # key -> checkpoint, LRU first
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.ssm))

    def deepest(self, keys: list[bytes]) -> int:
        """How many of `keys` (a prefix's page keys, in order) reach the deepest one that has a
        checkpoint (0: none has)."""
        return next((k for k in range(len(keys), 0, -1) if keys[k - 1] in self._slot), 0)

    def save_live(self, key: bytes, slot: int) -> None:
        """The live state of pool slot `slot` (the state after the page `key` ends)."""
        c = self._take(key)
        if c is not None:
            self.conv[:, c] = self.pool.conv[:, slot]
            self.ssm[:, c] = self.pool.ssm[:, slot]

    def save_verified(self, key: bytes, verify_slot: int, index: int) -> None:
        """The state after block position `index` of the last verify in `verify_slot`."""
        c = self._take(key)
        if c is not None:
            self.conv[:, c] = self.pool.verify_conv[:, verify_slot, index]
            self.ssm[:, c] = self.pool.verify_ssm[:, verify_slot, index]

    def restore(self, key: bytes, slot: int) -> None:
        """Pool slot `slot`'s live state becomes the checkpoint of `key` (which must exist)."""
        c = self._slot[key]
        self._slot.move_to_end(key)
        self.pool.conv[:, slot] = self.conv[:, c]
        self.pool.ssm[:, slot] = self.ssm[:, c]

    def _take(self, key: bytes) -> int | None:
        """A checkpoint for `key`: None when it has one already (the same tokens, the same
        state), else a free one or the least recently used one's."""
        if key in self._slot:
            self._slot.move_to_end(key)
            return None
        c = self._free.pop() if self._free else self._slot.popitem(last=False)[1]
        self._slot[key] = c
        return c
