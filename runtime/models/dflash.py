"""The DFlash block drafter, in z-lab's checkpoint format, plus the two target tensors it borrows.

Checkpoint: `config.json` with Qwen3 layer fields (hidden_size, num_hidden_layers, heads, head_dim,
intermediate_size, rms_norm_eps, rope_theta / rope_scaling, optional layer_types + sliding_window),
`block_size` and `dflash_config` {target_layer_ids, mask_token_id} (either key may also sit at the
top level); safetensors `layers.N.*` (Qwen3 names), `fc.weight` [H, K*H], `hidden_norm.weight`,
`norm.weight`. No embedding and no LM head: `TargetHead` reads `model.embed_tokens.weight` (a
multimodal target's `model.language_model.embed_tokens.weight`, NemotronH's
`backbone.embeddings.weight`: runtime/config.embedding_name) and `lm_head.weight` (tied targets:
the embedding) from the target's directory, and nothing else; it applies the target family's
embedding and logit multipliers (Granite, Falcon-H1) as the target does.
Our own tools add `target_fingerprint` {vocab_size, hidden_size, num_layers, tokenizer_hash}, and
may add `dflash_config.layer_passes` P (default 1): the block runs through the layer stack P times
with the same weights (z-lab's code would run it once: such a checkpoint is ours only). A layer's
context K/V depend only on the projected context and that layer's weights, so every pass reads
the same cached context K/V.

Semantics verified by reading (never copying) z-lab/dflash `dflash/model.py` @10129599
(`Qwen3DFlashAttention`, `Qwen3DFlashDecoderLayer`, `DFlashDraftModel`, `dflash_generate`,
`build_target_layer_ids`) and SGLang `python/sglang/srt/models/dflash.py` @003b23d7 with its
worker's `_append_target_hidden_to_draft_kv_by_loc` / `_append_target_hidden_sequential`:
  - context features [N, K*H] (target layer outputs, concatenated) go through `fc` then
    `hidden_norm` once; the same projected context feeds every layer.
  - they do NOT pass through a layer's `input_layernorm`: ZL normalises only the block's hidden
    states and feeds `target_hidden` straight to k_proj / v_proj; SGL's
    `prepare_context_hidden_for_kv` is the identity before `kv_proj_only`.
  - each layer: context K = k_norm(k_proj(ctx)), V = v_proj(ctx) (no norm on V), RoPE on K at the
    context tokens' own positions (ZL passes position_ids [start - ctx_len, start + B)); block
    Q/K/V from the block with q_norm/k_norm and RoPE at positions L..L+B-1, L = context length.
  - the block is [anchor, MASK x (B-1)] embedded with the target's embedding, times
    `input_embedding_scale` (ZL `_draft_value`, default 1).
  - attention: block queries see all context keys and the whole block (non-causal; ZL
    `is_causal=False`, SGL `ENCODER_ONLY`); `sliding_attention` layers are causal with their
    window (ZL `is_causal = layer_type == "sliding_attention"` unless config `is_causal` is set;
    SGL `DECODER` + window). A sliding layer forced non-causal (`is_causal: false`) keeps only
    the backward window bound here; ZL also bounds keys ahead, which matters only for B > window.
  - output = norm(hidden); drafts = argmax of the target LM head over block positions 1..B-1.
    ZL's optional `output_multiplier` / logit soft-capping are monotonic and so leave the
    greedy argmax unchanged; they are not applied.
  - default target layers: `build_target_layer_ids` (1 draft layer: [T//2]; else D ids spread
    evenly over [1, T-3], rounded).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from runtime.config import (
    ModelConfig,
    embedding_name,
    head_scales,
    num_layers,
    read_config_json,
    text_config,
)
from runtime.layers.linear import Linear, linear
from runtime.layers.norm import RMSNorm
from runtime.layers.rope import RotaryEmbedding
from runtime.models.dense import Attention, DecoderLayer
from runtime.models.forward import ForwardBatch
from runtime.models.registry import build_empty
from runtime.tokenizer import tokenizer_fingerprint
from runtime.weights import load_weights, read_tensors, safetensors_files

LAYER_TYPES = ("full_attention", "sliding_attention")
LM_HEAD_NAME = "lm_head.weight"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default taps: the middle layer for one draft layer, else D ids spread evenly
    over [1, T-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1))
            for i in range(num_draft_layers)]


def target_layer_ids_problem(ids: list[int] | tuple[int, ...], num_target_layers: int) -> str:
    """What is wrong with tapping `ids` of a target with T layers ('' = nothing: distinct ids,
    each in [0, T))."""
    if len(set(ids)) == len(ids) and all(0 <= i < num_target_layers for i in ids):
        return ""
    return (f"target_layer_ids {list(ids)} must be distinct ids in [0, {num_target_layers}) "
            f"(the target has {num_target_layers} layers)")


def check_target_layer_ids(ids: list[int] | tuple[int, ...], num_target_layers: int,
                           explicit: bool) -> None:
    """ValueError unless `ids` can be tapped; `explicit` = given by the user, else DFlash's rule
    chose them (too few target layers for that many distinct taps)."""
    problem = target_layer_ids_problem(ids, num_target_layers)
    if problem:
        hint = "" if explicit else (" (DFlash's default rule gave these for this small target: "
                                    "pass --target-layer-ids)")
        raise ValueError(problem + hint)


@dataclass(frozen=True)
class TargetFingerprint:
    """What a drafter was made for; compared with the target directory it is served against."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    tokenizer_hash: str

    @staticmethod
    def of_target(target_dir: str | Path) -> TargetFingerprint:
        raw = text_config(read_config_json(target_dir))
        return TargetFingerprint(int(raw["vocab_size"]), int(raw["hidden_size"]),
                                 num_layers(raw), tokenizer_fingerprint(str(target_dir)))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TargetFingerprint:
        return TargetFingerprint(int(d["vocab_size"]), int(d["hidden_size"]),
                                 int(d["num_layers"]), str(d.get("tokenizer_hash", "")))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def differences(self, target: TargetFingerprint) -> list[str]:
        """One line per field that differs: made-for (expected) vs the target given (got)."""
        return [f"target {name}: the drafter was made for {getattr(self, name)!r}, "
                f"the target has {getattr(target, name)!r}"
                for name in ("vocab_size", "hidden_size", "num_layers", "tokenizer_hash")
                if getattr(self, name) != getattr(target, name)]


