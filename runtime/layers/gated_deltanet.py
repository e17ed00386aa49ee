"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) in pure PyTorch: the recurrence for
decode and verify (keeping the state after every block position), and a chunked form for
prefill.

Notation (b sequences of L new tokens each; nk key heads and nv value heads, nv a multiple of
nk; dk / dv channels per key / value head):
  q, k [b, L, nv, dk]   after the causal conv, L2-normalised, key heads repeated to value heads
  v    [b, L, nv, dv]
  g    [b, L, nv]       log decay: -exp(A_log) * softplus(a + dt_bias) < 0, fp32
  beta [b, L, nv]       write strength: sigmoid(b)
  S    [b, nv, dk, dv]  recurrent state, fp32
  conv window [b, C, K-1]: the last K-1 conv inputs before the new tokens (C = 2 nk dk + nv dv)
Recurrence (the delta rule with a decay):
  S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t / sqrt(dk)
The layer's weights follow transformers' Qwen3.5 names (in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a, conv1d, dt_bias, A_log, norm, out_proj); the states live in the recurrent-state pool
(runtime/state_pool.py, shared with Mamba2) and reach the layer through the state backend."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.linear import Linear
from runtime.layers.mamba2 import ScanOut, causal_conv
from runtime.layers.scan_kernels import KERNELS, ScanKernels
from runtime.layers.tree_scan import ancestor_mask, tree_conv

if TYPE_CHECKING:  # the backend imports the layers
    from runtime.attention.mamba_state_backend import MambaStatePath


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    chunk_size: int = 64
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads {self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads {self.num_k_heads}")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim {self.conv_kernel} < 2 is not supported")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def intermediate_size(self) -> int:
        """The mixer's output width before out_proj (the state backend's y)."""
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.intermediate_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


# -- the delta rule ------------------------------------------------------------------------------

def delta_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: q/k [b, nv, dk] (q already scaled), v [b, nv, dv], g/beta [b, nv],
    S [b, nv, dk, dv] -> (o [b, nv, dv], S')."""
    S = S * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", S, k)) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", S, q), S


def delta_recurrent(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor, keep_states: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens one at a time: -> (o [b, L, nv, dv], the final state, or with keep_states the
    state after every token [b, L, nv, dk, dv])."""
    outs, states = [], []
    for t in range(q.shape[1]):
        o, S = delta_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(o)
        if keep_states:
            states.append(S)
    return torch.stack(outs, dim=1), torch.stack(states, dim=1) if keep_states else S


def delta_block(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor, mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify block in closed form, keeping the state after every row: -> (o [b, L, nv, dv],
    states [b, L, nv, dk, dv]). mask bool [b, L, L]: row t reads rows s with mask[t, s] - its
    ancestors and itself (a chain: s <= t; a tree of drafts: its path, runtime/layers/
    tree_scan.py). As delta_chunked's chunk with path sums G_t of g along t's path and
    D[t, s] = exp(G_t - G_s) on the path (0 off it): the writes solve (I + A) u = beta (v -
    exp(G) k^T S_0), A[t, s] = beta_t D[t, s] k_t.k_s for s a strict ancestor (lower
    triangular: ancestors come first), and S_t = exp(G_t) S_0 + sum_s D[t, s] k_s u_s^T - a few
    batched products instead of L sequential steps."""
    qh, kh, vh, gh, bh = (x.transpose(1, 2) for x in (q, k, v, g, beta))   # [b, nv, L, ...]
    on = mask[:, None]                                                     # [b, 1, t, s]
    G = torch.einsum("bts,bhs->bht", mask.to(gh.dtype), gh)                # path sums
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~on, float("-inf")).exp()
    strict = on & ~torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device)
    A = (torch.einsum("bhtk,bhsk->bhts", kh, kh) * D * bh[..., None]).masked_fill(~strict, 0.0)
    rhs = bh[..., None] * (vh - G.exp()[..., None] * torch.einsum("bhtk,bhkv->bhtv", kh, S))
    u = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    o = (G.exp()[..., None] * torch.einsum("bhtk,bhkv->bhtv", qh, S)
         + (torch.einsum("bhtk,bhsk->bhts", qh, kh) * D) @ u)
    weighted = D[..., None] * kh[:, :, None]                               # [b, nv, t, s, dk]
    states = (G.exp()[..., None, None] * S[:, :, None]
              + torch.einsum("bhtsk,bhsv->bhtkv", weighted, u))
    return o.transpose(1, 2), states.transpose(1, 2)


