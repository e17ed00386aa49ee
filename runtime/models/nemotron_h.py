"""NVIDIA's NemotronH (Nemotron-H, Nemotron-3 Nano): a hybrid decoder (runtime/models/hybrid.py)
whose layers are each ONE block - RMSNorm, one mixer, + residual - the mixer per layer from
`layers_block_type` (transformers 5) or `hybrid_override_pattern` (the hub's configs), one of
  M  linear_attention  Mamba2 (groups, gated RMSNorm per group of inner / n_groups channels)
  *  full_attention    attention with no rotary embedding and no biases
  -  mlp               down_proj(relu(up_proj x)^2) (mlp_hidden_act "relu2"; biases: mlp_bias)
  E  moe               sigmoid-scored top-k routing (+ e_score_correction_bias for the choice,
                       group-limited by n_group / topk_group, renormalised with norm_topk_prob,
                       times routed_scaling_factor) over squared-ReLU experts without biases,
                       plus one squared-ReLU shared expert (moe_shared_expert_intermediate_size)
An MLP or MoE block has neither a KV-cache index nor a state-pool index.

Checkpoint layout (the hub's; transformers 5 writes the same): backbone.embeddings.weight [V, H],
backbone.layers.N.norm.weight [H], backbone.layers.N.mixer.* - Mamba2: in_proj
[2 inner + 2 g N + nh, H], conv1d, dt_bias, A_log, D [nh], norm [inner], out_proj [H, inner];
attention: q/k/v/o_proj; MLP: up_proj [I, H], down_proj [H, I]; MoE: gate.weight [E, H],
gate.e_score_correction_bias [E], experts.M.up_proj / down_proj (or stacked: experts.up_proj
[E, I, H], experts.down_proj [E, H, I]), shared_experts.up_proj / down_proj -,
backbone.norm_f.weight, lm_head.weight (none when tied); mtp.* layers are not loaded.

As transformers 5.24 does: the Mamba2 dt is clamped below at time_step_min (its scan's limit
(time_step_min, inf); time_step_limit / _max / _floor only initialise weights), the in/out
projections' biases follow use_bias (not mamba_proj_bias), attention_bias and residual_in_fp32
are not applied. Refused: a mamba_hidden_act other than silu, an mlp_hidden_act other than
relu2, moe_latent_size (latent expert projections)."""
from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from runtime.layers.mamba2 import Mamba2Config, Mamba2Mixer
from runtime.layers.moe import MoE, MoEConfig, split_stacked_experts
from runtime.layers.norm import RMSNorm
from runtime.layers.ungated_mlp import UngatedMLP
from runtime.models.dense import Attention
from runtime.models.hybrid import (
    ATTENTION,
    MLP,
    RECURRENT,
    HybridConfig,
    HybridFamily,
    HybridForCausalLM,
    base_config,
)

PATTERN = {"M": RECURRENT, "*": ATTENTION, "-": MLP, "E": MLP}      # "E": an MoE block
BLOCK_TYPES = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
               "mlp": "-", "moe": "E"}


def layer_pattern(raw: dict[str, Any]) -> str:
    """Each layer's block as a hybrid_override_pattern character: from layers_block_type (or
    layer_types), which transformers 5 prefers, else hybrid_override_pattern."""
    listed = raw.get("layers_block_type") or raw.get("layer_types")
    if listed:
        if bad := sorted({k for k in listed if k not in BLOCK_TYPES}):
            raise ValueError(f"layers_block_type {bad} are not NemotronH blocks; one of "
                             f"{sorted(BLOCK_TYPES)}")
        return "".join(BLOCK_TYPES[k] for k in listed)
    pattern = raw.get("hybrid_override_pattern")
    if not pattern:
        raise ValueError("nemotron_h config.json gives neither layers_block_type nor "
                         "hybrid_override_pattern")
    if bad := sorted(set(pattern) - set(PATTERN)):
        raise ValueError(f"hybrid_override_pattern {pattern!r}: {bad} are not layer kinds "
                         f"(M mamba, * attention, - MLP, E MoE)")
    return pattern


def _field(raw: dict[str, Any], name: str, legacy: str | None, default: Any) -> Any:
    """A config field by its name or, winning as in transformers, its legacy mamba_* alias."""
    if legacy is not None and legacy in raw:
        return raw[legacy]
    return raw.get(name, default)


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    for name, want, default in (("mamba_hidden_act", "silu", "silu"),
                                ("mlp_hidden_act", "relu2", "relu2")):
        if raw.get(name, default) != want:
            raise ValueError(f"nemotron_h {name} {raw[name]!r} is not supported ({want} only)")
    if raw.get("moe_latent_size") is not None:
        raise ValueError("nemotron_h moe_latent_size (latent expert projections) is not "
                         "supported")


