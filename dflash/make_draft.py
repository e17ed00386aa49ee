"""`dflash make-draft --target DIR --out DIR [...]`: a random-initialised DFlash drafter in z-lab's
format for any target directory (tests, benchmarks, the local stack before a trained drafter
exists). Layer shapes copy the target's (heads, kv heads, head_dim, intermediate size, RoPE), so
it is "of the trained shape"; it records `target_fingerprint` so the draft service refuses to
serve it against another target. Python: `make_random_drafter(target_dir, out_dir, ...)`.

Default mask token id (`default_mask_token_id`), first rule that applies:
  1. a token named like a mask (<|MASK|>, <mask>, [MASK]) in the target's tokenizer;
  2. the first id past the tokenizer's ids when the embedding has more rows (z-lab's Qwen3
     drafts use 151669, the first row past Qwen3's tokenizer);
  3. the highest-id special token that is not bos/eos/pad/unk and that the chat template never
     writes. SmolLM2-135M-Instruct: its vocabulary is full (49152 ids), its special tokens are
     ids 0-16, and this picks 16 `<empty_output>`: a StarCoder Jupyter-notebook marker that
     neither the chat template (<|im_start|>, <|im_end|>) nor bos/eos/pad/unk uses, so normal
     chat text never contains it;
  4. no tokenizer.json (tiny test models): vocab_size - 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from runtime.config import parse_dtype, read_config_json, text_config
from runtime.models.dflash import (
    DFlashConfig,
    DFlashDraftModel,
    TargetFingerprint,
    build_target_layer_ids,
    check_target_layer_ids,
    init_random,
    save_dflash,
)

MASK_NAMES = ("<|MASK|>", "<|mask|>", "<mask>", "[MASK]")
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")


def make_random_drafter(target_dir: str | Path, out_dir: str | Path, *, num_layers: int = 1,
                        block_size: int = 16, target_layer_ids: list[int] | None = None,
                        mask_token_id: int | None = None, seed: int = 0,
                        dtype: str = "float32") -> Path:
    """Writes config.json + model.safetensors to out_dir and returns it. ValueError on a bad
    argument (layer ids, mask id, sizes), saying what is allowed."""
    raw = text_config(read_config_json(target_dir))
    fp = TargetFingerprint.of_target(target_dir)
    ids = list(target_layer_ids) if target_layer_ids else build_target_layer_ids(
        fp.num_layers, num_layers)
    check_target_layer_ids(ids, fp.num_layers, explicit=bool(target_layer_ids))
    mask = default_mask_token_id(target_dir) if mask_token_id is None else int(mask_token_id)
    if not 0 <= mask < fp.vocab_size:
        raise ValueError(f"mask token id {mask} is outside the target vocabulary [0, {fp.vocab_size})")
    if num_layers < 1 or block_size < 2:
        raise ValueError(f"need --layers >= 1 and --block-size >= 2, got {num_layers}, {block_size}")
    cfg = DFlashConfig.from_dict(draft_config(raw, fp, num_layers, block_size, ids, mask, dtype))
    model = DFlashDraftModel(cfg)
    init_random(model, seed)
    return save_dflash(model, out_dir, parse_dtype(dtype))


def draft_config(target: dict[str, Any], fp: TargetFingerprint, num_layers: int, block_size: int,
                 ids: list[int], mask: int, dtype: str) -> dict[str, Any]:
    heads = int(target["num_attention_heads"])
    kv_heads, head_dim = _attention_shape(target, fp, heads)
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": fp.hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(target["intermediate_size"]),
        "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)),
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": int(target.get("max_position_embeddings", 4096)),
        "vocab_size": fp.vocab_size,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "block_size": block_size,
        "num_target_layers": fp.num_layers,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": mask},
        "target_fingerprint": fp.to_dict(),
    }
    cfg.update({k: target[k] for k in ROPE_KEYS if target.get(k) is not None})
    return cfg


def _attention_shape(target: dict[str, Any], fp: TargetFingerprint, heads: int
                     ) -> tuple[int, int]:
    """(kv heads, head_dim) of the drafter's ordinary attention layers. An MLA target
    (DeepSeek-V2/V3, Kimi-K2: kv_lora_rank in its config) has no per-head K/V of its own: the
    drafter takes one KV head per query head of the target's value width (v_head_dim)."""
    if target.get("kv_lora_rank"):
        return heads, int(target["v_head_dim"])
    return (int(target.get("num_key_value_heads") or heads),
            int(target.get("head_dim") or fp.hidden_size // heads))


def default_mask_token_id(target_dir: str | Path) -> int:
    """See the module docstring for the rules."""
    raw = text_config(read_config_json(target_dir))
    vocab = int(raw["vocab_size"])
    file = Path(target_dir) / "tokenizer.json"
    if not file.is_file():
        return vocab - 1
    tok = json.loads(file.read_text())
    added = {a["content"]: (int(a["id"]), bool(a.get("special"))) for a in tok.get("added_tokens", [])}
    model_vocab = tok.get("model", {}).get("vocab", {})
    ids = {**(model_vocab if isinstance(model_vocab, dict) else {}),
           **{name: i for name, (i, _) in added.items()}}
    for name in MASK_NAMES:
        if name in ids and ids[name] < vocab:
            return int(ids[name])
    used = max(ids.values(), default=-1) + 1
    if used < vocab:
        return used
    candidates = sorted((i for name, (i, special) in added.items()
                         if special and i < vocab and name not in _reserved_names(target_dir, raw)),
                        reverse=True)
    if candidates:
        return candidates[0]
    raise ValueError(f"no unused token id found in {target_dir}: pass --mask-token-id")


def _reserved_names(target_dir: str | Path, raw: dict[str, Any]) -> set[str]:
    """bos/eos/pad/unk token strings and every added token the chat template writes."""
    tc_file = Path(target_dir) / "tokenizer_config.json"
    tc = json.loads(tc_file.read_text()) if tc_file.is_file() else {}
    tok = json.loads((Path(target_dir) / "tokenizer.json").read_text())
    by_id = {int(a["id"]): a["content"] for a in tok.get("added_tokens", [])}
    names = {_content(tc.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = raw.get(key)
        names |= {by_id.get(i) for i in (value if isinstance(value, list) else [value])}
    template = tc.get("chat_template") or ""
    names |= {name for name in by_id.values() if name in template}
    return {n for n in names if n}


def _content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


# -- the `dflash make-draft` subcommand ---------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="the target's HF model directory")
    parser.add_argument("--out", required=True, help="directory to write the drafter to")
    parser.add_argument("--layers", type=int, default=1, help="draft layers (default 1)")
    parser.add_argument("--block-size", type=int, default=16, help="block size B (default 16)")
    parser.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                        help="tapped target layers (default: DFlash's build_target_layer_ids)")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="mask token id (default: an unused id of the target's tokenizer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")


def run(args: argparse.Namespace) -> int:
    try:
        out = make_random_drafter(args.target, args.out, num_layers=args.layers,
                                  block_size=args.block_size, target_layer_ids=args.target_layer_ids,
                                  mask_token_id=args.mask_token_id, seed=args.seed, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as e:
        print(f"make-draft: {e}", file=sys.stderr)
        return 2
    cfg = DFlashConfig.from_dir(out)
    print(f"wrote a random DFlash drafter to {out}: {cfg.num_layers} layer(s), block "
          f"{cfg.block_size}, target layers {list(cfg.target_layer_ids)}, mask token "
          f"{cfg.mask_token_id}")
    return 0
