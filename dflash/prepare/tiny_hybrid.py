"""python -m dflash.prepare.tiny_hybrid OUT_DIR [--vocab-from SMOLLM2_DIR] [...]: a random-
initialised tiny Bamba (Mamba2 + attention) checkpoint in HF format, written by transformers
(test-time dependency only). With --vocab-from the model takes that directory's tokenizer files,
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


def make_tiny_hybrid(out_dir: str | Path, vocab_from: str | Path | None = None, seed: int = 0,
                     active_vocab: tuple[int, int] | None = None, **overrides: Any) -> Path:
    """Writes config.json + model.safetensors (fp32) [+ tokenizer files]; returns out_dir.
    active_vocab (lo, hi): the LM head scores only ids lo..hi-1 (the other rows are zero). A
    random model choosing among a few tokens soon repeats itself, so prompt lookup drafts get
    partly accepted - what speculative tests need."""
    import torch
    from transformers import BambaConfig, BambaForCausalLM

    out = Path(out_dir)
    fields = {**TINY_BAMBA, **vocab_fields(vocab_from), **overrides}
    torch.manual_seed(seed)
    model = BambaForCausalLM(BambaConfig(**fields)).eval()
    _randomise_ssm_parameters(model, seed)
    if active_vocab is not None:
        restrict_lm_head(model, *active_vocab)
    model.save_pretrained(out)
    copy_tokenizer(vocab_from, out)
    return out


def _randomise_ssm_parameters(model, seed: int) -> None:
    """transformers initialises A_log = log(1..nh), D = 1, dt_bias = 1 in every layer; random
    values make a test catch a head or layer mixed up."""
    import torch
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                n = module.A_log.numel()
                module.A_log.copy_(torch.empty(n).uniform_(-1.0, 1.5, generator=g))
                module.D.copy_(torch.empty(n).uniform_(0.5, 1.5, generator=g))
                module.dt_bias.copy_(torch.empty(n).uniform_(-2.0, 1.0, generator=g))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash.prepare.tiny_hybrid", description=__doc__)
    p.add_argument("out_dir")
    p.add_argument("--vocab-from", default=None, help="model directory whose tokenizer to copy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=TINY_BAMBA["hidden_size"])
    p.add_argument("--layers", type=int, default=TINY_BAMBA["num_hidden_layers"])
    p.add_argument("--attn-layers", default="1,3", help="comma-separated attention layer ids")
    p.add_argument("--active-vocab", default="", help="LO:HI - the LM head scores only these ids")
    args = p.parse_args(argv)
    active = tuple(int(v) for v in args.active_vocab.split(":")) if args.active_vocab else None
    out = make_tiny_hybrid(
        args.out_dir, args.vocab_from, args.seed, active, hidden_size=args.hidden_size,
        num_hidden_layers=args.layers, intermediate_size=2 * args.hidden_size,
        attn_layer_indices=[int(i) for i in args.attn_layers.split(",") if i],
        mamba_d_head=2 * args.hidden_size // TINY_BAMBA["mamba_n_heads"])
    print(out)


if __name__ == "__main__":
    main()
