"""Held-out acceptance of an exported drafter per split and category, and its model card."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from runtime.models.dflash import TargetHead, load_dflash
from train.acceptance import AcceptanceStats, simulate_each
from train.features import FeatureExtractor
from train.generate import Example
from train.trainer import batch_tensors


def evaluate_splits(cfg, draft_dir: Path, held: dict[str, list[Example]],
                    dtype: torch.dtype = torch.bfloat16) -> dict:
    """{split: {"tau", "per_category": {cat: tau}, "per_position": [...], "sequences"}} at T=0,
    simulated along the target's greedy answers (exact for greedy speculative decoding).
    dtype: the target's, for features and LM head (training uses bf16)."""
    draft = load_dflash(draft_dir, torch.float32, cfg.device)
    head = TargetHead.load(cfg.target_dir, dtype, cfg.device)
    taps = draft.cfg.target_layer_ids
    extractor = FeatureExtractor(cfg.target_dir, taps, cfg.batch_sequences * cfg.max_len + 1024,
                                 dtype, cfg.device, cfg.feature_backend)
    result = {}
    for split, examples in held.items():
        examples = examples[: cfg.eval_sequences]
        by_cat: dict[str, AcceptanceStats] = defaultdict(
            lambda: AcceptanceStats(per_position=[0] * (cfg.block_size - 1)))
        total = AcceptanceStats(per_position=[0] * (cfg.block_size - 1))
        for i in range(0, len(examples), cfg.batch_sequences):
            chunk = [e for e in examples[i: i + cfg.batch_sequences] if len(e.response_ids) >= 2]
            if not chunk:
                continue
            ids, plen, lens = batch_tensors(chunk, cfg.max_len, cfg.device)
            feats = extractor([e.ids[: cfg.max_len] for e in chunk], greedy=False).feats
            with torch.autocast(device_type=torch.device(cfg.device).type, dtype=torch.bfloat16):
                per_seq = simulate_each(draft, head, feats, ids, plen, lens, cfg.block_size)
            for e, st in zip(chunk, per_seq):
                by_cat[e.category].merge(st)
                total.merge(st)
        result[split] = {
            "tau": round(total.tau, 3), "sequences": len(examples),
            "per_category": {c: round(s.tau, 3) for c, s in sorted(by_cat.items())},
            "per_position_acceptance": [round(a / max(1, total.steps), 4)
                                        for a in total.per_position],
        }
    return result


def _ffn(cfg: dict) -> str:
    width = cfg.get("intermediate_size", 0)
    passes = cfg.get("layer_passes", 1)
    return ((f" (FFN width {width}, not the target's)" if width else "") +
            (f", the block runs through them {passes} times (shared weights)" if passes > 1 else ""))


def write_card(draft_dir: Path, summary: dict) -> None:
    cfg = summary["config"]
    ev = summary.get("eval", {})
    lines = [
        "# DFlash drafter for SmolLM2-135M-Instruct",
        "",
        ("A block-diffusion drafter in z-lab's DFlash checkpoint format (config.json with "
        "`dflash_config`, model.safetensors), trained by this project with `dflash train-draft`."),
        "",
        (f"- layers: {cfg['num_layers']}{_ffn(cfg)}, block size: {cfg['block_size']}, "
         f"tapped target "
        f"layers: {summary['target_layer_ids']}, mask token id: {cfg['mask_token_id']}"),
        (f"- data: {summary['num_train_examples']} answers of the target itself to "
        f"{summary['num_train_prompts'] - summary.get('num_self_written', 0)} training prompts "
        f"of `data/prompts/train.jsonl`"
        f"{_self_written(summary)} ({_second_turns(summary)}answers per temperature: "
        f"{summary.get('answers_by_temperature', {})})"),
        f"- labels: {'the target greedy chain from each anchor' if cfg.get('greedy_labels', True) else 'the answer tokens'}",
        (f"- recipe: {_start(cfg)}random anchors in the answer{_window(cfg)}{_hops(cfg)}, "
         f"block [anchor, MASK x "
        f"{cfg['block_size'] - 1}], "
        f"CE on positions 1..B-1{_soft(cfg)} weighted exp(-(k-1)/{cfg['gamma']}){_reach(cfg)}; AdamW lr {cfg['lr']} "
        f"cosine, {cfg['steps']} steps x {cfg['batch_sequences']} sequences x "
        f"{cfg['blocks_per_sequence']} blocks, bf16 autocast, clip {cfg['grad_clip']}"),
        f"- training time: {summary['train_seconds']} s",
        *([(f"- draft vocabulary: {summary['draft_vocab']} token ids, ranked by frequency in the "
            f"target's greedy training answers (`draft_vocab.json`; the draft service scores "
            f"only them unless `--draft-vocab 0`)")] if "draft_vocab" in summary else []),
        f"- command: `{summary.get('command', '')}`",
        "",
        "## Measured acceptance length (tau, greedy, committed tokens per verify step)",
        "",
        "| split | tau | per category |",
        "|---|---|---|",
    ]
    for split, r in ev.items():
        cats = ", ".join(f"{c} {t}" for c, t in r["per_category"].items())
        lines.append(f"| {split} | {r['tau']} | {cats} |")
    (Path(draft_dir) / "README.md").write_text("\n".join(lines) + "\n")
    (Path(draft_dir) / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")


def _start(cfg: dict) -> str:
    if cfg.get("init_from_target"):
        return "layers started from the target's last ones (`--init-from-target`), "
    return f"started from `{cfg['init_from']}`, " if cfg.get("init_from") else ""


def _window(cfg: dict) -> str:
    window = cfg.get("anchor_window", 0)
    return f" (its first {window} tokens)" if window else ""


def _hops(cfg: dict) -> str:
    hops = cfg.get("loop_hops", 0)
    return (f" moved {hops} step{'s' if hops > 1 else ''} along the drafter's own speculative "
            "loop (`--loop-hops`)") if hops else ""


def _second_turns(summary: dict) -> str:
    n = summary.get("num_second_turns", 0)
    return (f"{n} of them to a second turn, a follow-up request after the target's own greedy "
            "answer; ") if n else ""


def _self_written(summary: dict) -> str:
    n = summary.get("num_self_written", 0)
    return (f" and {n} requests the target wrote itself (`--self-prompts`, greedy answers)"
            if n else "")


def _reach(cfg: dict) -> str:
    r = cfg.get("reach_weight", 0.0)
    reach = "the drafter's probability of reaching k"
    if not r:
        return ""
    return f" x {reach}" if r == 1 else f" x ({1 - r:g} + {r:g} x {reach})"


def _soft(cfg: dict) -> str:
    w = cfg.get("soft_label_weight", 0.0)
    return f" plus {w} x KL(target || draft)" if w else ""
