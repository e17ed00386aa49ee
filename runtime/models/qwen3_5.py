"""Qwen3.5 (text): a hybrid decoder (runtime/models/hybrid.py) of Gated DeltaNet layers and
gated full-attention layers, each followed by a SwiGLU MLP; the layer kinds from `layer_types`
(by default three linear-attention layers, then one full-attention layer). The full attention
has an output gate (q_proj gives each head's query and gate side by side), per-head q/k norms
and a partial rotary embedding; every RMSNorm but the DeltaNet's gated one has a zero-centred
weight. Qwen3.5-MoE: the same with mixture-of-experts feed-forward layers. Checkpoint names
follow transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (model_type qwen3_5_text,
qwen3_5_moe_text), or the text model of their ...ForConditionalGeneration (qwen3_5,
qwen3_5_moe: the checkpoints Qwen publishes; the vision tower and the multi-token-prediction
layers are not loaded)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from runtime.config import ModelConfig, decoder_prefix, text_config
from runtime.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from runtime.layers.linear import Linear
from runtime.layers.moe import MoEConfig, split_stacked_experts
from runtime.layers.norm import OffsetRMSNorm
from runtime.layers.rope import RotaryEmbedding
from runtime.models.forward import ForwardBatch
from runtime.models.hybrid import (
    ATTENTION,
    RECURRENT,
    HybridConfig,
    HybridFamily,
    HybridForCausalLM,
    base_config,
    partial_rotary,
)


def qwen3_5_config(raw: dict[str, Any]) -> HybridConfig:
    """A text config (qwen3_5_text), or a multimodal one (qwen3_5) by its text_config."""
    if "text_config" in raw:
        cfg = qwen3_5_config(text_config(raw))
        return replace(cfg, base=replace(cfg.base, raw=raw))
    if raw.get("mlp_bias"):
        raise ValueError("qwen3_5 checkpoints with mlp_bias are not supported")
    layers = int(raw["num_hidden_layers"])
    base = base_config(raw, "qwen3", "qwen3_5", partial_rotary_factor=partial_rotary(raw, 0.25))
    interval = int(raw.get("full_attention_interval", 4))
    types = tuple(raw.get("layer_types") or (
        ATTENTION if (i + 1) % interval == 0 else RECURRENT for i in range(layers)))
    if len(types) != layers or not set(types) <= {ATTENTION, RECURRENT}:
        raise ValueError(f"layer_types {list(types)} must give each of the {layers} layers one of "
                         f"{ATTENTION!r} or {RECURRENT!r}")
    state = GatedDeltaNetConfig(
        hidden_size=base.hidden_size, num_k_heads=int(raw["linear_num_key_heads"]),
        num_v_heads=int(raw["linear_num_value_heads"]),
        head_k_dim=int(raw["linear_key_head_dim"]), head_v_dim=int(raw["linear_value_head_dim"]),
        conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)), norm_eps=base.rms_norm_eps)
    return _with_experts(HybridConfig(base, state, types), raw)


def _with_experts(cfg: HybridConfig, raw: dict[str, Any]) -> HybridConfig:
    """MoE models (Qwen3.5-MoE, Qwen3-Next: num_experts > 0): every decoder_sparse_step-th
    layer not in mlp_only_layers routes softmax top-k over its experts, plus one shared expert
    scaled by sigmoid(shared_expert_gate x)."""
    experts = int(raw.get("num_experts") or 0)
    if not experts:
        return cfg
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    moe = MoEConfig(
        hidden_size=cfg.base.hidden_size, n_routed_experts=experts,
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        shared_name="shared_expert", shared_gate=True)
    layers = frozenset(i for i in range(cfg.base.num_layers)
                       if i not in dense and (i + 1) % step == 0)
    return replace(cfg, moe=moe, moe_layers=layers)


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj [q_h | gate_h] per head (2 hd each), q/k
    normed per head, partial RoPE, attention through the backend, times sigmoid(gate)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # the fused qkv_proj's parts (runtime/weights.py splits q_proj / k_proj / v_proj by these)
        self.q_size, self.kv_size = 2 * self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = OffsetRMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                batch: ForwardBatch) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        qg, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(-1, self.nh, 2 * self.hd)
        q, gate = self.q_norm(qg[..., : self.hd]), qg[..., self.hd:]
        k = self.k_norm(k.view(-1, self.nkv, self.hd))
        q, k = rope(positions, q, k)
        out = batch.backend.forward(self.layer_id, q, k, v.view(-1, self.nkv, self.hd))
        gated = out.reshape(-1, self.nh * self.hd) * torch.sigmoid(gate.reshape(out.shape[0], -1))
        return self.o_proj(gated)


FAMILY = HybridFamily(attention=GatedAttention, recurrent=GatedDeltaNet, norm=OffsetRMSNorm,
                      mixer_name="linear_attn", ff_norm_name="post_attention_layernorm",
                      mlp_name="mlp", final_norm_name="norm")


class Qwen3_5ForCausalLM(HybridForCausalLM):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__(cfg, FAMILY)
        # the multi-token-prediction layers are not served; a multimodal checkpoint's text
        # model is model.language_model.*, beside its vision tower
        self.checkpoint_prefix = decoder_prefix(cfg.base.raw)
        self.checkpoint_skip = ("mtp.", "model.visual.")

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor
                                  ) -> list[tuple[str, torch.Tensor]]:
        """Experts stored stacked (one [E, ...] tensor per projection) -> per expert."""
        return split_stacked_experts(name, tensor)


def build(raw: dict[str, Any]) -> tuple[type[nn.Module], HybridConfig]:
    return Qwen3_5ForCausalLM, qwen3_5_config(raw)
