"""Convert a Llama-architecture GGUF file into a Hugging Face-format model directory.

Writes config.json, model.safetensors (dequantized, cast to one dtype), tokenizer.json,
tokenizer_config.json, special_tokens_map.json and generation_config.json. Output is a pure
function of the GGUF bytes and the dtype.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# GGUF per-layer tensor `blk.N.<key>.weight` -> HF `model.layers.N.<value>.weight`
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4


def _byte_level() -> pre_tokenizers.PreTokenizer:
    """GPT-2's split regex, then bytes -> printable characters."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    """llama.cpp splits on "\\p{N}" first, then applies the GPT-2 regex."""
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


# llama.cpp pre-tokenizer name (tokenizer.ggml.pre) -> the same split in `tokenizers`
_PRE_TOKENIZERS = {
    "gpt2": _byte_level,
    "smollm": _digits_then_byte_level,
    "starcoder": _digits_then_byte_level,
}


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str, progress: bool = True) -> None:
    """Write the HF-format files for `gguf_path` into the existing directory `out_dir`."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(TORCH_DTYPES)}")
    reader = GGUFReader(gguf_path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: architecture {meta.get('general.architecture')!r}, "
                         "expected 'llama'")
    names = {t.name for t in reader.tensors}
    config = llama_config(meta, tie_word_embeddings="output.weight" not in names, dtype=dtype)
    tensors = convert_tensors(reader, config, TORCH_DTYPES[dtype], progress)
    if progress:
        print("writing model.safetensors, tokenizer and config files", file=sys.stderr)
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes through a 0600 temp file; give it the mode the other files got
    shutil.copymode(out_dir / "tokenizer.json", out_dir / "model.safetensors")
    specials = special_tokens(meta)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "special_tokens_map.json", specials)
    _write_json(out_dir / "tokenizer_config.json", {
        **specials,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    _write_json(out_dir / "generation_config.json", {
        key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if key in config
    })


def llama_config(meta: dict[str, Any], tie_word_embeddings: bool, dtype: str) -> dict[str, Any]:
    """An HF LlamaConfig dict from GGUF metadata (`llama.*` and `tokenizer.ggml.*` keys)."""
    heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": meta.get("llama.rope.dimension_count", hidden // heads),
        # GGUF stores float32; keep the shortest decimal that rounds to it (1e-05, not 9.99e-06).
        "rms_norm_eps": _f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta["llama.context_length"],
        "vocab_size": meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "tie_word_embeddings": tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{gguf_key}" in meta:
            config[key] = meta[f"tokenizer.ggml.{gguf_key}"]
    return config


def convert_tensors(reader: GGUFReader, config: dict[str, Any], dtype: torch.dtype,
                    progress: bool) -> dict[str, torch.Tensor]:
    """Dequantized tensors under HF names, q/k rows restored to HF's rotary layout."""
    heads = {"self_attn.q_proj": config["num_attention_heads"],
             "self_attn.k_proj": config["num_key_value_heads"]}
    out: dict[str, torch.Tensor] = {}
    for i, t in enumerate(reader.tensors, 1):
        name, layer_key = _hf_name(t.name)
        w = dequantize(t.data, t.tensor_type)
        expected = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
        if w.shape != expected:
            raise ValueError(f"{t.name}: dequantized shape {w.shape}, expected {expected}")
        if layer_key in heads:
            w = unpermute_rows(w, heads[layer_key])
        out[name] = torch.from_numpy(np.require(w, np.float32, ["C", "W"])).to(dtype)
        if progress:
            _progress_bar(i, len(reader.tensors))
    return out


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (per head, interleaved rotary pairs -> two halves)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The byte-level BPE tokenizer the GGUF metadata describes, as llama.cpp runs it."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF tokenizer {model!r} with pre-tokenizer {pre!r}; "
                         f"supported: 'gpt2' with {sorted(_PRE_TOKENIZERS)}")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED])
    return tok


def special_tokens(meta: dict[str, Any]) -> dict[str, str]:
    """bos/eos/pad/unk token strings for the ids the GGUF names."""
    tokens = meta["tokenizer.ggml.tokens"]
    keys = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "pad_token": "padding_token_id", "unk_token": "unknown_token_id"}
    return {name: tokens[meta[f"tokenizer.ggml.{key}"]]
            for name, key in keys.items() if f"tokenizer.ggml.{key}" in meta}


def _hf_name(gguf_name: str) -> tuple[str, str | None]:
    """(HF tensor name, per-layer module key or None) for a GGUF tensor name."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name], None
    parts = gguf_name.split(".")
    if len(parts) == 4 and (parts[0], parts[3]) == ("blk", "weight") and parts[2] in _LAYER_TENSORS:
        key = _LAYER_TENSORS[parts[2]]
        return f"model.layers.{int(parts[1])}.{key}.weight", key
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a Llama model")


def _f32(x: float) -> float:
    return float(str(np.float32(x)))


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _progress_bar(done: int, total: int, width: int = 30) -> None:
    """Redraw `[###...] done/total` on stderr, only when a cell fills (stays short in logs)."""
    filled = width * done // total
    if done > 1 and filled == width * (done - 1) // total and done != total:
        return
    end = "\n" if done == total else ""
    print(f"\rdequantize [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tensors",
          end=end, file=sys.stderr, flush=True)
