"""DeepSeek-V2 and DeepSeek-V3 (Kimi-K2 is a V3): multi-head latent attention (MLA) and a
mixture of experts, as transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM describe them
(checkpoint names and config fields are theirs; transformers is the reference in tests only).

Attention (MLAAttention). Per token and layer the KV cache holds one latent "head" (KVLayout with
latent_value_dim): [kv_lora_rank: the normalised compressed KV | qk_rope_head_dim: the roped
shared key], not per-head K and V. Attention runs in the weight-absorbed form: each head's
no-rope query is projected into the latent space by its rows of kv_b_proj (W_UK), attention is
one-KV-head (MQA) attention of width kv_lora_rank + qk_rope_head_dim over the latent, whose first
kv_lora_rank dims are the values; each head's output is projected out by W_UV. `forward_expanded`
is the per-head form transformers computes (K and V expanded from the latent), for tests.

Rotary dims: DeepSeek lays them out in interleaved pairs (V2 always, V3 when rope_interleave).
Queries and keys are de-interleaved before the usual rotate-half rotation: the same rotation,
the dims in another order, and q.k is unchanged by a shared permutation.

MoE: layers from first_k_dense_replace on; routed experts (top-k by softmax scores, optionally
group-limited - V2; or by sigmoid scores plus e_score_correction_bias within the best topk_group
of n_group groups, normalised - V3), times routed_scaling_factor, plus the shared experts."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import ModelConfig, yarn_mscale
from runtime.kv_cache import KVLayout
from runtime.layers.linear import Linear
from runtime.layers.moe import MoE, MoEConfig
from runtime.layers.norm import RMSNorm
from runtime.layers.rope import RotaryEmbedding
from runtime.models.dense import DecoderLayer, DenseDecoder
from runtime.models.forward import ForwardBatch

V2_ROUTING = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class MLAConfig:
    """base: the fields shared with dense models (vocab, hidden, norms, rope, dense FFN size);
    base.head_dim is the query/key head width qk_nope_head_dim + qk_rope_head_dim."""
    base: ModelConfig
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    router: str                  # "softmax" (V2) | "sigmoid" (V3)
    group_limited: bool          # route within the best topk_group of n_group groups
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    @property
    def tie_word_embeddings(self) -> bool:
        return self.base.tie_word_embeddings

    @property
    def softmax_scale(self) -> float:
        """qk head dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2 (DeepSeek)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        rope = self.base.rope
        if rope.kind == "yarn" and rope.mscale_all_dim:
            scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        return scale

    def is_moe(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    @property
    def moe(self) -> MoEConfig:
        return MoEConfig(
            hidden_size=self.base.hidden_size, n_routed_experts=self.n_routed_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor, router=self.router,
            group_limited=self.group_limited, n_group=self.n_group, topk_group=self.topk_group,
            shared_intermediate_size=self.moe_intermediate_size * self.n_shared_experts)

    @staticmethod
    def from_hf(raw: dict[str, Any]) -> MLAConfig:
        """Errors name the config field and what is supported."""
        v3 = raw.get("model_type") == "deepseek_v3"
        need = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if missing := [k for k in need if not raw.get(k)]:
            raise ValueError(f"MLA config lacks {missing}: DeepSeek-V2/V3 checkpoints give "
                             f"kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
        nope, rope_dim = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
        if rope_dim % 2:
            raise ValueError(f"qk_rope_head_dim {rope_dim} must be even (rotary pairs)")
        if int(raw.get("moe_layer_freq", 1)) != 1:
            raise ValueError(f"moe_layer_freq {raw['moe_layer_freq']} is not supported (1: every "
                             f"layer from first_k_dense_replace on is a MoE layer)")
        method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
        if not v3 and method not in V2_ROUTING:
            raise ValueError(f"topk_method {method!r} is not supported for deepseek_v2; "
                             f"supported: {V2_ROUTING}")
        if v3 and method != "noaux_tc":
            raise ValueError(f"topk_method {method!r} is not supported for deepseek_v3; "
                             f"supported: 'noaux_tc' (sigmoid scores with a correction bias)")
        experts = int(raw.get("n_routed_experts") or 0)
        groups = int(raw.get("n_group") or 1)
        group_limited = v3 or method == "group_limited_greedy"
        if experts and group_limited and experts % groups:
            raise ValueError(f"n_routed_experts {experts} is not a multiple of n_group {groups}")
        topk_group = int(raw.get("topk_group") or groups)
        if group_limited and not 1 <= topk_group <= groups:
            raise ValueError(f"topk_group {topk_group} must be in [1, n_group = {groups}]")
        base_raw = {**raw, "model_type": "llama", "head_dim": nope + rope_dim,
                    "num_key_value_heads": raw["num_attention_heads"]}
        base = replace(ModelConfig.from_dict(base_raw), architecture=raw["model_type"],
                       o_proj_bias=bool(raw.get("attention_bias", False)), raw=raw)
        return MLAConfig(
            base=base, q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
            kv_lora_rank=int(raw["kv_lora_rank"]), qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim, v_head_dim=int(raw["v_head_dim"]),
            rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
            n_routed_experts=experts, n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            router="sigmoid" if v3 else "softmax", group_limited=group_limited,
            n_group=groups, topk_group=topk_group,
            norm_topk_prob=v3 and bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))


class MLAAttention(nn.Module):
    def __init__(self, cfg: MLAConfig, layer_id: int) -> None:
        super().__init__()
        base = cfg.base
        self.layer_id = layer_id
        self.nh = base.num_heads
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.interleaved = cfg.rope_interleave
        self.scale = cfg.softmax_scale
        bias = bool(base.raw.get("attention_bias", False))
        q_out = self.nh * (self.dn + self.dr)
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(base.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = Linear(base.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(base.hidden_size, self.rank + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = Linear(self.rank, self.nh * (self.dn + self.dv), bias=False)
        self.o_proj = Linear(self.nh * self.dv, base.hidden_size, bias=bias)

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> q_nope [T, nh, dn], q_rope [T, nh, dr] (not yet rotated)."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(-1, self.nh, self.dn + self.dr).split([self.dn, self.dr], dim=-1)

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> normalised latent [T, rank], shared rope key [T, 1, dr] (not rotated)."""
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.dr], dim=-1)
        return self.kv_a_layernorm(c), k_rope.unsqueeze(1)

    def _rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleaved:          # pairs (0,1),(2,3).. -> evens then odds: rotate-half layout
            q, k = (t.unflatten(-1, (self.dr // 2, 2)).transpose(-1, -2).flatten(-2)
                    for t in (q, k))
        return rope(positions, q.contiguous(), k.contiguous())

    def _w(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [nh, dn, rank] and W_UV [nh, dv, rank]: kv_b_proj's rows per head."""
        w = self.kv_b_proj.weight.view(self.nh, self.dn + self.dv, self.rank)
        return w[:, : self.dn], w[:, self.dn:]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                batch: ForwardBatch) -> torch.Tensor:
        """Absorbed form through the backend: x [T, H] -> [T, H]."""
        q_nope, q_rope = self._queries(x)
        c, k_rope = self._latent(x)
        q_rope, k_rope = self._rotate(positions, q_rope, k_rope, rope)
        w_uk, w_uv = self._w()
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)                  # [T, nh, rank]
        q = torch.cat([q_latent, q_rope], dim=-1)                              # [T, nh, rank+dr]
        # the key [latent | rope] goes to the cache's two pools as (k, v): no concatenation
        out = batch.backend.forward(self.layer_id, q, c.unsqueeze(1), k_rope)  # [T, nh, rank]
        out = torch.einsum("thr,hvr->thv", out, w_uv)                          # [T, nh, dv]
        return self.o_proj(out.reshape(-1, self.nh * self.dv))

    def forward_expanded(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
                         ) -> torch.Tensor:
        """The per-head form for one sequence without a cache (x [T, H], causal): K and V
        expanded from the latent by kv_b_proj, as transformers computes them. Tests compare
        the absorbed form against it."""
        q_nope, q_rope = self._queries(x)
        c, k_rope = self._latent(x)
        q_rope, k_rope = self._rotate(positions, q_rope, k_rope, rope)
        kv = self.kv_b_proj(c).view(-1, self.nh, self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)               # [nh, T, dn+dr]
        k = torch.cat([k_nope, k_rope.expand(-1, self.nh, -1)], dim=-1).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), is_causal=True,
                                             scale=self.scale)                 # [nh, T, dv]
        return self.o_proj(out.transpose(0, 1).reshape(-1, self.nh * self.dv))