def _draft_value(raw: dict[str, Any], name: str, default: Any = None) -> Any:
    """dflash_config[name], else the top-level key (z-lab's lookup order)."""
    return (raw.get("dflash_config") or {}).get(name, raw.get(name, default))


@dataclass(frozen=True)
class DFlashConfig:
    base: ModelConfig                    # the Qwen3 layer fields (per-head q/k norm)
    block_size: int                      # trained block B (anchor + B-1 drafts)
    target_layer_ids: tuple[int, ...]    # K target layers whose outputs form the features
    mask_token_id: int
    layer_types: tuple[str, ...]         # per draft layer
    sliding_window: int | None
    is_causal: bool | None               # config override of the per-layer rule
    input_embedding_scale: float = 1.0
    layer_passes: int = 1                # times the block runs through the layer stack
    target_fingerprint: TargetFingerprint | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_layers(self) -> int:
        return self.base.num_layers

    @property
    def hidden_size(self) -> int:
        return self.base.hidden_size

    def layer_schedule(self) -> list[int]:
        """The draft layers in the order the block runs through them (each pass the whole stack)."""
        return list(range(self.base.num_layers)) * self.layer_passes

    @property
    def feature_width(self) -> int:
        """K*H: the width of one token's context features."""
        return len(self.target_layer_ids) * self.base.hidden_size

    def attention(self, layer: int) -> tuple[bool, int | None]:
        """(causal, window) of a draft layer."""
        sliding = self.layer_types[layer] == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, self.sliding_window if sliding else None

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> DFlashConfig:
        base = ModelConfig.from_dict({**raw, "model_type": "qwen3"})
        ids = _draft_value(raw, "target_layer_ids")
        if ids is None and raw.get("num_target_layers"):
            ids = build_target_layer_ids(int(raw["num_target_layers"]), base.num_layers)
        if not ids:
            raise ValueError("the draft config has no dflash_config.target_layer_ids")
        mask = _draft_value(raw, "mask_token_id")
        if mask is None:
            raise ValueError("the draft config has no dflash_config.mask_token_id")
        layer_types = tuple(_draft_value(raw, "layer_types") or
                            ["full_attention"] * base.num_layers)
        window = _draft_value(raw, "sliding_window")
        _check_layer_types(layer_types, base.num_layers, window)
        causal = _draft_value(raw, "is_causal")
        passes = int(_draft_value(raw, "layer_passes", 1))
        if passes < 1:
            raise ValueError(f"dflash_config.layer_passes must be >= 1, got {passes}")
        fp = raw.get("target_fingerprint")
        return DFlashConfig(
            base=base, block_size=int(_draft_value(raw, "block_size", 16)),
            target_layer_ids=tuple(int(i) for i in ids), mask_token_id=int(mask),
            layer_types=layer_types, sliding_window=int(window) if window else None,
            is_causal=None if causal is None else bool(causal),
            input_embedding_scale=float(_draft_value(raw, "input_embedding_scale", 1.0)),
            layer_passes=passes,
            target_fingerprint=TargetFingerprint.from_dict(fp) if fp else None, raw=raw)

    @staticmethod
    def from_dir(path: str | Path) -> DFlashConfig:
        return DFlashConfig.from_dict(read_config_json(path))


