"""The Mamba2 (SSD) mixer in pure PyTorch: the chunked scan for prefill, the single-step
recurrence for decode, and the verify path that keeps the state after every block position.

Notation (b sequences of L new tokens each; nh heads of hd channels; g groups; N state size):
  x  [b, L, nh, hd]     inputs after the causal conv
  dt [b, L, nh]         step sizes (softplus(dt + dt_bias), clamped to dt_limit), fp32
  dA [b, L, nh]         dt * A (A = -exp(A_log) < 0), fp32
  B, C [b, L, nh, N]    input / output projections, already expanded from groups to heads
  h  [b, nh, hd, N]     SSM state, fp32
  conv window [b, C, K-1]: the last K-1 conv inputs before the new tokens (C = conv_dim)
Recurrence: h_t = exp(dA_t) h_{t-1} + dt_t x_t (x) B_t;  y_t = C_t . h_t + D x_t.
The layer's weights follow transformers' Mamba2 mixer names (in_proj, conv1d, dt_bias, A_log, D,
norm, out_proj); the states live in a pool and reach the layer through the state backend.
The output gate z: Mamba2's gated RMSNorm rms(y * silu(z)) per group (norm "gated"), or
Falcon-H1's rms(y) * silu(z) ("norm_then_gate") or y * silu(z) with no norm ("none")."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.linear import Linear
from runtime.layers.scan_kernels import KERNELS, ScanKernels
from runtime.layers.tree_scan import ssd_tree, tree_conv

if TYPE_CHECKING:  # the backend imports this module
    from runtime.attention.mamba_state_backend import MambaStatePath


NORMS = ("gated", "norm_then_gate", "none")


@dataclass(frozen=True)
class Mamba2Config:
    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)
    norm_eps: float = 1e-5
    out_proj_bias: bool | None = None    # None: proj_bias (Falcon-H1 sets it apart)
    norm: str = "gated"                  # "gated" | "norm_then_gate" | "none" (module docstring)

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"mamba norm {self.norm!r}: one of {NORMS}")
        if self.num_heads % self.num_groups:
            raise ValueError(f"mamba heads {self.num_heads} are not a multiple of groups "
                             f"{self.num_groups}")
        if self.conv_kernel < 2:
            raise ValueError(f"mamba conv kernel {self.conv_kernel} < 2 is not supported")
        if self.chunk_size < 1:
            raise ValueError(f"mamba chunk size must be >= 1, got {self.chunk_size}")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)


@dataclass
class ScanOut:
    """y [b, L, nh*hd] fp32. conv / ssm: the final window and state ([b, C, K-1], [b, nh, hd, N]),
    or with keep_states one per position ([b, L, C, K-1], [b, L, nh, hd, N])."""
    y: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor


# -- the causal depthwise conv over a window -------------------------------------------------

def causal_conv(window: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, keep_windows: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """window [b, C, K-1], xs [b, L, C], weight [C, 1, K] -> (silu(conv) [b, L, C], the window
    after the last token [b, C, K-1], or after each token [b, L, C, K-1] with keep_windows)."""
    k1 = window.shape[-1]
    full = torch.cat([window.to(xs.dtype), xs.transpose(1, 2)], dim=-1)   # [b, C, K-1+L]
    out = F.silu(F.conv1d(full, weight, bias, groups=full.shape[1])).transpose(1, 2)
    if keep_windows:
        windows = full.unfold(-1, k1, 1)[:, :, 1:]                         # [b, C, L, K-1]
        return out, windows.permute(0, 2, 1, 3)
    return out, full[..., -k1:]


# -- SSD scans ---------------------------------------------------------------------------------

def segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L] with [t, s] = a_{s+1} + ... + a_t for t >= s, -inf above the
    diagonal (summed by a masked cumsum, not as a difference of cumsums, to stay accurate)."""
    L = a.shape[-1]
    x = a[..., None].expand(*a.shape, L)                                    # [..., r, s] = a_r
    strict = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)
    x = x.masked_fill(~strict, 0).cumsum(dim=-2)
    lower = torch.ones(L, L, dtype=torch.bool, device=a.device).tril()
    return x.masked_fill(~lower, -math.inf)


