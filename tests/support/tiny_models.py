"""Random-initialised tiny checkpoints in HF format, written by transformers (the reference)."""
from __future__ import annotations

from pathlib import Path

import torch

TINY_COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2}


TINY_VOCAB = TINY_COMMON["vocab_size"]
TINY_PROMPT = [1, 17, 42, 99, 7, 3, 250, 18, 64, 5, 77, 120]      # the verify tests' prompt


def wrong(token: int) -> int:
    """A token of the tiny vocabulary other than `token` (a draft the target rejects)."""
    return (token + 1) % TINY_VOCAB


def make_tiny(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """family: llama | qwen2 | qwen3. Saved in fp32 with transformers' save_pretrained."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    cfg_cls, model_cls = classes[family]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**TINY_COMMON, **overrides})
    model_cls(cfg).eval().save_pretrained(path)
    return Path(path)
