"""The non-gated MLP of NemotronH: down_proj(relu(up_proj x)^2) - squared ReLU ("relu2"), no gate
projection. Checkpoint names up_proj [I, H], down_proj [H, I] (+ .bias with bias)."""
from __future__ import annotations

import torch
from torch import nn

from runtime.layers.linear import Linear


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, elementwise: relu(x)^2 (transformers' ACT2FN["relu2"])."""
    return torch.relu(x).square()


class UngatedMLP(nn.Module):
    """x [T, H] -> down_proj(relu2(up_proj x)) [T, H]."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))
