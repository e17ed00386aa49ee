"""Rotary position embedding (the non-interleaved `rotate_half` layout of HF Llama/Qwen)."""
from __future__ import annotations

import math

import torch
from torch import nn

from runtime.config import RopeConfig, yarn_mscale
from runtime.layers import fused


def inv_freq_and_scale(rope: RopeConfig, rotary_dim: int, max_position: int
                       ) -> tuple[torch.Tensor, float]:
    """inverse frequencies [rotary_dim/2] and the attention scaling applied to cos/sin."""
    base = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if rope.kind == "default":
        return base.float(), 1.0
    if rope.kind == "linear":
        return (base / rope.factor).float(), 1.0
    if rope.kind == "llama3":
        return _llama3(base, rope).float(), 1.0
    if rope.kind == "yarn":
        return _yarn(base, rope, rotary_dim, max_position)
    raise ValueError(f"rope scaling type {rope.kind!r} is not supported")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_ctx = rope.original_max_position or 8192
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, rope: RopeConfig, dim: int, max_position: int
          ) -> tuple[torch.Tensor, float]:
    orig = rope.original_max_position or max_position
    factor = rope.factor
    scale = rope.mscale or yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = inv_freq / factor
    return (interpolated * (1 - extrapolation) + inv_freq * extrapolation).float(), scale


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_position, rotary_dim] built once; applied by position index."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self.max_position = max_position
        self.rope = rope
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Builds the fp32 tables (again after a model is moved or cast)."""
        device = device or self.cos.device
        if device.type == "meta":
            return
        inv_freq, scale = inv_freq_and_scale(self.rope, self.rotary_dim, self.max_position)
        t = torch.arange(self.max_position, dtype=torch.float32)
        emb = torch.outer(t, inv_freq).repeat(1, 2)
        self.cos = (emb.cos() * scale).to(device)
        self.sin = (emb.sin() * scale).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, nh, hd]; k [T, nkv, hd] -> rotated (same shapes and dtype);
        one fused Triton kernel for both on CUDA."""
        ops = fused.triton_ops_for(q, k)
        if ops:
            return ops.rotary(positions, q, k, self.cos, self.sin, self.rotary_dim)
        return rope_torch(positions, q, k, self.cos, self.sin, self.rotary_dim)


def rope_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
               sin_table: torch.Tensor, rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: tables [max_position, rd]; rotates the first rd dims of each head."""
    cos = cos_table[positions].unsqueeze(1)      # [T, 1, rd]
    sin = sin_table[positions].unsqueeze(1)
    return _rotate(q, cos, sin, rd), _rotate(k, cos, sin, rd)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int) -> torch.Tensor:
    dtype = x.dtype
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = (rot.float() * cos + rotated.float() * sin).to(dtype)
    return torch.cat([out, rest], dim=-1) if rest.numel() else out


class NoRope(nn.Module):
    """No rotary embedding (NoPE: Granite-4.0-H's attention layers): q and k as they are."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k
