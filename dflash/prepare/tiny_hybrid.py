"""python -m dflash.prepare.tiny_hybrid OUT_DIR [--family bamba|qwen3_5|nemotron_h|falcon_h1|...]
[--vocab-from SMOLLM2_DIR] [...]: a random-initialised tiny hybrid checkpoint in HF format,
written by transformers (test-time dependency only): Bamba (Mamba2 + attention), Granite-4.0-H,
Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (Gated DeltaNet + gated attention), NemotronH (Mamba2,
attention, MLP and MoE blocks) or Falcon-H1 (attention and Mamba2 in parallel). With --vocab-from the model takes that directory's tokenizer files,
vocabulary size and bos/eos ids, so the gateway can tokenize and detokenize for it."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dflash.prepare.tiny_common import copy_tokenizer, restrict_lm_head, vocab_fields

# Small enough for CPU tests; chunk_size 8 so prompts of a few tokens cross scan chunks.
TINY_BAMBA: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "attn_layer_indices": [1, 3],
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8,
    "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "initializer_range": 0.1, "tie_word_embeddings": False}
# Qwen3.5 text: DeltaNet, attention, DeltaNet, attention; 2 key heads serving 4 value heads;
# a quarter of each attention head rotated
TINY_QWEN3_5: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
    "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "initializer_range": 0.1, "tie_word_embeddings": False}
# Qwen3-Next: the same layers, MoE from layer 1 on (4 experts, 2 per token, a gated shared one)
TINY_QWEN3_NEXT: dict[str, Any] = {
    **TINY_QWEN3_5, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": [0],
    "norm_topk_prob": True}
# Qwen3.5-MoE: Qwen3.5's layers, every one with MoE (the router always renormalises)
TINY_QWEN3_5_MOE: dict[str, Any] = {
    **TINY_QWEN3_5, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48}
# Granite-4.0-H: Bamba's layers, MoE (4 experts, 2 per token) + a shared SwiGLU, Granite's
# scalings; RoPE here (the released models use none: position_embedding_type unset)
TINY_GRANITE: dict[str, Any] = {
    **{k: v for k, v in TINY_BAMBA.items() if k != "attn_layer_indices"},
    "layer_types": ["mamba", "attention", "mamba", "attention"], "intermediate_size": 32,
    "shared_intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2,
    "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
    "logits_scaling": 4.0, "position_embedding_type": "rope"}
# NemotronH: one block per layer - mamba, attention, mamba, MLP, attention, MoE ("M*M-*E");
# squared-ReLU MLP and experts (4, 2 per token, sigmoid-routed) + a shared one; biases on
TINY_NEMOTRON_H: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "layers_block_type": ["linear_attention", "full_attention", "linear_attention", "mlp",
                          "full_attention", "moe"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16,
    "conv_kernel": 4, "chunk_size": 8, "use_bias": True, "mlp_bias": True,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 2.5,
    "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "initializer_range": 0.1, "tie_word_embeddings": False}
# Falcon-H1: attention and Mamba2 (6 heads x 16: mamba_d_ssm 96, not expand * hidden) side by
# side in each of 4 layers; every multiplier away from 1, every bias on, the mixer's RMSNorm
# before its gate (transformers' default when mamba_rms_norm is on)
TINY_FALCON_H1: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "mamba_d_ssm": 96, "mamba_n_heads": 6, "mamba_n_groups": 2, "mamba_d_state": 16,
    "mamba_d_conv": 4, "mamba_chunk_size": 8, "mamba_rms_norm": True,
    "mamba_norm_before_gate": True, "mamba_proj_bias": True, "projectors_bias": True,
    "attention_bias": True, "mlp_bias": True,
    "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5, "attention_in_multiplier": 0.8,
    "attention_out_multiplier": 1.25, "key_multiplier": 0.7, "ssm_in_multiplier": 1.1,
    "ssm_out_multiplier": 0.9, "ssm_multipliers": [1.2, 0.8, 1.1, 0.9, 1.3],
    "mlp_multipliers": [0.9, 1.1],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "initializer_range": 0.1, "tie_word_embeddings": False}
FAMILIES = ("bamba", "granitemoehybrid", "qwen3_5", "qwen3_5_multimodal", "qwen3_5_moe",
            "qwen3_next", "nemotron_h", "falcon_h1")


def make_tiny_hybrid(out_dir: str | Path, vocab_from: str | Path | None = None, seed: int = 0,
                     active_vocab: tuple[int, int] | None = None, family: str = "bamba",
                     **overrides: Any) -> Path:
    """Writes config.json + model.safetensors (fp32) [+ tokenizer files]; returns out_dir.
    active_vocab (lo, hi): the LM head scores only ids lo..hi-1 (the other rows are zero). A
    random model choosing among a few tokens soon repeats itself, so prompt lookup drafts get
    partly accepted - what speculative tests need."""
    import torch

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = _hf_model(family, {**vocab_fields(vocab_from), **overrides})
    _randomise_recurrent_parameters(model, seed)
    if family in ("nemotron_h", "falcon_h1"):
        _randomise_biases(model, seed)
    if active_vocab is not None:
        restrict_lm_head(model, *active_vocab)
    model.save_pretrained(out)
    if family == "nemotron_h":
        _add_layer_count(out, model.config.num_hidden_layers)
    copy_tokenizer(vocab_from, out)
    return out


def _hf_model(family: str, fields: dict[str, Any]):
    if family == "bamba":
        from transformers import BambaConfig, BambaForCausalLM
        return BambaForCausalLM(BambaConfig(**{**TINY_BAMBA, **fields})).eval()
    if family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY_QWEN3_5, **fields})).eval()
    if family == "granitemoehybrid":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
        return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**{**TINY_GRANITE, **fields})
                                           ).eval()
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        return Qwen3NextForCausalLM(Qwen3NextConfig(**{**TINY_QWEN3_NEXT, **fields})).eval()
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**TINY_QWEN3_5_MOE, **fields})).eval()
    if family == "nemotron_h":
        from transformers import NemotronHConfig, NemotronHForCausalLM
        return NemotronHForCausalLM(NemotronHConfig(**{**TINY_NEMOTRON_H, **fields})).eval()
    if family == "falcon_h1":
        from transformers import FalconH1Config, FalconH1ForCausalLM
        return FalconH1ForCausalLM(FalconH1Config(**{**TINY_FALCON_H1, **fields})).eval()
    if family == "qwen3_5_multimodal":         # the layout Qwen publishes: text + vision tower
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
        text = {**TINY_QWEN3_5, **fields}
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                  "out_hidden_size": text["hidden_size"], "num_position_embeddings": 16}
        cfg = Qwen3_5Config(text_config=text, vision_config=vision,
                            tie_word_embeddings=text["tie_word_embeddings"])
        return Qwen3_5ForConditionalGeneration(cfg).eval()
    raise ValueError(f"family {family!r}: one of {FAMILIES}")


def _randomise_recurrent_parameters(model, seed: int) -> None:
    """transformers initialises A_log, D and dt_bias alike in every layer (and Qwen3.5's
    zero-centred norms at 0); random values make a test catch a head or layer mixed up."""
    import torch
    g = torch.Generator().manual_seed(seed + 1)
    uniform = lambda p, lo, hi: p.copy_(torch.empty(p.numel()).uniform_(lo, hi, generator=g))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                uniform(module.A_log, -1.0, 1.5)
                if hasattr(module, "D"):                        # Mamba2's skip
                    uniform(module.D, 0.5, 1.5)
                uniform(module.dt_bias, -2.0, 1.0)
        for name, p in model.named_parameters():
            if "norm" in name and not p.abs().sum():          # zero-centred norm weights
                uniform(p, -0.3, 0.3)
            elif name.endswith("mlp.gate.weight") and not p.abs().sum():   # a router at 0
                uniform(p, -0.5, 0.5)                          # ties every expert


def _add_layer_count(out: Path, layers: int) -> None:
    """transformers 5 derives NemotronH's num_hidden_layers from layers_block_type and leaves it
    out of config.json; the hub's configs (and the services' target fingerprint) have it."""
    import json
    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_hidden_layers": layers},
                               indent=2))


def _randomise_biases(model, seed: int) -> None:
    """transformers zeroes linear biases and NemotronH's expert-choice bias; random ones make a
    test catch a bias dropped or scaled wrongly (NemotronH, Falcon-H1 only: the other families'
    draws stay as they were)."""
    import torch
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith((".bias", "e_score_correction_bias")) and not t.abs().sum():
                t.copy_(torch.empty(t.shape).uniform_(-0.3, 0.3, generator=g))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash.prepare.tiny_hybrid", description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("--family", default="bamba", choices=FAMILIES)
    p.add_argument("--vocab-from", default=None, help="model directory whose tokenizer to copy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=TINY_BAMBA["hidden_size"])
    p.add_argument("--layers", type=int, default=TINY_BAMBA["num_hidden_layers"])
    p.add_argument("--attn-layers", default="1,3", help="comma-separated attention layer ids")
    p.add_argument("--active-vocab", default="", help="LO:HI - the LM head scores only these ids")
    args = p.parse_args(argv)
    active = tuple(int(v) for v in args.active_vocab.split(":")) if args.active_vocab else None
    attn = [int(i) for i in args.attn_layers.split(",") if i]
    if args.family == "bamba":
        layout = {"attn_layer_indices": attn,
                  "mamba_d_head": 2 * args.hidden_size // TINY_BAMBA["mamba_n_heads"]}
    elif args.family == "nemotron_h":
        layout = {"layers_block_type": ["full_attention" if i in attn else "linear_attention"
                                        for i in range(args.layers)]}
    elif args.family == "falcon_h1":            # every layer attends and scans
        layout = {}
    else:
        layout = {"layer_types": ["full_attention" if i in attn else "linear_attention"
                                  for i in range(args.layers)]}
    out = make_tiny_hybrid(
        args.out_dir, args.vocab_from, args.seed, active, args.family,
        hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        intermediate_size=2 * args.hidden_size, **layout)
    print(out)


if __name__ == "__main__":
    main()
