"""python -m dflash.prepare.tiny_mla OUT_DIR [--version 2|3] [--vocab-from DIR] [...]: a random-
initialised tiny DeepSeek-V2 or V3 (multi-head latent attention + mixture of experts) checkpoint
in HF format, written by transformers (test-time dependency only). With --vocab-from it takes
that directory's tokenizer, vocabulary size and bos/eos ids (the gateway can then serve it).

DEEPSEEK_V2_LITE is DeepSeek-V2-Lite's config (27 layers, hidden 2048, 16 heads, kv_lora_rank
512, 64 routed experts), the shape `bench.gpu_side_by_side --shape deepseek-v2-lite` serves with
random weights."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dflash.prepare.tiny_common import copy_tokenizer, restrict_lm_head, vocab_fields

# Small enough for CPU tests: 3 layers (the first dense), 8 experts in 2 groups, top-2.
TINY_MLA: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2,
    "topk_group": 1, "first_k_dense_replace": 1, "max_position_embeddings": 2048,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
# what differs between the two versions' tiny models: V2 without a query LoRA and with
# group-limited softmax routing; V3 with a query LoRA and YaRN with DeepSeek's mscale
VERSIONS: dict[int, dict[str, Any]] = {
    2: {"q_lora_rank": None, "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.0},
    3: {"q_lora_rank": 48, "routed_scaling_factor": 2.5,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 512, "mscale": 0.707,
                            "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}},
}
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "topk_method": "greedy", "routed_scaling_factor": 1.0,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                        "original_max_position_embeddings": 4096, "mscale": 0.707,
                        "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    "bos_token_id": 100000, "eos_token_id": 100001, "tie_word_embeddings": False,
    "dtype": "bfloat16"}


def make_tiny_mla(out_dir: str | Path, version: int = 3, vocab_from: str | Path | None = None,
                  seed: int = 0, active_vocab: tuple[int, int] | None = None, std: float = 0.1,
                  **overrides: Any) -> Path:
    """Writes config.json + model.safetensors (fp32) [+ tokenizer files]; returns out_dir.
    Weights are Normal(0, std) (transformers' 0.02 leaves a tiny model's logits nearly flat),
    V3's router correction bias too, so a test catches it ignored. active_vocab: see
    tiny_common.restrict_lm_head."""
    import torch
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )
    classes = {2: (DeepseekV2Config, DeepseekV2ForCausalLM),
               3: (DeepseekV3Config, DeepseekV3ForCausalLM)}
    if version not in classes:
        raise ValueError(f"DeepSeek version {version}: 2 or 3")
    cfg_cls, model_cls = classes[version]
    out = Path(out_dir)
    fields = {**TINY_MLA, **VERSIONS[version], **vocab_fields(vocab_from), **overrides}
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, std)
    if active_vocab is not None:
        restrict_lm_head(model, *active_vocab)
    model.save_pretrained(out)
    copy_tokenizer(vocab_from, out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash.prepare.tiny_mla", description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("--version", type=int, default=3, choices=(2, 3))
    p.add_argument("--vocab-from", default=None, help="model directory whose tokenizer to copy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--active-vocab", default="", help="LO:HI - the LM head scores only these ids")
    args = p.parse_args(argv)
    active = tuple(int(v) for v in args.active_vocab.split(":")) if args.active_vocab else None
    print(make_tiny_mla(args.out_dir, args.version, args.vocab_from, args.seed, active))


if __name__ == "__main__":
    main()
