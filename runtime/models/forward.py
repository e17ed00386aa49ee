"""What a model forward needs besides token ids and positions."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.attention.base import AttentionBackend


@dataclass
class ForwardBatch:
    """backend: prepared for this forward's AttentionMetadata.
    capture_layers: layer ids whose output (the residual stream after the layer) is returned,
    concatenated along the hidden dim in this order -> [T, K*H].
    extra: per-forward state of non-attention layers (e.g. mamba), keyed by the layer family."""
    backend: AttentionBackend
    capture_layers: tuple[int, ...] = ()
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class ForwardOutput:
    hidden: torch.Tensor                    # [T, H] after the final norm
    captured: torch.Tensor | None = None    # [T, K*H] or None
