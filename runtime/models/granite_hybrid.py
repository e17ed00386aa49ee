"""IBM's GraniteMoeHybrid (Granite-4.0-H): Bamba's Mamba2 and attention layers
(runtime/models/bamba.py), each followed by a mixture of experts plus a shared SwiGLU (or the
shared SwiGLU alone), with Granite's scalings - the embeddings times embedding_multiplier, each
residual branch times residual_multiplier, attention scores times attention_multiplier (instead
of 1/sqrt(head_dim)), the logits divided by logits_scaling - and no rotary embedding unless
position_embedding_type is "rope".

Checkpoint layout (transformers' GraniteMoeHybridForCausalLM): per layer
block_sparse_moe.input_linear [E, 2I, H] (each expert's gate rows, then its up rows),
block_sparse_moe.output_linear [E, H, I], block_sparse_moe.router.layer [E, H],
shared_mlp.input_linear [2 Is, H] (gate, up), shared_mlp.output_linear [H, Is]; they load as the
MoE's per-expert SwiGLUs, its router and its shared expert (the layer's `mlp`). Routing: the
top-k logits, softmaxed among themselves (= softmax top-k renormalised)."""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from runtime.layers.mamba2 import Mamba2Mixer
from runtime.layers.moe import MoEConfig
from runtime.layers.norm import RMSNorm
from runtime.models.bamba import mamba2_config
from runtime.models.dense import Attention
from runtime.models.hybrid import (
    ATTENTION,
    RECURRENT,
    HybridConfig,
    HybridFamily,
    HybridForCausalLM,
    base_config,
)

KINDS = {"full_attention": ATTENTION, "attention": ATTENTION,
         "linear_attention": RECURRENT, "mamba": RECURRENT}


def granite_hybrid_config(raw: dict[str, Any]) -> HybridConfig:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("granitemoehybrid checkpoints with attention_bias or mlp_bias are not "
                         "supported")
    kinds = list(raw.get("layer_types") or raw.get("layers_block_type") or [])
    if len(kinds) != int(raw["num_hidden_layers"]) or not set(kinds) <= set(KINDS):
        raise ValueError(f"layer_types {kinds} must give each of the {raw['num_hidden_layers']} "
                         f"layers one of {sorted(KINDS)}")
    shared = int(raw.get("shared_intermediate_size") or 0)
    # the layers' dense SwiGLU is the shared one (intermediate_size is each expert's)
    base = base_config(raw, "llama", "granitemoehybrid", intermediate_size=shared)
    experts = int(raw.get("num_local_experts") or 0)
    moe = MoEConfig(
        hidden_size=base.hidden_size, n_routed_experts=experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 1),
        moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True,
        shared_intermediate_size=shared, shared_name="shared_mlp") if experts else None
    return HybridConfig(
        base, mamba2_config(raw, base), tuple(KINDS[k] for k in kinds), moe=moe,
        moe_layers=frozenset(range(base.num_layers)) if experts else frozenset(),
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        attention_scale=float(raw["attention_multiplier"]) if raw.get("attention_multiplier")
        else None,
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
        rope=raw.get("position_embedding_type") == "rope")


FAMILY = HybridFamily(attention=Attention, recurrent=Mamba2Mixer, norm=RMSNorm,
                      mixer_name="mamba", ff_norm_name="post_attention_layernorm",
                      mlp_name="mlp", final_norm_name="norm")
_PART = re.compile(r"(.*)\.(block_sparse_moe|shared_mlp)\.(input_linear|output_linear|router\.layer)"
                   r"\.weight")


def granite_tensors(name: str, tensor: torch.Tensor, moe: bool
                    ) -> list[tuple[str, torch.Tensor]]:
    """A Granite block_sparse_moe / shared_mlp tensor -> the names of the layer's `mlp` (an MoE
    when moe, else the shared SwiGLU itself); any other tensor as it is."""
    m = _PART.fullmatch(name)
    if m is None:
        return [(name, tensor)]
    layer, block, part = m.groups()
    if block == "shared_mlp":
        stem = f"{layer}.mlp.shared_mlp" if moe else f"{layer}.mlp"
        if part == "output_linear":
            return [(f"{stem}.down_proj.weight", tensor)]
        gate, up = tensor.chunk(2, dim=0)
        return [(f"{stem}.gate_proj.weight", gate), (f"{stem}.up_proj.weight", up)]
    if part == "router.layer":
        return [(f"{layer}.mlp.gate.weight", tensor)]
    if part == "output_linear":
        return [(f"{layer}.mlp.experts.{e}.down_proj.weight", w) for e, w in enumerate(tensor)]
    out = []
    for e, w in enumerate(tensor):
        gate, up = w.chunk(2, dim=0)
        out += [(f"{layer}.mlp.experts.{e}.gate_proj.weight", gate),
                (f"{layer}.mlp.experts.{e}.up_proj.weight", up)]
    return out


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__(cfg, FAMILY)

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor
                                  ) -> list[tuple[str, torch.Tensor]]:
        return granite_tensors(name, tensor, self.hybrid_cfg.moe is not None)


def build(raw: dict[str, Any]) -> tuple[type[nn.Module], HybridConfig]:
    return GraniteMoeHybridForCausalLM, granite_hybrid_config(raw)
