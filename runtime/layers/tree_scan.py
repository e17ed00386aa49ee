"""Recurrent layers over a verified tree of drafts: each block position continues the state of
its parent, not of the position before it (docs/hybrid.md, "Trees").

A verify block is the anchor (row 0) and the drafts (rows 1..L-1); `parents` int64 [b, L] gives
each row's parent row (row 0: -1, the live state; a parent always comes before its child - the
order runtime/draft_tree.py keeps). A chain is the tree whose parent of row j is j - 1, so the
functions here give exactly the chain scans' results on a chain. The state after each row is
kept (verify), so that the accepted path's last row can be committed.

    tree_conv   the causal depthwise conv along each row's ancestors (the K-1 nearest, then the
                live window), and the window after each row
    ssd_tree    Mamba2's SSD in closed form under the ancestor mask
(the gated delta rule's verify form, gated_deltanet.delta_block, takes the ancestor mask too)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def chain_parents(b: int, L: int, device: torch.device | str) -> torch.Tensor:
    """[b, L]: row j's parent is j - 1 (row 0: -1)."""
    return (torch.arange(L, device=device) - 1).expand(b, L)


def parents_from_mask(mask: torch.Tensor) -> list[int]:
    """An ancestor mask [L, L] (row t: itself and its ancestors, runtime/draft_tree.py) -> each
    row's parent (-1 for row 0): its nearest ancestor."""
    rows = mask.tolist()
    return [max((s for s in range(t) if rows[t][s]), default=-1) for t in range(len(rows))]


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [b, L] -> bool [b, L, L], [t, s] True where s is t or one of its ancestors."""
    b, L = parents.shape
    mask = torch.eye(L, dtype=torch.bool, device=parents.device).expand(b, L, L).clone()
    rows = torch.arange(b, device=parents.device)
    for t in range(1, L):
        mask[:, t] |= mask[rows, parents[:, t].clamp(min=0)] & (parents[:, t] >= 0)[:, None]
    return mask


def conv_taps(parents: torch.Tensor, k: int) -> torch.Tensor:
    """parents [b, L] -> int64 [b, L, k]: for row j the index, in [window (k-1 columns) | the
    block's rows], of the k inputs its conv reads, oldest first (its k-1 nearest ancestors -
    past row 0 the window's columns from the end - then itself). A chain's row j reads j..j+k-1."""
    b, L = parents.shape
    taps = torch.empty(b, L, k, dtype=torch.int64, device=parents.device)
    taps[:, 0] = torch.arange(k, device=parents.device)      # row 0: the window, then itself
    rows = torch.arange(b, device=parents.device)
    for j in range(1, L):
        # the parent's taps shifted by one (its oldest drops out), then row j itself
        taps[:, j, :-1] = taps[rows, parents[:, j], 1:]
        taps[:, j, -1] = k - 1 + j
    return taps


def tree_conv(window: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None, parents: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """window [b, C, K-1], xs [b, L, C], weight [C, 1, K] -> (silu(conv) [b, L, C], the window
    after each row [b, L, C, K-1]) along each row's ancestors."""
    b, L, C = xs.shape
    k = weight.shape[-1]
    full = torch.cat([window.to(xs.dtype), xs.transpose(1, 2)], dim=-1)   # [b, C, K-1+L]
    taps = conv_taps(parents, k)                                            # [b, L, K]
    idx = taps.reshape(b, 1, L * k).expand(b, C, L * k)
    seen = full.gather(-1, idx).view(b, C, L, k)                            # [b, C, L, K]
    out = (seen * weight[:, 0, None, :].to(seen.dtype)).sum(-1)             # [b, C, L]
    if bias is not None:
        out = out + bias[:, None].to(out.dtype)
    return F.silu(out).transpose(1, 2), seen[..., 1:].permute(0, 2, 1, 3)


def ssd_tree(h0: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, parents: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 over a tree (shapes as mamba2.ssd_block: x [b, L, nh, hd], dt/dA [b, L, nh],
    B/C [b, L, nh, N], h0 [b, nh, hd, N]) -> (y [b, L, nh, hd], the state after every row
    [b, L, nh, hd, N]). Row t's state: h0 decayed along its whole path, plus each ancestor s's
    input decayed along the path from s to t."""
    mask = ancestor_mask(parents)                                       # [b, t, s]
    path = torch.einsum("bts,bsh->bth", mask.to(dA.dtype), dA)          # decay sums root..t
    gap = path[:, :, None] - path[:, None, :]                           # [b, t, s, nh]
    decay = gap.masked_fill(~mask[..., None], -float("inf")).exp()      # 0 off the path
    xdt = x * dt[..., None]
    states = (path.exp()[..., None, None] * h0[:, None]
              + torch.einsum("btsh,bshp,bshn->bthpn", decay, xdt, B))
    y = torch.einsum("blhn,blhpn->blhp", C, states) + D[:, None] * x
    return y, states
