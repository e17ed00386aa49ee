from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers import fused
from runtime.layers.linear import Linear
from runtime.tensor_parallel import all_reduce


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_and_mul_torch, or one fused Triton kernel on CUDA."""
    ops = fused.triton_ops_for(gate_up)
    return ops.silu_and_mul(gate_up) if ops else silu_and_mul_torch(gate_up)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matrix (one GEMM instead of two)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H]
        # a tensor-parallel rank's down_proj output is a partial sum: whole after the reduce
        return all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))
