"""Bamba (IBM): a hybrid decoder (runtime/models/hybrid.py) whose layers are each a Mamba2
mixer or a full-attention block, followed by a SwiGLU MLP. Checkpoint names follow transformers'
BambaForCausalLM."""
from __future__ import annotations

import math
from typing import Any

from torch import nn

from runtime.config import ModelConfig
from runtime.layers.mamba2 import Mamba2Config, Mamba2Mixer
from runtime.layers.norm import RMSNorm
from runtime.models.dense import Attention
from runtime.models.hybrid import (
    ATTENTION,
    RECURRENT,
    HybridConfig,
    HybridFamily,
    HybridForCausalLM,
    base_config,
    partial_rotary,
)


def bamba_config(raw: dict[str, Any]) -> HybridConfig:
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError("bamba checkpoints with attention_bias or mlp_bias are not supported")
    layers = int(raw["num_hidden_layers"])
    # transformers' Bamba always rotates half of each head (partial_rotary_factor 0.5)
    base = base_config(raw, "llama", "bamba", partial_rotary_factor=partial_rotary(raw, 0.5))
    attn = set(raw.get("attn_layer_indices") or [])
    if bad := sorted(i for i in attn if not 0 <= i < layers):
        raise ValueError(f"attn_layer_indices {bad} outside the {layers} layers")
    types = tuple(ATTENTION if i in attn else RECURRENT for i in range(layers))
    return HybridConfig(base, mamba2_config(raw, base), types)


def mamba2_config(raw: dict[str, Any], base: ModelConfig, inner: int | None = None,
                  **fields: Any) -> Mamba2Config:
    """The mamba_* fields Bamba, Granite-4.0-H and Falcon-H1 share. inner: the mixer's width
    (default mamba_expand * hidden_size; Falcon-H1's mamba_d_ssm); fields: other Mamba2Config
    values (Falcon-H1's biases and norm)."""
    hidden = base.hidden_size
    heads = int(raw.get("mamba_n_heads", 128))
    expand = int(raw.get("mamba_expand", 2))
    width = f"mamba_expand * hidden_size = {expand * hidden}" if inner is None else \
        f"mamba_d_ssm = {inner}"
    inner = expand * hidden if inner is None else inner
    d_head = raw.get("mamba_d_head", "auto")
    mamba = Mamba2Config(
        hidden_size=hidden, num_heads=heads,
        head_dim=inner // heads if d_head in (None, "auto") else int(d_head),
        num_groups=int(raw.get("mamba_n_groups", 1)),
        state_size=int(raw.get("mamba_d_state", 256)),
        conv_kernel=int(raw.get("mamba_d_conv", 4)),
        chunk_size=int(raw.get("mamba_chunk_size") or 256),
        conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)),
        dt_limit=dt_limit(raw.get("time_step_limit")), norm_eps=base.rms_norm_eps, **fields)
    if mamba.intermediate_size != inner:
        raise ValueError(f"mamba_n_heads * mamba_d_head = {mamba.intermediate_size} must equal "
                         f"{width}")
    return mamba


def dt_limit(value: Any) -> tuple[float, float]:
    """time_step_limit as transformers writes it: [lo, hi], hi maybe {"__float__": "Infinity"}."""
    if not value:
        return (0.0, math.inf)
    lo, hi = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in value)
    return (lo, hi)


FAMILY = HybridFamily(attention=Attention, recurrent=Mamba2Mixer, norm=RMSNorm,
                      mixer_name="mamba", ff_norm_name="pre_ff_layernorm",
                      mlp_name="feed_forward", final_norm_name="final_layernorm")


class BambaForCausalLM(HybridForCausalLM):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__(cfg, FAMILY)


def build(raw: dict[str, Any]) -> tuple[type[nn.Module], HybridConfig]:
    return BambaForCausalLM, bamba_config(raw)
