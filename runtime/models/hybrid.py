"""Hybrid decoders: each layer a recurrent mixer (Mamba2, Gated DeltaNet) or a full-attention
block, then an MLP. Tokens of all sequences are flattened ([T, H]); attention layers go through
the attention backend, recurrent layers through the state backend of HybridAttnBackend
(runtime/attention/mamba_state_backend.py), their states in one pool (runtime/state_pool.py).

Layer ids are the model's (0..num_layers-1, as capture_layers count them); attention layers use
KV-cache layer index = their rank among attention layers, recurrent layers pool index = their
rank among recurrent layers. A family (runtime/models/bamba.py, qwen3_5.py) parses its
config.json into a HybridConfig and builds its layers; the rest is here."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from runtime.attention.mamba_state_backend import MambaStateBackend, MambaStatePath
from runtime.attention.metadata import AttentionMetadata
from runtime.config import ModelConfig
from runtime.kv_cache import KVLayout
from runtime.layers.linear import Linear, linear
from runtime.layers.mlp import GatedMLP
from runtime.layers.moe import MoE, MoEConfig
from runtime.layers.rope import NoRope, RotaryEmbedding
from runtime.models.forward import ForwardBatch, ForwardOutput
from runtime.state_pool import MambaStatePool, StateConfig
from runtime.weights import tensor_names

ATTENTION, RECURRENT = "full_attention", "linear_attention"


@dataclass(frozen=True)
class HybridConfig:
    """base: the fields shared with dense models (attention, MLP, vocab, ...); state: the
    recurrent layers' (Mamba2Config or GatedDeltaNetConfig); layer_types[i]: ATTENTION or
    RECURRENT."""
    base: ModelConfig
    state: StateConfig
    layer_types: tuple[str, ...]
    moe: MoEConfig | None = None        # the MoE layers' experts (Qwen3-Next) ...
    moe_layers: frozenset[int] = frozenset()   # ... and which layers are MoE (else SwiGLU)
    # Granite's scalings: the embeddings times embedding_multiplier, each residual branch
    # times residual_multiplier, attention scores times attention_scale (None: 1/sqrt(hd)),
    # the logits divided by logits_scaling; rope False: no rotary embedding (NoPE)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None
    logits_scaling: float = 1.0
    rope: bool = True

    @property
    def tie_word_embeddings(self) -> bool:
        return self.base.tie_word_embeddings

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == ATTENTION]

    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == RECURRENT]


def base_config(raw: dict, dense_type: str, architecture: str, **overrides) -> ModelConfig:
    """The fields a hybrid shares with dense models, read as dense model_type `dense_type`
    (llama: no q/k norm; qwen3: per-head q/k norm) with `overrides` of config.json fields
    (e.g. the partial rotary factor a family keeps in rope_parameters)."""
    base = ModelConfig.from_dict({**raw, "model_type": dense_type, **overrides})
    return replace(base, architecture=architecture, raw=raw)


def partial_rotary(raw: dict, default: float) -> float:
    """rope_parameters' partial_rotary_factor (transformers 5 keeps it there), else default."""
    return (raw.get("rope_parameters") or {}).get("partial_rotary_factor", default)


@dataclass(frozen=True)
class HybridFamily:
    """What a family builds its layers from - attention (ModelConfig, KV-cache layer index),
    recurrent mixer (state config, pool index) and RMSNorm (dim, eps) modules - and its
    checkpoint names (attention is always self_attn, a layer's first norm input_layernorm)."""
    attention: Callable[[ModelConfig, int], nn.Module]
    recurrent: Callable[[StateConfig, int], nn.Module]
    norm: Callable[[int, float], nn.Module]
    mixer_name: str                     # the recurrent mixer: "mamba", "linear_attn"
    ff_norm_name: str                   # the norm before the MLP
    mlp_name: str
    final_norm_name: str                # model.<name>.weight


class HybridLayer(nn.Module):
    """Pre-norm mixer (attention or recurrent) + residual, pre-norm MLP + residual; the modules
    registered under the family's checkpoint names."""

    def __init__(self, family: HybridFamily, kind: str, input_norm: nn.Module, mixer: nn.Module,
                 ff_norm: nn.Module, mlp: nn.Module, residual_scale: float = 1.0) -> None:
        super().__init__()
        self.kind, self.residual_scale = kind, residual_scale
        self.mixer_name, self.ff_norm_name, self.mlp_name = (
            family.mixer_name, family.ff_norm_name, family.mlp_name)
        self.input_layernorm = input_norm
        setattr(self, "self_attn" if kind == ATTENTION else family.mixer_name, mixer)
        setattr(self, family.ff_norm_name, ff_norm)
        setattr(self, family.mlp_name, mlp)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                batch: ForwardBatch, states: MambaStatePath) -> torch.Tensor:
        """x [T, H]: the residual stream before this layer -> after it."""
        h = self.input_layernorm(x)
        if self.kind == ATTENTION:
            h = self.self_attn(h, positions, rope, batch)
        else:
            h = getattr(self, self.mixer_name)(h, states)
        x = x + self._scaled(h)
        return x + self._scaled(getattr(self, self.mlp_name)(getattr(self, self.ff_norm_name)(x)))

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_scale == 1.0 else branch * self.residual_scale


