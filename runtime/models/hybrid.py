"""Hybrid decoders: each layer a recurrent mixer (Mamba2, Gated DeltaNet), a full-attention block,
both side by side (Falcon-H1) or - in families whose layers are single blocks (NemotronH) - an MLP
or mixture of experts alone; then, unless the family's layers are single blocks, an MLP. Tokens
of all sequences are flattened ([T, H]); attention goes through the attention backend,
recurrent mixers through the state backend of HybridAttnBackend
(runtime/attention/mamba_state_backend.py), their states in one pool (runtime/state_pool.py).

Layer ids are the model's (0..num_layers-1, as capture_layers count them); a layer with attention
uses KV-cache layer index = its rank among the layers with attention, a layer with a recurrent
mixer pool index = its rank among the layers with one (an MLP-only block has neither; a parallel
layer both). A family (runtime/models/bamba.py, qwen3_5.py, nemotron_h.py, falcon_h1.py) parses
its config.json into a HybridConfig and builds its layers; the rest is here."""
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
MLP = "mlp"                  # a feed-forward block alone (NemotronH "-", or "E": MoE)
PARALLEL = "parallel"        # attention and a recurrent mixer on the same input (Falcon-H1)
WITH_ATTENTION, WITH_STATE = (ATTENTION, PARALLEL), (RECURRENT, PARALLEL)


@dataclass(frozen=True)
class HybridConfig:
    """base: the fields shared with dense models (attention, MLP, vocab, ...); state: the
    recurrent layers' (Mamba2Config or GatedDeltaNetConfig); layer_types[i]: ATTENTION,
    RECURRENT, MLP or PARALLEL."""
    base: ModelConfig
    state: StateConfig
    layer_types: tuple[str, ...]
    moe: MoEConfig | None = None        # the MoE layers' experts (Qwen3-Next) ...
    moe_layers: frozenset[int] = frozenset()   # ... and which layers' MLPs are MoE
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
        """The layers with attention, in KV-cache index order."""
        return [i for i, t in enumerate(self.layer_types) if t in WITH_ATTENTION]

    @property
    def recurrent_layers(self) -> list[int]:
        """The layers with a recurrent mixer, in state-pool index order."""
        return [i for i, t in enumerate(self.layer_types) if t in WITH_STATE]


def base_config(raw: dict, dense_type: str, architecture: str, **overrides) -> ModelConfig:
    """The fields a hybrid shares with dense models, read as dense model_type `dense_type`
    (llama: no q/k norm; qwen3: per-head q/k norm) with `overrides` of config.json fields
    (e.g. the partial rotary factor a family keeps in rope_parameters)."""
    base = ModelConfig.from_dict({**raw, "model_type": dense_type, **overrides})
    return replace(base, architecture=architecture, raw=raw)


def partial_rotary(raw: dict, default: float) -> float:
    """rope_parameters' partial_rotary_factor (transformers 5 keeps it there), else default."""
    return (raw.get("rope_parameters") or {}).get("partial_rotary_factor", default)


def dense_mlp(cfg: HybridConfig, layer_id: int) -> nn.Module:
    """A layer's MLP: the MoE in cfg.moe_layers, else a SwiGLU of intermediate_size."""
    base = cfg.base
    return (MoE(cfg.moe) if layer_id in cfg.moe_layers
            else GatedMLP(base.hidden_size, base.intermediate_size, base.mlp_bias))


@dataclass(frozen=True)
class HybridFamily:
    """What a family builds its layers from - attention (ModelConfig, KV-cache layer index),
    recurrent mixer (state config, pool index), MLP (HybridConfig, layer id) and RMSNorm (dim,
    eps) modules - and its checkpoint names. ff_norm_name None: each layer is one block (norm,
    then its mixer or its MLP alone, + residual; NemotronH), else a mixer block then a pre-norm
    MLP block."""
    attention: Callable[[ModelConfig, int], nn.Module]
    recurrent: Callable[[StateConfig, int], nn.Module]
    norm: Callable[[int, float], nn.Module]
    mixer_name: str                     # the recurrent mixer: "mamba", "linear_attn"
    ff_norm_name: str | None            # the norm before the MLP (None: single blocks)
    mlp_name: str
    final_norm_name: str                # model.<name>.weight
    attention_name: str = "self_attn"
    input_norm_name: str = "input_layernorm"
    mlp: Callable[[HybridConfig, int], nn.Module] = dense_mlp