def ssd_step(h: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, D: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: x [b, nh, hd], dt/dA [b, nh], B/C [b, nh, N], h [b, nh, hd, N]
    -> (y [b, nh, hd], h')."""
    h = h * dA.exp()[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", h, C) + D[:, None] * x
    return y, h


def ssd_block(h0: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA: torch.Tensor,
              B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, keep_states: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens in closed form (one SSD chunk): -> (y [b, L, nh, hd], the final state
    [b, nh, hd, N], or with keep_states the state after every token [b, L, nh, hd, N])."""
    decay = segsum(dA.transpose(1, 2)).exp()                        # [b, nh, t, s]
    from_h0 = dA.cumsum(dim=1).exp()                                # [b, L, nh]
    xdt = x * dt[..., None]                                         # [b, L, nh, hd]
    if keep_states:
        states = (from_h0[..., None, None] * h0[:, None]
                  + torch.einsum("bhts,bshp,bshn->bthpn", decay, xdt, B))
        y = torch.einsum("blhn,blhpn->blhp", C, states) + D[:, None] * x
        return y, states
    scores = torch.einsum("blhn,bshn->bhls", C, B) * decay          # [b, nh, t, s]
    y = (torch.einsum("bhls,bshp->blhp", scores, xdt)
         + torch.einsum("blhn,bhpn->blhp", C, h0) * from_h0[..., None]
         + D[:, None] * x)
    h = from_h0[:, -1, :, None, None] * h0 + torch.einsum("bhs,bshp,bshn->bhpn",
                                                          decay[:, :, -1], xdt, B)
    return y, h


def ssd_chunked(h0: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, dA: torch.Tensor,
                B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, chunk: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill: closed form inside chunks of `chunk` tokens, the recurrence across chunks
    (memory O(chunk^2) per head, not O(L^2)). -> (y [b, L, nh, hd], final state)."""
    ys, h = [], h0
    for lo in range(0, x.shape[1], chunk):
        part = slice(lo, lo + chunk)
        y, h = ssd_block(h, x[:, part], dt[:, part], dA[:, part], B[:, part], C[:, part], D,
                         keep_states=False)
        ys.append(y)
    return torch.cat(ys, dim=1), h


# -- the layer ---------------------------------------------------------------------------------

class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over groups of `group_size` channels, in fp32 (Mamba2's norm); with
    norm_before_gate, rms(y) * weight * silu(z) (Falcon-H1's mamba_norm_before_gate)."""

    def __init__(self, dim: int, group_size: int, eps: float, norm_before_gate: bool = False
                 ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() if self.norm_before_gate else y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.norm_before_gate:
            return (self.weight.float() * g.view_as(h) * F.silu(z.float())).to(dtype)
        return self.weight * g.view_as(h).to(dtype)


class SiluGate(nn.Module):
    """y * silu(z), no norm (Falcon-H1 without mamba_rms_norm); no weights."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (y.float() * F.silu(z.float())).to(y.dtype)


def output_norm(cfg: Mamba2Config) -> nn.Module:
    """The mixer's gate (and norm) over y [T, nh*hd] with z (cfg.norm: module docstring)."""
    if cfg.norm == "none":
        return SiluGate()
    inner = cfg.intermediate_size
    return GatedRMSNorm(inner, inner // cfg.num_groups, cfg.norm_eps,
                        norm_before_gate=cfg.norm == "norm_then_gate")


class Mamba2Mixer(nn.Module):
    """in_proj -> [z | xBC | dt]; causal conv + SSM over xBC (states through the state backend);
    gated norm with z; out_proj. `state_index` is this layer's index in the state pool;
    `kernels` run prefill and one-token steps (runtime/layers/scan_kernels.py: torch until the
    worker installs its choice)."""

    def __init__(self, cfg: Mamba2Config, state_index: int) -> None:
        super().__init__()
        self.cfg, self.state_index = cfg, state_index
        inner, nh = cfg.intermediate_size, cfg.num_heads
        self.in_proj = Linear(cfg.hidden_size, inner + cfg.conv_dim + nh, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim,
                                bias=cfg.conv_bias, padding=cfg.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(nh))
        self.A_log = nn.Parameter(torch.zeros(nh))
        self.D = nn.Parameter(torch.ones(nh))
        self.norm = output_norm(cfg)
        out_bias = cfg.proj_bias if cfg.out_proj_bias is None else cfg.out_proj_bias
        self.out_proj = Linear(inner, cfg.hidden_size, bias=out_bias)
        self.kernels: ScanKernels = KERNELS["torch"]()

    def forward(self, x: torch.Tensor, states: MambaStatePath) -> torch.Tensor:
        """x [T, H] (flattened over the forward's sequences) -> [T, H]."""
        cfg = self.cfg
        z, xbc, dt = self.in_proj(x).split([cfg.intermediate_size, cfg.conv_dim, cfg.num_heads],
                                           dim=-1)
        y = states.forward(self, xbc, dt)                                # [T, nh*hd] fp32
        return self.out_proj(self.norm(y, z).to(x.dtype))

    def scan(self, window: torch.Tensor, h: torch.Tensor, xbc: torch.Tensor,
             dt_raw: torch.Tensor, keep_states: bool, parents: torch.Tensor | None = None
             ) -> ScanOut:
        """b sequences of L tokens from their states: window [b, C, K-1], h [b, nh, hd, N],
        xbc [b, L, C], dt_raw [b, L, nh]. L == 1 without keep_states takes the single step;
        keep_states (verify) returns the window and state after every position; parents
        [b, L] (a verified tree, runtime/layers/tree_scan.py): each row follows its parent."""
        cfg = self.cfg
        b, L, _ = xbc.shape
        xbc, conv = (tree_conv(window, xbc, self.conv1d.weight, self.conv1d.bias, parents)
                     if parents is not None else
                     causal_conv(window, xbc, self.conv1d.weight, self.conv1d.bias, keep_states))
        xs, B, C = xbc.float().split([cfg.intermediate_size, cfg.num_groups * cfg.state_size,
                                      cfg.num_groups * cfg.state_size], dim=-1)
        xs = xs.view(b, L, cfg.num_heads, cfg.head_dim)
        rep = cfg.num_heads // cfg.num_groups
        B = B.view(b, L, cfg.num_groups, cfg.state_size).repeat_interleave(rep, dim=2)
        C = C.view(b, L, cfg.num_groups, cfg.state_size).repeat_interleave(rep, dim=2)
        dt = F.softplus(dt_raw.float() + self.dt_bias.float()).clamp(*cfg.dt_limit)
        dA = dt * -self.A_log.float().exp()
        D = self.D.float()
        h = h.float()
        if parents is not None:
            y, ssm = ssd_tree(h, xs, dt, dA, B, C, D, parents)
        elif keep_states:
            y, ssm = ssd_block(h, xs, dt, dA, B, C, D, keep_states=True)
        elif L == 1:
            y, ssm = self.kernels.ssd_step(h, xs[:, 0], dt[:, 0], dA[:, 0], B[:, 0], C[:, 0], D)
            y = y[:, None]
        else:
            y, ssm = self.kernels.ssd_chunked(h, xs, dt, dA, B, C, D, cfg.chunk_size)
        return ScanOut(y.reshape(b, L, -1), conv, ssm)

