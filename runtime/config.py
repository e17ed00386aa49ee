"""Model configuration parsed from a Hugging Face `config.json`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                 "float": "float32"}

# model_type -> architecture family handled by runtime.models
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}


def parse_dtype(name: str) -> torch.dtype:
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {sorted(DTYPES)} (or fp32/bf16/fp16)")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"                 # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position: int = 0       # llama3 / yarn
    low_freq_factor: float = 1.0         # llama3
    high_freq_factor: float = 4.0        # llama3
    beta_fast: float = 32.0              # yarn
    beta_slow: float = 1.0               # yarn
    mscale: float = 1.0                  # yarn: attention factor (computed when 0)
    mscale_all_dim: float = 0.0          # yarn (DeepSeek): also scales the softmax (mla.py)
    partial_rotary_factor: float = 1.0

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        # transformers 5 folds rope_theta into `rope_parameters`; 4.x keeps `rope_theta` + `rope_scaling`.
        params = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        params.update(scaling)
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        supported = ("default", "linear", "llama3", "yarn")
        if kind not in supported:
            raise ValueError(f"rope scaling type {kind!r} is not supported; supported: {supported}")
        orig = int(params.get("original_max_position_embeddings",
                              cfg.get("original_max_position_embeddings", 0)) or 0)
        return RopeConfig(
            theta=theta, kind=kind, factor=float(params.get("factor", 1.0)),
            original_max_position=orig,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast", 32.0)),
            beta_slow=float(params.get("beta_slow", 1.0)),
            mscale=float(params.get("attention_factor") or _deepseek_attention_factor(params)),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor", 1.0)),
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when not scaling up)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _deepseek_attention_factor(params: dict[str, Any]) -> float:
    """transformers' YaRN attention factor when a config gives mscale and mscale_all_dim
    (DeepSeek) and no attention_factor; 0 = the default formula (runtime/layers/rope.py)."""
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and all_dim):
        return 0.0
    factor = float(params.get("factor", 1.0))
    return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(all_dim))


@dataclass(frozen=True)
class ModelConfig:
    """The fields the runtime needs, normalised across Llama / Qwen2 / Qwen3."""
    architecture: str                    # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool                 # bias on q/k/v projections (Qwen2; Llama/Qwen3 flag)
    qk_norm: bool                        # per-head RMSNorm on q and k (Qwen3)
    mlp_bias: bool = False
    o_proj_bias: bool = False            # Llama/Qwen3 `attention_bias` also covers o_proj
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (silu only)")

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in ARCHITECTURES:
            raise ValueError(f"model_type {model_type!r} is not supported; "
                             f"supported: {sorted(ARCHITECTURES)}")
        arch = ARCHITECTURES[model_type]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rope=RopeConfig.from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (its config has no switch); Llama/Qwen3 follow the flag.
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_proj_bias=arch != "qwen2" and bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            raw=cfg,
        )

    @staticmethod
    def from_dir(path: str | Path) -> ModelConfig:
        return ModelConfig.from_dict(read_config_json(path))


def default_model_id(model_dir: str | Path) -> str:
    """The directory name, or its parent's when the directory is named after a dtype
    (models home layout: <name>/<dtype>/)."""
    path = Path(model_dir).resolve()
    return path.parent.name if path.name in DTYPES else path.name


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields: a multimodal config's text_config (Qwen3.5 as Qwen publishes
    it; tie_word_embeddings from the top level unless it sets its own), else the config."""
    if "text_config" not in raw:
        return raw
    return {"tie_word_embeddings": raw.get("tie_word_embeddings", False), **raw["text_config"]}


def decoder_prefix(raw: dict[str, Any]) -> str:
    """Where the text decoder's tensors are in the checkpoint: model.language_model.* in a
    multimodal one, model.* otherwise."""
    return "model.language_model." if "text_config" in raw else "model."


# the token embedding's checkpoint name where it is not <decoder_prefix>embed_tokens.weight
EMBEDDING_NAMES = {"nemotron_h": "backbone.embeddings.weight"}


def embedding_name(raw: dict[str, Any]) -> str:
    """The target's token embedding in its checkpoint (raw: the whole config.json)."""
    return (EMBEDDING_NAMES.get(text_config(raw).get("model_type", ""))
            or decoder_prefix(raw) + "embed_tokens.weight")


def num_layers(raw: dict[str, Any]) -> int:
    """The decoder's layers: num_hidden_layers, or the length of a per-layer pattern where a
    config leaves the count out (transformers writes NemotronH configs without it)."""
    if "num_hidden_layers" in raw:
        return int(raw["num_hidden_layers"])
    pattern = (raw.get("layers_block_type") or raw.get("layer_types")
               or raw.get("hybrid_override_pattern"))
    if not pattern:
        raise ValueError("config.json gives neither num_hidden_layers nor a layer pattern "
                         "(layers_block_type / layer_types / hybrid_override_pattern)")
    return len(pattern)


def head_scales(raw: dict[str, Any]) -> tuple[float, float]:
    """(embedding scale, logit scale) a family applies around its embedding and LM head:
    Granite's embedding_multiplier and 1 / logits_scaling, Falcon-H1's embedding_multiplier
    and lm_head_multiplier; (1, 1) for the rest."""
    raw = text_config(raw)
    return (float(raw.get("embedding_multiplier", 1.0)),
            float(raw.get("lm_head_multiplier", 1.0)) / float(raw.get("logits_scaling", 1.0)))


def read_config_json(path: str | Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: a model directory needs config.json")
    return json.loads(file.read_text())
