"""Bamba (IBM): a hybrid decoder whose layers are each a Mamba2 mixer or a full-attention block,
followed by a SwiGLU MLP. Tokens of all sequences are flattened ([T, H]); attention layers go
through the attention backend, mamba layers through the state backend of HybridAttnBackend.

Layer ids are the model's (0..num_layers-1, as capture_layers count them); attention layers use
KV-cache layer index = their rank among attention layers, mamba layers pool index = their rank
among mamba layers. Checkpoint names follow transformers' BambaForCausalLM."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runtime.attention.mamba_state_backend import MambaStateBackend, MambaStatePath
from runtime.attention.metadata import AttentionMetadata
from runtime.config import ModelConfig
from runtime.kv_cache import KVLayout
from runtime.layers.linear import Linear, linear
from runtime.layers.mamba2 import Mamba2Config, Mamba2Mixer
from runtime.layers.mlp import GatedMLP
from runtime.layers.norm import RMSNorm
from runtime.layers.rope import RotaryEmbedding
from runtime.models.dense import Attention
from runtime.models.forward import ForwardBatch, ForwardOutput
from runtime.state_pool import MambaStatePool
from runtime.weights import tensor_names

ATTENTION, MAMBA = "full_attention", "linear_attention"


@dataclass(frozen=True)
class HybridConfig:
    """base: the fields shared with dense models (attention, MLP, vocab, ...);
    layer_types[i]: ATTENTION or MAMBA."""
    base: ModelConfig
    mamba: Mamba2Config
    layer_types: tuple[str, ...]

    @property
    def tie_word_embeddings(self) -> bool:
        return self.base.tie_word_embeddings

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == ATTENTION]

    @property
    def mamba_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == MAMBA]

    @staticmethod
    def from_bamba(raw: dict[str, Any]) -> HybridConfig:
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise ValueError("bamba checkpoints with attention_bias or mlp_bias are not supported")
        hidden, layers = int(raw["hidden_size"]), int(raw["num_hidden_layers"])
        rope = dict(raw.get("rope_parameters") or {})
        # transformers' Bamba always rotates half of each head (partial_rotary_factor 0.5)
        base_raw = {**raw, "model_type": "llama",
                    "partial_rotary_factor": rope.get("partial_rotary_factor", 0.5)}
        base = replace(ModelConfig.from_dict(base_raw), architecture="bamba", raw=raw)
        attn = set(raw.get("attn_layer_indices") or [])
        if bad := sorted(i for i in attn if not 0 <= i < layers):
            raise ValueError(f"attn_layer_indices {bad} outside the {layers} layers")
        heads = int(raw.get("mamba_n_heads", 128))
        expand = int(raw.get("mamba_expand", 2))
        d_head = raw.get("mamba_d_head", "auto")
        mamba = Mamba2Config(
            hidden_size=hidden, num_heads=heads,
            head_dim=expand * hidden // heads if d_head in (None, "auto") else int(d_head),
            num_groups=int(raw.get("mamba_n_groups", 1)),
            state_size=int(raw.get("mamba_d_state", 256)),
            conv_kernel=int(raw.get("mamba_d_conv", 4)),
            chunk_size=int(raw.get("mamba_chunk_size", 256)),
            conv_bias=bool(raw.get("mamba_conv_bias", True)),
            proj_bias=bool(raw.get("mamba_proj_bias", False)),
            dt_limit=_dt_limit(raw.get("time_step_limit")), norm_eps=base.rms_norm_eps)
        if mamba.intermediate_size != expand * hidden:
            raise ValueError(f"mamba_n_heads * mamba_d_head = {mamba.intermediate_size} must equal "
                             f"mamba_expand * hidden_size = {expand * hidden}")
        types = tuple(ATTENTION if i in attn else MAMBA for i in range(layers))
        return HybridConfig(base, mamba, types)


def _dt_limit(value: Any) -> tuple[float, float]:
    """time_step_limit as transformers writes it: [lo, hi], hi maybe {"__float__": "Infinity"}."""
    if not value:
        return (0.0, math.inf)
    lo, hi = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in value)
    return (lo, hi)


class BambaLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, layer_id: int, kind_index: int) -> None:
        super().__init__()
        base = cfg.base
        self.kind = cfg.layer_types[layer_id]
        self.input_layernorm = RMSNorm(base.hidden_size, base.rms_norm_eps)
        if self.kind == ATTENTION:
            self.self_attn = Attention(base, kind_index)
        else:
            self.mamba = Mamba2Mixer(cfg.mamba, kind_index)
        self.pre_ff_layernorm = RMSNorm(base.hidden_size, base.rms_norm_eps)
        self.feed_forward = GatedMLP(base.hidden_size, base.intermediate_size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                batch: ForwardBatch, states: MambaStatePath) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == ATTENTION:
            x = x + self.self_attn(h, positions, rope, batch)
        else:
            x = x + self.mamba(h, states)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class BambaForCausalLM(nn.Module):
    hybrid = True

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.hybrid_cfg, self.cfg = cfg, cfg.base
        base = cfg.base
        self.embed_tokens = nn.Embedding(base.vocab_size, base.hidden_size)
        rank = {i: r for kind in (cfg.attention_layers, cfg.mamba_layers)
                for r, i in enumerate(kind)}
        self.layers = nn.ModuleList(BambaLayer(cfg, i, rank[i]) for i in range(base.num_layers))
        self.final_layernorm = RMSNorm(base.hidden_size, base.rms_norm_eps)
        self.lm_head = None if base.tie_word_embeddings else Linear(
            base.hidden_size, base.vocab_size, bias=False)
        self.rope = RotaryEmbedding(base.head_dim, base.max_position, base.rope)
        self.state_backend: MambaStatePath | None = None

    # -- what the target worker asks of a hybrid model ----------------------------------------
    @property
    def num_attention_layers(self) -> int:
        return len(self.hybrid_cfg.attention_layers)

    @property
    def attention_layer_ids(self) -> list[int]:
        """Model layer id of each KV-cache layer."""
        return self.hybrid_cfg.attention_layers

    @property
    def kv_layout(self) -> KVLayout:
        c = self.cfg
        return KVLayout(self.num_attention_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                        c.head_dim ** -0.5)

    def make_state_pool(self, num_slots: int, max_block_size: int, device: torch.device | str,
                        num_verify_slots: int | None = None) -> MambaStatePool:
        """num_verify_slots: sequences that can verify blocks of 2+ tokens (default: all)."""
        return MambaStatePool(self.hybrid_cfg.mamba, len(self.hybrid_cfg.mamba_layers), num_slots,
                              num_slots if num_verify_slots is None else num_verify_slots,
                              max_block_size, self.embed_tokens.weight.dtype, device)

    def make_state_backend(self, pool: MambaStatePool, can_commit: bool) -> MambaStatePath:
        """can_commit False builds a backend without commit_verified_state (tests of refusal)."""
        self.state_backend = (MambaStateBackend if can_commit else MambaStatePath)(pool)
        return self.state_backend

    def set_state_context(self, meta: AttentionMetadata, state_slots: list[int],
                          verify: list[bool] | None) -> None:
        if self.state_backend is None:
            raise RuntimeError("set_state_context before make_state_backend")
        self.state_backend.plan(meta, state_slots, verify or [False] * meta.batch_size)

    def check_checkpoint(self, path: str | Path) -> None:
        """The checkpoint's per-layer mixer weights must match layer_types (before loading)."""
        found: dict[int, set[str]] = {}
        for name in tensor_names(path):
            m = re.match(r"model\.layers\.(\d+)\.(mamba|self_attn)\.", name)
            if m:
                found.setdefault(int(m.group(1)), set()).add(m.group(2))
        types = self.hybrid_cfg.layer_types
        for i, kind in enumerate(types):
            want = "self_attn" if kind == ATTENTION else "mamba"
            have = found.get(i, set())
            if have != {want}:
                raise ValueError(
                    f"checkpoint {path}: layer {i} is {kind!r} in config.json (attn_layer_indices="
                    f"{self.hybrid_cfg.attention_layers}) but its weights are "
                    f"{sorted(have) or 'missing'}, not {want!r}")
        if extra := sorted(set(found) - set(range(len(types)))):
            raise ValueError(f"checkpoint {path}: weights for layers {extra} beyond the "
                             f"{len(types)} layers of config.json")

    # -- forward ----------------------------------------------------------------------------------
    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
                ) -> ForwardOutput:
        """input_ids, positions: int64 [T]; batch.backend is a HybridAttnBackend whose state
        backend was planned by set_state_context for this forward."""
        states = getattr(batch.backend, "mamba", None)
        if states is None:
            raise RuntimeError("a hybrid model runs under a HybridAttnBackend with a mamba state "
                               "backend (TargetWorker.init_attention_backends builds one)")
        x = self.embed_tokens(input_ids)
        wanted = {layer: None for layer in batch.capture_layers}
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rope, batch, states)
            if i in wanted:
                wanted[i] = x
        captured = torch.cat([wanted[i] for i in batch.capture_layers], dim=-1) if wanted else None
        return ForwardOutput(hidden=self.final_layernorm(x), captured=captured)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in fp32."""
        return linear(hidden, self.lm_head_weight).float()


def build(raw: dict[str, Any]) -> tuple[type[nn.Module], HybridConfig]:
    return BambaForCausalLM, HybridConfig.from_bamba(raw)