def delta_chunked(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  g: torch.Tensor, beta: torch.Tensor, chunk: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill: chunks of `chunk` tokens in closed form, the state carried across chunks.
    -> (o [b, L, nv, dv], final state).

    Inside a chunk (positions 1..C, G_t = g_1 + .. + g_t, decay D[t, s] = exp(G_t - G_s)):
    the state each token reads before writing is exp(G_{t-1}) S_0 plus the chunk's earlier
    writes, so its write u_t = beta_t (v_t - k_t^T(that state)) solves a unit lower-triangular
    system (I + A) u = beta (v - exp(G_{t-1}) exp(g_t) k^T S_0) with A[t, s] = beta_t
    D[t, s] k_t.k_s for s < t; then o_t = exp(G_t) q_t^T S_0 + sum_{s<=t} D[t, s] q_t.k_s u_s
    and S_C = exp(G_C) S_0 + sum_s exp(G_C - G_s) k_s u_s^T."""
    outs = []
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    for lo in range(0, k.shape[1], chunk):
        sl = slice(lo, lo + chunk)
        qc, kc, vc, gc, bc = (x[:, sl].transpose(1, 2) for x in (q, k, v, g, beta))
        G = gc.cumsum(-1)                                         # [b, nv, C]
        C = G.shape[-1]
        D = (G[..., :, None] - G[..., None, :])
        D = D.masked_fill(above[:C, :C], float("-inf")).exp()     # [b, nv, t, s], 0 above
        kk = torch.einsum("bhtk,bhsk->bhts", kc, kc) * D
        A = (kk * bc[..., None]).tril(-1)
        rhs = bc[..., None] * (vc - G.exp()[..., None] * torch.einsum("bhtk,bhkv->bhtv", kc, S))
        # (I + A) u = rhs; unitriangular: A's zero diagonal is read as ones
        u = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("bhtk,bhsk->bhts", qc, kc) * D
        o = G.exp()[..., None] * torch.einsum("bhtk,bhkv->bhtv", qc, S) + qk @ u
        tail = (G[..., -1:] - G).exp()                             # [b, nv, C]
        S = (G[..., -1].exp()[..., None, None] * S
             + torch.einsum("bhsk,bhsv->bhkv", kc * tail[..., None], u))
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1), S


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (as the reference kernels do)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# -- the layer -------------------------------------------------------------------------------------

class HeadRMSNormGated(nn.Module):
    """Per value head: RMSNorm of y (fp32, weight applied in the input dtype), then times
    silu(z) (Qwen3.5's gated norm: norm before gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """y [..., dim] (rounded to dtype first, as the reference does), z [..., dim] ->
        [..., dim] in dtype."""
        y = y.to(dtype).float()
        h = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """in_proj_qkv -> causal conv -> q, k, v; in_proj_b / in_proj_a -> write strength and decay;
    the delta rule over the pooled state (through the state backend); gated norm with
    in_proj_z; out_proj. `state_index` is this layer's index in the state pool; `kernels` run
    prefill and one-token steps (runtime/layers/scan_kernels.py: torch until the worker
    installs its choice)."""

    def __init__(self, cfg: GatedDeltaNetConfig, state_index: int) -> None:
        super().__init__()
        self.cfg, self.state_index = cfg, state_index
        nv = cfg.num_v_heads
        self.in_proj_qkv = Linear(cfg.hidden_size, cfg.conv_dim, bias=False)
        self.in_proj_z = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.in_proj_b = Linear(cfg.hidden_size, nv, bias=False)
        self.in_proj_a = Linear(cfg.hidden_size, nv, bias=False)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim,
                                bias=False, padding=cfg.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(nv))
        self.A_log = nn.Parameter(torch.zeros(nv))
        self.norm = HeadRMSNormGated(cfg.head_v_dim, cfg.norm_eps)
        self.out_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.kernels: ScanKernels = KERNELS["torch"]()

    def forward(self, x: torch.Tensor, states: MambaStatePath) -> torch.Tensor:
        """x [T, H] (flattened over the forward's sequences) -> [T, H]."""
        cfg = self.cfg
        gates = torch.cat([self.in_proj_b(x), self.in_proj_a(x)], dim=-1)      # [T, 2 nv]
        y = states.forward(self, self.in_proj_qkv(x), gates)                 # [T, nv*dv] fp32
        z = self.in_proj_z(x)
        heads = (-1, cfg.num_v_heads, cfg.head_v_dim)
        out = self.norm(y.view(heads), z.view(heads), x.dtype).view(-1, cfg.intermediate_size)
        return self.out_proj(out)

    def scan(self, window: torch.Tensor, S: torch.Tensor, qkv: torch.Tensor,
             gates: torch.Tensor, keep_states: bool, parents: torch.Tensor | None = None
             ) -> ScanOut:
        """b sequences of L tokens from their states: window [b, C, K-1], S [b, nv, dk, dv],
        qkv [b, L, C], gates [b, L, 2 nv] (b | a). L == 1 takes one step; keep_states (verify)
        returns the window and state after every position; else the chunked prefill. parents
        [b, L] (a verified tree, runtime/layers/tree_scan.py): each row follows its parent."""
        cfg = self.cfg
        b, L, _ = qkv.shape
        mixed, conv = (tree_conv(window, qkv, self.conv1d.weight, None, parents)
                       if parents is not None else
                       causal_conv(window, qkv, self.conv1d.weight, None, keep_states))
        q, k, v = mixed.float().split([cfg.key_dim, cfg.key_dim, cfg.intermediate_size], -1)
        rep = cfg.num_v_heads // cfg.num_k_heads
        q = l2_normalize(q.view(b, L, cfg.num_k_heads, cfg.head_k_dim)).repeat_interleave(rep, 2)
        k = l2_normalize(k.view(b, L, cfg.num_k_heads, cfg.head_k_dim)).repeat_interleave(rep, 2)
        q = q * cfg.head_k_dim ** -0.5
        v = v.view(b, L, cfg.num_v_heads, cfg.head_v_dim)
        b_raw, a_raw = gates.split(cfg.num_v_heads, dim=-1)
        beta = b_raw.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a_raw.float() + self.dt_bias.float())
        S = S.float()
        if parents is not None or keep_states:      # a verify: every row's state
            mask = (ancestor_mask(parents) if parents is not None      # a tree: its paths
                    else torch.ones(L, L, dtype=torch.bool, device=qkv.device).tril().expand(
                        b, L, L))                                       # a chain: s <= t
            o, S = delta_block(S, q, k, v, g, beta, mask)
        elif L == 1:
            o, S = self.kernels.delta_step(S, q, k, v, g, beta)
        else:
            o, S = self.kernels.delta_chunked(S, q, k, v, g, beta, cfg.chunk_size)
        return ScanOut(o.reshape(b, L, -1), conv, S)