class HybridForCausalLM(nn.Module):
    hybrid = True
    checkpoint_prefix = "model."        # the decoder's tensors: <prefix>layers.N..., <prefix>norm
    checkpoint_skip: tuple[str, ...] = ()   # prefixes of tensors it does not serve

    def __init__(self, cfg: HybridConfig, family: HybridFamily) -> None:
        super().__init__()
        self.hybrid_cfg, self.cfg = cfg, cfg.base
        base = cfg.base
        self.embed_tokens = nn.Embedding(base.vocab_size, base.hidden_size)
        rank = {i: r for kind in (cfg.attention_layers, cfg.recurrent_layers)
                for r, i in enumerate(kind)}
        self.layers = nn.ModuleList(_layer(family, cfg, i, rank[i])
                                    for i in range(base.num_layers))
        self.family = family
        self.final_norm_name = family.final_norm_name
        setattr(self, family.final_norm_name, family.norm(base.hidden_size, base.rms_norm_eps))
        self.lm_head = None if base.tie_word_embeddings else Linear(
            base.hidden_size, base.vocab_size, bias=False)
        self.rope = (RotaryEmbedding(base.head_dim, base.max_position, base.rope) if cfg.rope
                     else NoRope())
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
        scale = self.hybrid_cfg.attention_scale
        return KVLayout(self.num_attention_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                        c.head_dim ** -0.5 if scale is None else scale)

    def make_state_pool(self, num_slots: int, max_block_size: int, device: torch.device | str,
                        num_verify_slots: int | None = None) -> MambaStatePool:
        """num_verify_slots: sequences that can verify blocks of 2+ tokens (default: all)."""
        return MambaStatePool(self.hybrid_cfg.state, len(self.hybrid_cfg.recurrent_layers),
                              num_slots,
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
        mixer = self.family.mixer_name
        found: dict[int, set[str]] = {}
        for name in tensor_names(path):
            m = re.match(rf"{re.escape(self.checkpoint_prefix)}layers\.(\d+)\.({mixer}|self_attn)\.",
                         name)
            if m:
                found.setdefault(int(m.group(1)), set()).add(m.group(2))
        types = self.hybrid_cfg.layer_types
        for i, kind in enumerate(types):
            want = "self_attn" if kind == ATTENTION else mixer
            have = found.get(i, set())
            if have != {want}:
                raise ValueError(
                    f"checkpoint {path}: layer {i} is {kind!r} in config.json (attention "
                    f"layers {self.hybrid_cfg.attention_layers}) but its weights are "
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
        if self.hybrid_cfg.embedding_multiplier != 1.0:
            x = x * self.hybrid_cfg.embedding_multiplier
        wanted = {layer: None for layer in batch.capture_layers}
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, self.rope, batch, states)
            if i in wanted:
                wanted[i] = x
        captured = torch.cat([wanted[i] for i in batch.capture_layers], dim=-1) if wanted else None
        return ForwardOutput(hidden=getattr(self, self.final_norm_name)(x), captured=captured)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in fp32."""
        logits = linear(hidden, self.lm_head_weight).float()
        scaling = self.hybrid_cfg.logits_scaling
        return logits if scaling == 1.0 else logits / scaling


def _layer(family: HybridFamily, cfg: HybridConfig, layer_id: int, rank: int) -> HybridLayer:
    """Layer layer_id: its kind's mixer (rank: its index among that kind's layers), norms, MLP."""
    base, kind = cfg.base, cfg.layer_types[layer_id]
    mixer = (family.attention(base, rank) if kind == ATTENTION
             else family.recurrent(cfg.state, rank))
    mlp = (MoE(cfg.moe) if layer_id in cfg.moe_layers
           else GatedMLP(base.hidden_size, base.intermediate_size))
    return HybridLayer(family, kind, family.norm(base.hidden_size, base.rms_norm_eps),
                       mixer, family.norm(base.hidden_size, base.rms_norm_eps), mlp,
                       cfg.residual_multiplier)
