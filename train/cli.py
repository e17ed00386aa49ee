"""`dflash train-draft`: prompts -> the target's own answers -> DFlash drafter (z-lab format).

  dflash train-draft --target DIR --out DIR [--device cuda] [--steps N] [--layers 2] ...
Generated answers are cached in --work DIR (reused when present), so training can be rerun."""
from __future__ import annotations

import argparse
import json
import logging
import random
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

from runtime.attention.registry import default_backend
from train.generate import (
    Example,
    chat_prompt_ids,
    generate,
    load_examples,
    save_examples,
    shuffled,
    write_whole,
)

log = logging.getLogger("dflash.train")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model directory (HF format)")
    p.add_argument("--out", required=True, help="where the drafter is written")
    p.add_argument("--work", default="", help="cache of generated answers (default: OUT/../work)")
    p.add_argument("--prompts", default="", help="prompt set folder (default: data/prompts)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", help="target dtype for generation/features")
    p.add_argument("--attention-backend", default="",
                   help="answer generation and features (default: triton on cuda, torch on cpu)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--intermediate-size", type=int, default=0, metavar="N",
                   help="the drafter's FFN width (0 = the target's)")
    p.add_argument("--layer-passes", type=int, default=1, metavar="P",
                   help="run the block through the layers P times with the same weights (more "
                        "computation, no more parameters; dflash_config.layer_passes)")
    p.add_argument("--taps", type=int, default=5, help="target layers tapped for features")
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None, metavar="L",
                   help="tapped target layers, each in [0, target layers) (default: --taps ids "
                        "spread over [1, layers-3], DFlash's rule)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mask-token-id", type=int, required=True)
    p.add_argument("--steps", type=int, default=24000)
    p.add_argument("--batch-sequences", type=int, default=32)
    p.add_argument("--blocks-per-sequence", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=float, default=3.0,
                   help="loss weight of draft position k: exp(-(k-1)/gamma) (DFlash's 7 was "
                        "measured worse for the shipped SmolLM2 drafter)")
    p.add_argument("--reach-weight", type=float, default=0.0, metavar="R",
                   help="also scale position k's loss weight by (1-R) + R x the drafter's own "
                        "probability of the labels at positions 1..k-1 of its block, the chance "
                        "it gets to verify k (0 = off, 1 = fully; R in [0, 1])")
    p.add_argument("--anchor-window", type=int, default=0, metavar="N",
                   help="anchors only in the first N tokens of each answer (0 = anywhere)")
    p.add_argument("--loop-hops", type=int, default=0, metavar="N",
                   help="move each random anchor N steps of the drafter's own speculative loop "
                        "(anchor + accepted drafts + 1, one no-grad block forward per hop), so "
                        "training blocks start where the loop starts them (0 = off; 1 was "
                        "measured behind uniform anchors, docs/drafter-research.md)")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--sampled-temperature", type=float, default=0.7,
                   help="more answers per prompt sampled at this temperature (0 = greedy only)")
    p.add_argument("--samples-per-prompt", type=int, default=6,
                   help="sampled answers per training prompt, besides the greedy one")
    p.add_argument("--follow-ups", type=int, default=2, metavar="N",
                   help="N answer sets to a second turn (a follow-up request after the target's "
                        "greedy first answer): the first greedy, the rest sampled (0 = none)")
    p.add_argument("--self-prompts", type=int, default=0, metavar="N",
                   help="N more training prompts the target writes itself (Magpie: sampled "
                        "from its chat template's open user turn, filtered, no near-duplicate of "
                        "a held-out prompt), each answered greedily (0 = none)")
    p.add_argument("--self-prompt-temperature", type=float, default=0.8)
    p.add_argument("--self-prompt-tokens", type=int, default=96,
                   help="longest self-written request; longer ones are dropped")
    p.add_argument("--soft-labels", type=float, default=1.0, metavar="W",
                   help="add W x KL(target || draft) over the whole vocabulary at each labelled "
                        "position to the cross-entropy (0 = cross-entropy only; the shipped "
                        "drafter's recipe: 1)")
    p.add_argument("--labels", choices=("greedy", "data"), default="greedy",
                   help="train on the target's greedy chain from each anchor (default) or on "
                        "the answer's own tokens")
    p.add_argument("--concurrency", type=int, default=1024, help="sequences per generation wave")
    p.add_argument("--limit-prompts", type=int, default=0, help="use only N training prompts")
    p.add_argument("--limit-eval", type=int, default=0, help="use only N prompts per held-out split")
    p.add_argument("--eval-sequences", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=4000, help="held-out tau every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generate-only", action="store_true")
    p.add_argument("--generation-processes", type=int, default=0, metavar="N",
                   help="training answer sets generated at once, one process each (default: "
                        "up to 8 on a GPU, where generation is bound by the host's kernel "
                        "launches and processes share the device well; 1 on the CPU)")
    p.add_argument("--only-set", default="", metavar="SET",
                   help="generate just one training answer set and stop: 'follow-ups' or a "
                        "sampled set's index 0..N-1 (the greedy set first, when missing)")
    p.add_argument("--cache-features", action="store_true",
                   help="compute every training sequence's features once and keep them in "
                        "device memory (bf16: 2 x taps x hidden bytes per token) instead of "
                        "running the target on every batch")
    p.add_argument("--init-from", default="", metavar="DRAFTER",
                   help="start from this trained drafter's weights instead of random ones")
    p.add_argument("--init-from-target", action="store_true",
                   help="start the drafter's layers from the target's last ones (attention, MLP, "
                        "norms) and its context projection from the deepest tap alone; needs "
                        "the target's FFN width")
    p.add_argument("--checkpoint", default="",
                   help="resume from / save to this file (default: WORK/checkpoint.pt)")
    p.add_argument("--stop-after", type=float, default=0.0, metavar="SECONDS",
                   help="stop training after this long and save the checkpoint; the same "
                        "command resumes it (for time-limited or preemptible machines)")