def _check_layer_types(layer_types: tuple[str, ...], num_layers: int, window: Any) -> None:
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    bad = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"layer_types {bad} are not supported; allowed: {list(LAYER_TYPES)}")
    if "sliding_attention" in layer_types and not window:
        raise ValueError("sliding_attention layers need a sliding_window in the config")


class DFlashAttention(Attention):
    """Qwen3 attention whose queries come from the block only; context K/V are projected
    separately (`context_kv`) and already sit in the cache when the block attends."""

    def __init__(self, cfg: ModelConfig, layer_id: int, causal: bool, window: int | None) -> None:
        super().__init__(cfg, layer_id)
        self.causal, self.window = causal, window

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.project_qkv(x, positions, rope)
        out = batch.backend.forward(self.layer_id, q, k, v, causal=self.causal, window=self.window)
        return self.o_proj(out.reshape(-1, self.q_size))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """ctx [N, H] (projected features) -> k/v [N, nkv, hd]: k_norm + RoPE on k; q skipped."""
        weight = self.qkv_proj.weight[self.q_size:]
        bias = self.qkv_proj.bias[self.q_size:] if self.qkv_proj.bias is not None else None
        k, v = linear(ctx, weight, bias).split([self.kv_size, self.kv_size], dim=-1)
        k = self.k_norm(k.reshape(-1, self.nkv, self.hd))
        _, k = rope(positions, k, k)
        return k, v.reshape(-1, self.nkv, self.hd)


class DFlashDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_id: int, causal: bool, window: int | None) -> None:
        super().__init__(cfg, layer_id)
        self.self_attn = DFlashAttention(cfg, layer_id, causal, window)


