"""Qwen3.5 (text): a hybrid decoder (runtime/models/hybrid.py) of Gated DeltaNet layers and
gated full-attention layers, each followed by a SwiGLU MLP; the layer kinds from `layer_types`
(by default three linear-attention layers, then one full-attention layer). The full attention
has an output gate (q_proj gives each head's query and gate side by side), per-head q/k norms
and a partial rotary embedding; every RMSNorm but the DeltaNet's gated one has a zero-centred
weight. Checkpoint names follow transformers' Qwen3_5ForCausalLM (model_type qwen3_5_text)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from runtime.config import ModelConfig
from runtime.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from runtime.layers.linear import Linear
from runtime.layers.norm import OffsetRMSNorm
from runtime.layers.rope import RotaryEmbedding
from runtime.models.forward import ForwardBatch
from runtime.models.hybrid import (
    ATTENTION,
    RECURRENT,
    HybridConfig,
    HybridFamily,
    HybridForCausalLM,
)


def qwen3_5_config(raw: dict[str, Any]) -> HybridConfig:
    if raw.get("mlp_bias"):
        raise ValueError("qwen3_5 checkpoints with mlp_bias are not supported")
    layers = int(raw["num_hidden_layers"])
    rope = dict(raw.get("rope_parameters") or {})
    base_raw = {**raw, "model_type": "qwen3",
                "partial_rotary_factor": rope.get("partial_rotary_factor", 0.25)}
    base = replace(ModelConfig.from_dict(base_raw), architecture="qwen3_5", raw=raw)
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
    return HybridConfig(base, state, types)


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


def build(raw: dict[str, Any]) -> tuple[type[nn.Module], HybridConfig]:
    return Qwen3_5ForCausalLM, qwen3_5_config(raw)