def nemotron_h_config(raw: dict[str, Any]) -> HybridConfig:
    _refuse_unsupported(raw)
    pattern = layer_pattern(raw)
    base = base_config(raw, "llama", "nemotron_h", num_hidden_layers=len(pattern),
                       head_dim=raw.get("head_dim") or 128, hidden_act="silu",
                       rms_norm_eps=raw.get("layer_norm_epsilon", 1e-5), attention_bias=False)
    moe_layers = frozenset(i for i, c in enumerate(pattern) if c == "E")
    return HybridConfig(base, _mamba2_config(raw, base.hidden_size, base.rms_norm_eps),
                        tuple(PATTERN[c] for c in pattern),
                        moe=_moe_config(raw, base.hidden_size) if moe_layers else None,
                        moe_layers=moe_layers, rope=False)


def _mamba2_config(raw: dict[str, Any], hidden: int, eps: float) -> Mamba2Config:
    return Mamba2Config(
        hidden_size=hidden, num_heads=int(raw.get("mamba_num_heads", 128)),
        head_dim=int(raw.get("mamba_head_dim", 64)),
        num_groups=int(_field(raw, "n_groups", "mamba_n_groups", 8)),
        state_size=int(raw.get("ssm_state_size", 128)),
        conv_kernel=int(_field(raw, "conv_kernel", "mamba_d_conv", 4)),
        chunk_size=int(_field(raw, "chunk_size", "mamba_chunk_size", 128)),
        conv_bias=bool(_field(raw, "use_conv_bias", "mamba_conv_bias", True)),
        proj_bias=bool(raw.get("use_bias", False)),
        dt_limit=(float(_field(raw, "time_step_min", "mamba_dt_min", 0.001)), math.inf),
        norm_eps=eps)


def _moe_config(raw: dict[str, Any], hidden: int) -> MoEConfig:
    n_group = int(raw.get("n_group", 1))
    return MoEConfig(
        hidden_size=hidden,
        n_routed_experts=int(raw.get("n_routed_experts", raw.get("num_local_experts", 8))),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 7688)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        router="sigmoid", group_limited=n_group > 1, n_group=n_group,
        topk_group=int(raw.get("topk_group", 1)),
        shared_intermediate_size=int(raw.get("moe_shared_expert_intermediate_size", 7688)),
        expert_mlp="relu2", shared_bias=bool(raw.get("mlp_bias", False)))


def block_mlp(cfg: HybridConfig, layer_id: int) -> nn.Module:
    """An "E" block's MoE, or a "-" block's squared-ReLU MLP of intermediate_size."""
    if layer_id in cfg.moe_layers:
        return MoE(cfg.moe)
    return UngatedMLP(cfg.base.hidden_size, cfg.base.intermediate_size, cfg.base.mlp_bias)


FAMILY = HybridFamily(attention=Attention, recurrent=Mamba2Mixer, norm=RMSNorm,
                      mixer_name="mixer", ff_norm_name=None, mlp_name="mixer",
                      final_norm_name="norm_f", attention_name="mixer", input_norm_name="norm",
                      mlp=block_mlp)
# a layer's checkpoint role, by the first name under backbone.layers.N.mixer.
ROLES = {**dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), "attention"),
         **dict.fromkeys(("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj"),
                         "mamba"),
         **dict.fromkeys(("up_proj", "down_proj"), "mlp"),
         **dict.fromkeys(("gate", "experts", "shared_experts"), "moe")}


class NemotronHForCausalLM(HybridForCausalLM):
    checkpoint_prefix = "backbone."
    checkpoint_skip = ("mtp.",)

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__(cfg, FAMILY)

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor
                                  ) -> list[tuple[str, torch.Tensor]]:
        """backbone.embeddings -> the model's embed_tokens; stacked experts -> per expert."""
        if name == "backbone.embeddings.weight":
            return [("backbone.embed_tokens.weight", tensor)]
        return split_stacked_experts(name, tensor)

    def weight_role(self, name: str) -> tuple[int, str] | None:
        """Every block's module is `mixer`: its role comes from the names under it."""
        m = re.match(r"backbone\.layers\.(\d+)\.mixer\.([^.]+)", name)
        return (int(m.group(1)), ROLES.get(m.group(2), m.group(2))) if m else None

    def roles_of(self, layer: int) -> set[str]:
        if layer in self.hybrid_cfg.moe_layers:
            return {"moe"}
        return {{ATTENTION: "attention", RECURRENT: "mamba", MLP: "mlp"}[
            self.hybrid_cfg.layer_types[layer]]}


def build(raw: dict[str, Any]) -> tuple[type[nn.Module], HybridConfig]:
    return NemotronHForCausalLM, nemotron_h_config(raw)