class DFlashDraftModel(nn.Module):
    """Parameter names follow the checkpoint (layers.N..., fc, hidden_norm, norm) except the
    fused qkv_proj / gate_up_proj that runtime.weights fills from the separate tensors."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        base = cfg.base
        self.layers = nn.ModuleList(DFlashDecoderLayer(base, i, *cfg.attention(i))
                                    for i in range(base.num_layers))
        self.fc = Linear(cfg.feature_width, base.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(base.hidden_size, base.rms_norm_eps)
        self.norm = RMSNorm(base.hidden_size, base.rms_norm_eps)
        self.rope = RotaryEmbedding(base.head_dim, base.max_position, base.rope)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """features [N, K*H] -> [N, H] (fc + hidden_norm)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [N, K*H], positions int64 [N] -> per draft layer (k, v) [N, nkv, hd]."""
        return self.projected_context_kv(self.project_context(features), positions)

    def projected_context_kv(self, ctx: torch.Tensor, positions: torch.Tensor
                             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ctx [N, H] (project_context's output) -> per draft layer (k, v) [N, nkv, hd]; every
        pass of a layer reads the same."""
        return [layer.self_attn.context_kv(ctx, positions, self.rope) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """block_embeds [T, H] (flattened blocks), positions int64 [T] -> norm(hidden) [T, H].
        The backend must be prepared with the blocks' metadata over the cached context."""
        x = block_embeds.to(self.fc.weight.dtype)
        for i in self.cfg.layer_schedule():
            x = self.layers[i](x, positions, self.rope, batch)
        return self.norm(x)


class TargetHead:
    """The target's token embedding [V, H] and LM head [V, H] (the same tensor when tied), with
    the scales its family applies around them (runtime/config.head_scales)."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor, embed_scale: float = 1.0,
                 logit_scale: float = 1.0, vocab_ids: torch.Tensor | None = None) -> None:
        """vocab_ids: int64 [K] on the head's device when the LM head holds only those tokens'
        rows (a drafter's vocabulary: runtime/draft_vocab.py): logits then have K columns and
        greedy / token_ids map columns back to token ids."""
        self.embed_weight = embed
        self.lm_head_weight = lm_head
        self.embed_scale, self.logit_scale = embed_scale, logit_scale
        self.vocab_ids = vocab_ids

    def restricted(self, ids: tuple[int, ...] | None) -> TargetHead:
        """This head scoring only `ids` (their LM head rows copied, contiguous); itself for
        None. The embedding stays whole."""
        if ids is None:
            return self
        index = torch.tensor(ids, dtype=torch.int64, device=self.lm_head_weight.device)
        return TargetHead(self.embed_weight, self.lm_head_weight[index].contiguous(),
                          self.embed_scale, self.logit_scale, index)

    @staticmethod
    def load(target_dir: str | Path, dtype: torch.dtype, device: torch.device | str,
             random_weights: bool = False) -> TargetHead:
        full = read_config_json(target_dir)
        raw = text_config(full)
        tied = bool(raw.get("tie_word_embeddings", False))
        scales = head_scales(raw)
        if random_weights:
            shape = (int(raw["vocab_size"]), int(raw["hidden_size"]))
            embed = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02)
            return TargetHead(embed, embed if tied else torch.empty_like(embed).normal_(0.0, 0.02),
                              *scales)
        embed_name = embedding_name(full)
        names = {embed_name} if tied else {embed_name, LM_HEAD_NAME}
        found = read_tensors(target_dir, names)
        missing = sorted(names - set(found))
        if missing:
            raise ValueError(f"target checkpoint {target_dir} lacks {missing} "
                             f"(tie_word_embeddings={tied})")
        embed = found[embed_name].to(device=device, dtype=dtype)
        head = embed if tied else found[LM_HEAD_NAME].to(device=device, dtype=dtype)
        return TargetHead(embed, head, *scales)

    @property
    def vocab_size(self) -> int:
        return self.embed_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed_weight.shape[1]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 [T] -> [T, H]."""
        x = F.embedding(ids, self.embed_weight)
        return x if self.embed_scale == 1.0 else x * self.embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, V], or [N, K] for a restricted head (differentiable:
        the training loss uses it too)."""
        logits = linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight).float()
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Logit columns (any shape) -> token ids: the same unless the head is restricted."""
        return columns if self.vocab_ids is None else self.vocab_ids[columns]

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> int64 [N]: the token of the largest fp32 logit."""
        return self.token_ids(self.logits(hidden).argmax(-1))


# -- checkpoint I/O --------------------------------------------------------------------------

def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers (no tensor data is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_fc_shape(cfg: DFlashConfig, shapes: dict[str, tuple[int, ...]], path: str | Path) -> None:
    expected = (cfg.hidden_size, cfg.feature_width)
    got = shapes.get("fc.weight", shapes.get("model.fc.weight"))
    if got is None:
        raise ValueError(f"draft checkpoint {path} has no fc.weight")
    if tuple(got) != expected:
        k_got = got[1] / cfg.hidden_size if len(got) == 2 else "?"
        raise ValueError(
            f"draft checkpoint {path}: fc.weight has shape {tuple(got)}, expected {expected} = "
            f"[hidden_size {cfg.hidden_size}, K*H = {len(cfg.target_layer_ids)} target layers "
            f"{list(cfg.target_layer_ids)} x {cfg.hidden_size}]; the weights were made for "
            f"K = {k_got} tapped layers, so config and weights disagree")


def load_dflash(path: str | Path, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", random_weights: bool = False
                ) -> DFlashDraftModel:
    cfg = DFlashConfig.from_dir(path)
    if random_weights:
        from runtime.models.registry import init_random_weights
        return init_random_weights(build_empty(DFlashDraftModel, cfg, device, dtype))
    check_fc_shape(cfg, checkpoint_shapes(path), path)
    model = build_empty(DFlashDraftModel, cfg, device, dtype)
    load_weights(model, path, strip_prefix="model.")
    model.eval().requires_grad_(False)
    return model


def checkpoint_tensors(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """The model's weights under z-lab names (fused qkv / gate_up split back into q/k/v and
    gate/up), contiguous and on the CPU."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu()
        if ".qkv_proj." in name:
            attn = model.get_submodule(name.split(".qkv_proj.")[0])
            parts = t.split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
            for piece, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[name.replace("qkv_proj", piece)] = part.contiguous()
        elif ".gate_up_proj." in name:
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def save_dflash(model: DFlashDraftModel, out_dir: str | Path,
                dtype: torch.dtype | None = None) -> Path:
    """Writes config.json (the model's raw config) and model.safetensors in z-lab's format."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.cfg.raw, indent=2) + "\n")
    return out


def init_random(model: DFlashDraftModel, seed: int, std: float = 0.02) -> None:
    """Normal(0, std) linear weights, unit norms (HF's initializer_range convention)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