def answers(args, split: str, temperature: float, prompts: list, work: Path, sample: int = 0,
            ids: list[list[int]] | None = None) -> list[Example]:
    """The target's answers to `prompts`, cached in WORK/{split}_t{T}[_s{sample}].jsonl. ids:
    the prompts' token ids (default: each prompt's text as one chat-formatted user turn)."""
    path = set_path(work, split, temperature, sample)
    if path.is_file():
        return load_examples(path)
    if not prompts:
        return []
    examples = _generate(args, prompts, temperature, args.seed + 7919 * sample, ids)
    save_examples(examples, path)
    return examples


def set_path(work: Path, split: str, temperature: float, sample: int = 0) -> Path:
    suffix = f"_s{sample}" if sample else ""
    return work / f"{split}_t{temperature}{suffix}.jsonl"


def follow_up_temperature(args, k: int) -> float:
    """Follow-up set k's: the first greedy, the others sampled at --sampled-temperature."""
    return 0.0 if k == 0 or args.sampled_temperature <= 0 else args.sampled_temperature


def attention_backend(args: argparse.Namespace) -> str:
    """--attention-backend, else the device's default: for answer generation and features."""
    return args.attention_backend or default_backend(args.device)


def follow_up_answers(args, prompts: list, first: list[Example], work: Path) -> list[Example]:
    """--follow-ups answer sets to second turns after the greedy `first` answers to `prompts`
    (follow_ups.py): set 0 greedy, the others sampled at --sampled-temperature."""
    from runtime.tokenizer import ChatTokenizer
    from train.follow_ups import follow_up_prompts
    tok = ChatTokenizer(args.target)
    texts = {p.id: p.text for p in prompts}
    out: list[Example] = []
    for k in range(args.follow_ups):
        records, ids = follow_up_prompts(tok, texts, first, k, args.seed)
        out += answers(args, "train-followup", follow_up_temperature(args, k), records, work, k,
                       ids)
    return out


def self_prompt_answers(args, work: Path, held_out: list[str]) -> list[Example]:
    """--self-prompts: the requests the target writes (self_prompts.py), cached in
    WORK/self_prompts_n{N}_t{T}.jsonl, and its greedy answers to them (set train-self{N})."""
    if args.self_prompts <= 0:
        return []
    from train.prompts import read_records, records_jsonl
    path = work / f"self_prompts_n{args.self_prompts}_t{args.self_prompt_temperature}.jsonl"
    if path.is_file():
        records = read_records(path)
    else:
        records = _write_self_prompts(args, held_out)
        write_whole(path, records_jsonl(records))
    return answers(args, f"train-self{args.self_prompts}", 0.0, records, work)


def _write_self_prompts(args, held_out: list[str]) -> list:
    import torch

    from runtime.tokenizer import ChatTokenizer
    from train.self_prompts import user_turn_prefix, write_prompts
    from train.target_runner import TargetRunner
    tok = ChatTokenizer(args.target)
    tokens = TargetRunner.tokens_for(args.concurrency,
                                     len(user_turn_prefix(tok)) + args.self_prompt_tokens)
    runner = TargetRunner(args.target, tokens, getattr(torch, args.dtype), args.device,
                          attention_backend(args))
    return write_prompts(runner, tok, args.self_prompts, args.self_prompt_temperature,
                         args.self_prompt_tokens, args.seed, args.concurrency, held_out)


