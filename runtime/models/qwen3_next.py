"""Qwen3-Next: Qwen3.5's layers (Gated DeltaNet and gated attention, zero-centred norms;
runtime/models/qwen3_5.py) with mixture-of-experts feed-forward layers (as Qwen3.5-MoE's:
softmax top-k routed experts plus one gated shared expert, in every decoder_sparse_step-th layer
not in mlp_only_layers). Its checkpoints fuse the DeltaNet's
projections per key-head group (in_proj_qkvz: each group's q, k, v, z; in_proj_ba: its b, a);
they are split into Qwen3.5's separate projections as they load."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.layers.gated_deltanet import GatedDeltaNetConfig
from runtime.layers.moe import split_stacked_experts
from runtime.models.hybrid import HybridConfig, HybridForCausalLM
from runtime.models.qwen3_5 import FAMILY, qwen3_5_config


def split_fused(name: str, tensor: torch.Tensor, cfg: GatedDeltaNetConfig
                ) -> list[tuple[str, torch.Tensor]]:
    """in_proj_qkvz [nk * (2 dk + 2 r dv), H] (r = nv / nk value heads per key head; per group
    q, k, v, z) -> in_proj_qkv ([all q | all k | all v], the conv's channel order) and
    in_proj_z; in_proj_ba [nk * 2r, H] (per group b, a) -> in_proj_b, in_proj_a. Other
    tensors pass as they are."""
    nk, dk, dv = cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim
    r = cfg.num_v_heads // nk
    stem = name.rsplit(".", 2)[0]
    if name.endswith(".in_proj_qkvz.weight"):
        q, k, v, z = tensor.view(nk, -1, tensor.shape[-1]).split([dk, dk, r * dv, r * dv], 1)
        flat = [x.reshape(-1, tensor.shape[-1]) for x in (q, k, v, z)]
        return [(f"{stem}.in_proj_qkv.weight", torch.cat(flat[:3])),
                (f"{stem}.in_proj_z.weight", flat[3])]
    if name.endswith(".in_proj_ba.weight"):
        b, a = tensor.view(nk, 2 * r, -1).split([r, r], 1)
        return [(f"{stem}.in_proj_b.weight", b.reshape(-1, tensor.shape[-1])),
                (f"{stem}.in_proj_a.weight", a.reshape(-1, tensor.shape[-1]))]
    return [(name, tensor)]


class Qwen3NextForCausalLM(HybridForCausalLM):
    checkpoint_skip = ("mtp.",)

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__(cfg, FAMILY)

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor
                                  ) -> list[tuple[str, torch.Tensor]]:
        return [out for part, value in split_fused(name, tensor, self.hybrid_cfg.state)
                for out in split_stacked_experts(part, value)]


def build(raw: dict[str, Any]) -> tuple[type[nn.Module], HybridConfig]:
    return Qwen3NextForCausalLM, qwen3_5_config(raw)
