from __future__ import annotations

import torch
from torch import nn

from runtime.layers import fused


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D]: fp32 math, cast back to x's dtype, then times weight [D]."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_torch, or one fused Triton kernel on CUDA."""
    ops = fused.triton_ops_for(x, weight)
    return ops.rms_norm(x, weight, eps) if ops else rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., D] -> (rms_norm(x + residual), x + residual); one kernel on CUDA."""
    ops = fused.triton_ops_for(x, residual, weight)
    if ops:
        return ops.add_rms_norm(x, residual, weight, eps)
    summed = x + residual
    return rms_norm_torch(summed, weight, eps), summed


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, as Llama/Qwen do; the result is cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(x + residual), x + residual), the add fused into the norm on CUDA."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """RMSNorm with a zero-centred weight (Qwen3.5, Qwen3-Next): x / rms(x) * (1 + weight), all in
    fp32, cast back to the input dtype at the end."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
