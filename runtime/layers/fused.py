"""Which code the layers run: the fused Triton kernels of runtime.layers.triton_ops for CUDA
tensors at inference, the torch code otherwise (CPU tensors, autograd, or the switch below).

DFLASH_TORCH_LAYER_OPS=1   keeps the torch code on CUDA too (A/B measurements, a suspected
                           kernel bug); read once, at import."""
from __future__ import annotations

import os
from types import ModuleType

import torch

TORCH_LAYER_OPS_ENV = "DFLASH_TORCH_LAYER_OPS"
enabled = os.environ.get(TORCH_LAYER_OPS_ENV, "") in ("", "0")


def triton_ops_for(*tensors: torch.Tensor) -> ModuleType | None:
    """runtime.layers.triton_ops when its kernels should run on these tensors (the first decides
    the device), else None. The kernels have no backward: a forward that autograd records (the
    drafter's training) keeps the torch code."""
    if not (enabled and tensors[0].is_cuda):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    from runtime.layers import triton_ops
    return triton_ops