class HybridLayer(nn.Module):
    """Pre-norm block + residual: attention, a recurrent mixer, both side by side (summed) or an
    MLP alone; then, with an ff_norm, a pre-norm MLP + residual. The modules are registered
    under the family's checkpoint names."""

    def __init__(self, family: HybridFamily, kind: str, input_norm: nn.Module,
                 mixers: dict[str, nn.Module], ff_norm: nn.Module | None = None,
                 mlp: nn.Module | None = None, residual_scale: float = 1.0) -> None:
        """mixers: the block's modules by role - "attention", "recurrent" and/or "mlp"."""
        super().__init__()
        self.kind, self.residual_scale = kind, residual_scale
        names = {"attention": family.attention_name, "recurrent": family.mixer_name,
                 "mlp": family.mlp_name}
        self.names = {role: names[role] for role in mixers}
        self.input_norm_name, self.ff_norm_name = family.input_norm_name, family.ff_norm_name
        setattr(self, family.input_norm_name, input_norm)
        for role, module in mixers.items():
            setattr(self, self.names[role], module)
        if ff_norm is not None:
            setattr(self, family.ff_norm_name, ff_norm)
            setattr(self, family.mlp_name, mlp)
            self.names["ff"] = family.mlp_name

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                batch: ForwardBatch, states: MambaStatePath) -> torch.Tensor:
        """x [T, H]: the residual stream before this layer -> after it."""
        h = getattr(self, self.input_norm_name)(x)
        if self.kind == MLP:
            branch = getattr(self, self.names["mlp"])(h)
        else:
            branch = (getattr(self, self.names["recurrent"])(h, states)
                      if self.kind in WITH_STATE else None)
            if self.kind in WITH_ATTENTION:
                attn = getattr(self, self.names["attention"])(h, positions, rope, batch)
                branch = attn if branch is None else branch + attn
        x = x + self._scaled(branch)
        if "ff" not in self.names:
            return x
        return x + self._scaled(getattr(self, self.names["ff"])(
            getattr(self, self.ff_norm_name)(x)))

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
        kv_index = {i: r for r, i in enumerate(cfg.attention_layers)}
        pool_index = {i: r for r, i in enumerate(cfg.recurrent_layers)}
        self.layers = nn.ModuleList(_layer(family, cfg, i, kv_index.get(i), pool_index.get(i))
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

    def weight_role(self, name: str) -> tuple[int, str] | None:
        """A checkpoint tensor -> (its layer, the role its module has there: the family's
        attention or recurrent mixer name), or None for any other tensor."""
        f = self.family
        roles = "|".join(re.escape(n) for n in (f.attention_name, f.mixer_name))
        m = re.match(rf"{re.escape(self.checkpoint_prefix)}layers\.(\d+)\.({roles})\.", name)
        return (int(m.group(1)), m.group(2)) if m else None

    def roles_of(self, layer: int) -> set[str]:
        """The roles weight_role should find in layer `layer` (by its kind)."""
        f = self.family
        return {ATTENTION: {f.attention_name}, RECURRENT: {f.mixer_name}, MLP: {f.mlp_name},
                PARALLEL: {f.attention_name, f.mixer_name}}[self.hybrid_cfg.layer_types[layer]]

    def check_checkpoint(self, path: str | Path) -> None:
        """The checkpoint's per-layer mixer weights must match layer_types (before loading)."""
        found: dict[int, set[str]] = {}
        for name in tensor_names(path):
            if (hit := self.weight_role(name)) is not None:
                found.setdefault(hit[0], set()).add(hit[1])
        types = self.hybrid_cfg.layer_types
        for i, kind in enumerate(types):
            want, have = self.roles_of(i), found.get(i, set())
            if have != want:
                raise ValueError(
                    f"checkpoint {path}: layer {i} is {kind!r} in config.json (attention "
                    f"layers {self.hybrid_cfg.attention_layers}) but its weights are "
                    f"{sorted(have) or 'missing'}, not {sorted(want)}")
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


def _layer(family: HybridFamily, cfg: HybridConfig, layer_id: int, kv_index: int | None,
           pool_index: int | None) -> HybridLayer:
    """Layer layer_id: its kind's modules (attention at KV-cache index kv_index, the recurrent
    mixer at state-pool index pool_index), its norms and, unless single blocks, its MLP."""
    base, kind = cfg.base, cfg.layer_types[layer_id]
    norm = lambda: family.norm(base.hidden_size, base.rms_norm_eps)
    mixers: dict[str, nn.Module] = {}
    if kind in WITH_STATE:
        mixers["recurrent"] = family.recurrent(cfg.state, pool_index)
    if kind in WITH_ATTENTION:
        mixers["attention"] = family.attention(base, kv_index)
    if kind == MLP:                     # single-block families only
        mixers["mlp"] = family.mlp(cfg, layer_id)
    if family.ff_norm_name is None:
        return HybridLayer(family, kind, norm(), mixers, residual_scale=cfg.residual_multiplier)
    return HybridLayer(family, kind, norm(), mixers, norm(), family.mlp(cfg, layer_id),
                       cfg.residual_multiplier)