def one_set(args, name: str, prompts: list, greedy: list[Example], work: Path) -> None:
    """--only-set NAME: the follow-up sets, or sampled set NAME (an index), as `run` would."""
    if name == "follow-ups":
        follow_up_answers(args, prompts, greedy, work)
    else:
        answers(args, "train", args.sampled_temperature, prompts, work, int(name))


def missing_sets(args, work: Path) -> list[str]:
    """The --only-set names of the training answer sets that WORK does not hold yet."""
    names = []
    if any(not set_path(work, "train-followup", follow_up_temperature(args, k), k).is_file()
           for k in range(args.follow_ups)):
        names.append("follow-ups")
    if args.sampled_temperature > 0:
        names += [str(k) for k in range(args.samples_per_prompt)
                  if not set_path(work, "train", args.sampled_temperature, k).is_file()]
    return names


def generate_in_parallel(args, prompts: list, greedy: list[Example], work: Path) -> None:
    """The missing training sets, each in its own spawned process, --generation-processes at a
    time. Every set has its own seed, so they equal the sets one process makes in turn. With one
    process (the CPU default) this does nothing: `run` generates them in turn."""
    names = missing_sets(args, work)
    cap = args.generation_processes or (8 if args.device.startswith("cuda") else 1)
    processes = min(cap, len(names))
    if processes <= 1:
        return
    if args.device.startswith("cuda"):
        import torch
        torch.cuda.empty_cache()         # the greedy set's KV cache, before 8 others take theirs
    log.info("generating %d answer sets, %d processes at a time: %s", len(names), processes,
             " ".join(names))
    t0 = time.monotonic()
    with ProcessPoolExecutor(processes, mp_context=get_context("spawn")) as pool:
        for job in [pool.submit(_set_job, args, n, prompts, greedy, work) for n in names]:
            job.result()
    log.info("generated %d answer sets in %.0f s", len(names), time.monotonic() - t0)


def _set_job(args, name: str, prompts: list, greedy: list[Example], work: Path) -> None:
    from services.common.logs import setup_logging
    setup_logging("INFO", "train-draft")
    one_set(args, name, prompts, greedy, work)


def argument_error(args) -> str:
    """What is wrong with --init-from-target, --intermediate-size, --layer-passes, --reach-weight,
    --loop-hops, --self-prompts, --generation-processes or --only-set, or ''."""
    if args.intermediate_size < 0:
        return (f"--intermediate-size {args.intermediate_size}: give the drafter's FFN width "
                f"(> 0) or 0 for the target's")
    if args.layer_passes < 1:
        return f"--layer-passes {args.layer_passes}: give a count of passes >= 1 (1 = off)"
    if args.init_from_target and args.init_from:
        return "--init-from-target and --init-from: give one starting point"
    if not 0.0 <= args.reach_weight <= 1.0:
        return f"--reach-weight {args.reach_weight}: give a value in [0, 1] (0 = off)"
    if args.loop_hops < 0:
        return f"--loop-hops {args.loop_hops}: give a count of hops >= 0 (0 = off)"
    if args.self_prompts < 0 or args.self_prompt_tokens < 1:
        return (f"--self-prompts {args.self_prompts} --self-prompt-tokens "
                f"{args.self_prompt_tokens}: give a count >= 0 and a length >= 1")
    if args.generation_processes < 0:
        return (f"--generation-processes {args.generation_processes}: give a count of processes "
                "(1 = one set after another) or 0 for the device's default")
    name = args.only_set
    if not name or name == "follow-ups":
        return ""
    if not name.isdigit() or int(name) >= args.samples_per_prompt:
        return (f"--only-set {name!r}: give 'follow-ups' or a sampled set's index, 0 to "
                f"{args.samples_per_prompt - 1} (--samples-per-prompt {args.samples_per_prompt})")
    if args.sampled_temperature <= 0:
        return f"--only-set {name}: sampled sets need --sampled-temperature > 0"
    return ""


def _generate(args, prompts: list, temperature: float, seed: int,
              ids: list[list[int]] | None = None) -> list[Example]:
    import torch

    from runtime.tokenizer import ChatTokenizer
    from train.target_runner import TargetRunner
    backend = attention_backend(args)
    if ids is None:
        tok = ChatTokenizer(args.target)
        ids = [chat_prompt_ids(tok, p.text) for p in prompts]
    longest = max(len(i) for i in ids)
    runner = TargetRunner(args.target,
                          TargetRunner.tokens_for(args.concurrency, longest + args.max_new_tokens),
                          getattr(torch, args.dtype), args.device, backend)
    t0 = time.monotonic()
    out = generate(runner, prompts, ids, temperature, args.max_new_tokens, seed,
                   args.concurrency)
    n = sum(len(e.response_ids) for e in out)
    log.info("generated %d answers, %d tokens in %.0f s (T=%s)", len(out), n,
             time.monotonic() - t0, temperature)
    return out


