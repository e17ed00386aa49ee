"""TII's Falcon-H1: a hybrid decoder (runtime/models/hybrid.py) whose every layer runs attention
and a Mamba2 mixer side by side on the same normed input (kind PARALLEL: the layer has both a
KV-cache index and a state-pool index, each equal to its layer id), sums them into the residual,
then a pre-norm SwiGLU MLP. Checkpoint names follow transformers' FalconH1ForCausalLM - Bamba's
(runtime/models/bamba.py): model.embed_tokens, model.layers.N.{input_layernorm, self_attn,
mamba, pre_ff_layernorm, feed_forward}, model.final_layernorm, lm_head.

Its muP multipliers, as transformers 5.24 applies them:
  embedding_multiplier     the embeddings            -> HybridConfig.embedding_multiplier
  lm_head_multiplier       the logits                -> HybridConfig.logits_scaling = 1 / it
  attention_in_multiplier  attention's input         -> folded into q/k/v_proj weights
  key_multiplier           the keys (before RoPE)    -> folded into k_proj (weight and bias)
  attention_out_multiplier attention's output        -> folded into o_proj (weight and bias)
  ssm_in_multiplier        the mixer's input         -> folded into in_proj's weight
  ssm_multipliers [5]      in_proj's output parts z, x, B, C, dt (the "mup vector")
                                                     -> folded into in_proj's rows (and bias)
  ssm_out_multiplier       the mixer's output        -> folded into out_proj (weight and bias)
  mlp_multipliers [2]      gate_proj's output, down_proj's output -> folded into them
Folding happens as the checkpoint loads (convert_checkpoint_tensor; one rounding to the model's
dtype). The mixer: width mamba_d_ssm (default mamba_expand * hidden_size), in_proj bias
mamba_proj_bias, out_proj bias projectors_bias, and its output gate per mamba_rms_norm /
mamba_norm_before_gate (runtime/layers/mamba2.py: "none", "norm_then_gate", "gated").
Refused (with the field named): hidden_act other than silu, rope types runtime/config.py does
not know, multiplier lists of other lengths, mixer sizes that do not add up."""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from runtime.layers.mamba2 import Mamba2Config
from runtime.models.bamba import FAMILY, mamba2_config
from runtime.models.hybrid import PARALLEL, HybridConfig, HybridForCausalLM, base_config


def falcon_h1_config(raw: dict[str, Any]) -> HybridConfig:
    for name, n in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
        if raw.get(name) is not None and len(raw[name]) != n:
            raise ValueError(f"falcon_h1 {name} {raw[name]} must have {n} entries")
    base = base_config(raw, "llama", "falcon_h1", rms_norm_eps=raw.get("rms_norm_eps", 1e-5))
    norm = ("none" if not raw.get("mamba_rms_norm", False)
            else "norm_then_gate" if raw.get("mamba_norm_before_gate", True) else "gated")
    d_ssm = raw.get("mamba_d_ssm", 1024)
    mamba = mamba2_config(raw, base, None if d_ssm is None else int(d_ssm),
                          out_proj_bias=bool(raw.get("projectors_bias", False)), norm=norm)
    return HybridConfig(base, mamba, (PARALLEL,) * base.num_layers,
                        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
                        logits_scaling=1.0 / float(raw.get("lm_head_multiplier", 1.0)))


def folded_scales(raw: dict[str, Any], mamba: Mamba2Config
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module (under model.layers.N.) -> (its weight's row scale [out] or [], its bias's scale)
    that fold Falcon-H1's in-layer multipliers into the weights (module docstring)."""
    m = lambda key: float(raw.get(key, 1.0))
    a_in, key, a_out = m("attention_in_multiplier"), m("key_multiplier"), m(
        "attention_out_multiplier")
    s_in, s_out = m("ssm_in_multiplier"), m("ssm_out_multiplier")
    gate, down = raw.get("mlp_multipliers") or (1.0, 1.0)
    z, x, b, c, dt = raw.get("ssm_multipliers") or (1.0,) * 5
    inner, gn = mamba.intermediate_size, mamba.num_groups * mamba.state_size
    mup = torch.cat([torch.full((n,), float(v)) for n, v in
                     ((inner, z), (inner, x), (gn, b), (gn, c), (mamba.num_heads, dt))])
    t = lambda v: torch.as_tensor(float(v))
    return {"self_attn.q_proj": (t(a_in), t(1.0)), "self_attn.k_proj": (t(a_in * key), t(key)),
            "self_attn.v_proj": (t(a_in), t(1.0)), "self_attn.o_proj": (t(a_out), t(a_out)),
            "mamba.in_proj": (mup * s_in, mup), "mamba.out_proj": (t(s_out), t(s_out)),
            "feed_forward.gate_proj": (t(gate), t(gate)),
            "feed_forward.down_proj": (t(down), t(down))}


_SCALED = re.compile(r"model\.layers\.\d+\.(\w+\.\w+)\.(weight|bias)")


class FalconH1ForCausalLM(HybridForCausalLM):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__(cfg, FAMILY)
        self._scales: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def convert_checkpoint_tensor(self, name: str, tensor: torch.Tensor
                                  ) -> list[tuple[str, torch.Tensor]]:
        """A projection times its multipliers (fp32; the loader casts to the model's dtype)."""
        if self._scales is None:            # built here, not under build_empty's meta device
            self._scales = folded_scales(self.cfg.raw, self.hybrid_cfg.state)
        m = _SCALED.fullmatch(name)
        if m is None or m.group(1) not in self._scales:
            return [(name, tensor)]
        weight_scale, bias_scale = self._scales[m.group(1)]
        if m.group(2) == "bias":
            return [(name, tensor.float() * bias_scale)]
        return [(name, tensor.float() * (weight_scale[:, None] if weight_scale.dim()
                                         else weight_scale))]


def build(raw: dict[str, Any]) -> tuple[type[nn.Module], HybridConfig]:
    return FalconH1ForCausalLM, falcon_h1_config(raw)