class DeepseekDecoder(DenseDecoder):
    """DeepSeek-V2/V3 as a dense decoder whose layers hold MLA attention and (from
    first_k_dense_replace on) MoE feed-forward layers; capture, norms and logits are shared."""

    def __init__(self, cfg: MLAConfig) -> None:
        base = cfg.base
        layers = [DecoderLayer(base, i, MLAAttention(cfg, i), MoE(cfg.moe) if cfg.is_moe(i) else None)
                  for i in range(base.num_layers)]
        super().__init__(base, layers,
                         RotaryEmbedding(cfg.qk_rope_head_dim, base.max_position, base.rope))
        self.mla_cfg = cfg

    @property
    def has_moe(self) -> bool:
        """Mixture-of-experts layers: on CUDA in bf16 their grouped path (no host sync) is
        captured in CUDA graphs with the rest of the forward (not in other dtypes:
        TargetWorker.capture_cuda_graphs); their GEMMs are not batch-invariant."""
        return any(self.mla_cfg.is_moe(i) for i in range(self.cfg.num_layers))

    @property
    def kv_layout(self) -> KVLayout:
        c = self.mla_cfg
        return KVLayout(c.base.num_layers, c.base.num_heads, 1, c.kv_lora_rank + c.qk_rope_head_dim,
                        c.softmax_scale, latent_value_dim=c.kv_lora_rank)


def build(raw: dict[str, Any]) -> tuple[type[nn.Module], MLAConfig]:
    return DeepseekDecoder, MLAConfig.from_hf(raw)