def run(args: argparse.Namespace) -> int:
    from runtime.config import read_config_json
    from services.common.logs import setup_logging
    from train import draft_vocab
    from train.config import TrainConfig
    from train.prompts import load_prompts
    from train.report import evaluate_splits, write_card
    from train.trainer import (
        tapped_layers,
        train,
        warm_start_problem,
    )
    setup_logging("INFO", "train-draft")
    out = Path(args.out)
    work = Path(args.work) if args.work else out.parent / "work"
    cfg = TrainConfig(target_dir=args.target, out_dir=str(out), num_layers=args.layers,
                      intermediate_size=args.intermediate_size, layer_passes=args.layer_passes,
                      block_size=args.block_size, num_taps=args.taps,
                      target_layer_ids=tuple(args.target_layer_ids or ()),
                      mask_token_id=args.mask_token_id, steps=args.steps,
                      batch_sequences=args.batch_sequences,
                      blocks_per_sequence=args.blocks_per_sequence, lr=args.lr,
                      gamma=args.gamma, reach_weight=args.reach_weight,
                      anchor_window=args.anchor_window, loop_hops=args.loop_hops,
                      eval_sequences=min(args.eval_sequences, 64), seed=args.seed,
                      greedy_labels=args.labels == "greedy", eval_every=args.eval_every,
                      device=args.device,
                      checkpoint=args.checkpoint or str(work / "checkpoint.pt"),
                      stop_after_seconds=args.stop_after, cache_features=args.cache_features,
                      init_from=args.init_from, init_from_target=args.init_from_target,
                      soft_label_weight=args.soft_labels,
                      feature_backend=attention_backend(args))
    if err := argument_error(args):
        print(f"train-draft: {err}", file=sys.stderr)
        return 2
    target_raw = read_config_json(args.target)
    if args.init_from_target and (err := warm_start_problem(args.intermediate_size, target_raw)):
        print(f"train-draft: {err}", file=sys.stderr)
        return 2
    try:
        tapped_layers(cfg, int(target_raw["num_hidden_layers"]))
    except ValueError as e:
        print(f"train-draft: {e}", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    folder = args.prompts or None
    train_prompts = load_prompts("train", folder)
    if args.limit_prompts:
        train_prompts = random.Random(args.seed).sample(train_prompts, args.limit_prompts)
    whole_eval = {s: load_prompts(s, folder) for s in ("eval_in", "eval_unseen")}
    eval_sets = whole_eval
    if args.limit_eval:
        eval_sets = {s: random.Random(args.seed).sample(p, min(args.limit_eval, len(p)))
                     for s, p in whole_eval.items()}
    # evaluations take the first --eval-sequences of each split: shuffled, a sample of each
    held = {s: shuffled(answers(args, s, 0.0, p, work), args.seed) for s, p in eval_sets.items()}
    greedy = answers(args, "train", 0.0, train_prompts, work)
    if args.only_set:
        one_set(args, args.only_set, train_prompts, greedy, work)
        return 0
    generate_in_parallel(args, train_prompts, greedy, work)
    examples = greedy + follow_up_answers(args, train_prompts, greedy, work)
    if args.sampled_temperature > 0:
        for k in range(args.samples_per_prompt):
            examples += answers(args, "train", args.sampled_temperature, train_prompts, work, k)
    examples += self_prompt_answers(args, work, [p.text for s in whole_eval.values() for p in s])
    if args.generate_only:
        return 0
    result = train(cfg, examples, held["eval_in"])
    if not result.finished:
        log.info("training paused at step %d of %d (%.0f s so far); run the same command again "
                 "to continue from %s", result.state.step, cfg.steps, result.state.seconds,
                 cfg.checkpoint)
        return 0
    path, summary = result.out, result.summary
    vocab = draft_vocab.write(path, (e.response_ids for e in greedy), args.target,
                              f"response_ids of the target's {len(greedy)} greedy answers to "
                              f"the training prompts")
    summary["draft_vocab"] = len(vocab.ids)
    summary["eval"] = evaluate_splits(replace(cfg, eval_sequences=args.eval_sequences), path, held)
    summary["command"] = "dflash " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    (path / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_card(path, summary)
    log.info("drafter written to %s: %s", path, json.dumps(summary["eval"]))
    return 0
