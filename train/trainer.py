"""Step 3: train the DFlash drafter (the DFlash recipe) and export it in z-lab's format.

Random anchors in the response, block = [anchor, MASK x (B-1)], context = target features before
the anchor, cross-entropy on block positions 1..B-1 with weights exp(-(k-1)/gamma); AdamW,
cosine schedule with warm-up, bf16 autocast, gradient clipping; periodic held-out acceptance."""
from __future__ import annotations

import json
import logging
import math
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from runtime.config import read_config_json
from runtime.models.dflash import (
    DFlashConfig,
    DFlashDraftModel,
    TargetFingerprint,
    TargetHead,
    build_target_layer_ids,
    check_target_layer_ids,
    init_random,
    load_dflash,
    save_dflash,
)
from runtime.models.registry import build_empty
from runtime.weights import copy_tensors, read_tensors
from train.acceptance import AcceptanceStats, simulate
from train.blocks import (
    block_inputs,
    block_loss,
    draft_hidden,
    hop_anchors,
    position_weights,
    soft_targets,
)
from train.checkpoint import TrainState, load_checkpoint, save_checkpoint
from train.config import TrainConfig
from train.features import FeatureCache, FeatureExtractor
from train.follow_ups import first_prompt_id, is_second_turn
from train.generate import Example
from train.self_prompts import CATEGORY as SELF_WRITTEN

log = logging.getLogger("dflash.train")


def tapped_layers(cfg: TrainConfig, num_target_layers: int) -> tuple[int, ...]:
    """cfg's explicit ids, else cfg.num_taps ids spread by DFlash's rule. ValueError when the
    ids cannot be tapped."""
    ids = cfg.target_layer_ids or tuple(build_target_layer_ids(num_target_layers, cfg.num_taps))
    check_target_layer_ids(ids, num_target_layers, explicit=bool(cfg.target_layer_ids))
    return ids


def draft_config_dict(cfg: TrainConfig, target_raw: dict, taps: tuple[int, ...]) -> dict:
    """Qwen3-style layers shaped like the target's (hidden, heads, head_dim; FFN width the
    target's unless cfg.intermediate_size says otherwise)."""
    hidden = int(target_raw["hidden_size"])
    heads = int(target_raw["num_attention_heads"])
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": hidden, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(target_raw.get("num_key_value_heads") or heads),
        "head_dim": int(target_raw.get("head_dim") or hidden // heads),
        "intermediate_size": cfg.intermediate_size or int(target_raw["intermediate_size"]),
        "rms_norm_eps": float(target_raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(target_raw.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(target_raw.get("max_position_embeddings", 8192)),
        "vocab_size": int(target_raw["vocab_size"]), "tie_word_embeddings": False,
        "attention_bias": False, "hidden_act": "silu", "block_size": cfg.block_size,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": cfg.mask_token_id,
                          **({"layer_passes": cfg.layer_passes} if cfg.layer_passes > 1 else {})},
        "target_fingerprint": TargetFingerprint.of_target(cfg.target_dir).to_dict(),
        "dtype": "bfloat16",
    }


class Batcher:
    """Random batches of examples; sequences cut at max_len; anchors inside the response."""

    def __init__(self, examples: list[Example], cfg: TrainConfig, rng: random.Random) -> None:
        self.examples = [e for e in examples if len(e.response_ids) >= 2]
        self.cfg, self.rng = cfg, rng

    def sample(self, n: int) -> list[int]:
        """Indices into self.examples."""
        return self.rng.sample(range(len(self.examples)), min(n, len(self.examples)))

    def tensors(self, batch: list[Example], device) -> tuple[torch.Tensor, ...]:
        return batch_tensors(batch, self.cfg.max_len, device)

    def anchors(self, batch: list[Example], device) -> torch.Tensor:
        """[S, nb] random anchor positions in [prompt_len, len-2] (with replacement if short),
        drawn from the host-side lengths (no device round trip per step). anchor_window > 0
        keeps them in the answer's first tokens: where users read, while the tails of long
        greedy answers often loop and are easy to draft."""
        nb, window = self.cfg.blocks_per_sequence, self.cfg.anchor_window
        rows = []
        for p, n in zip(*batch_lengths(batch, self.cfg.max_len)):
            choices = list(range(p, min(n - 1, p + window) if window > 0 else n - 1))
            pick = self.rng.sample(choices, nb) if len(choices) >= nb else \
                [self.rng.choice(choices) for _ in range(nb)]
            rows.append(sorted(pick))
        return torch.tensor(rows, device=device)


@torch.no_grad()
def init_output_norm(draft: DFlashDraftModel, target_dir: str) -> None:
    """The draft's final norm feeds the target's LM head, as the target's own final norm does.
    At initialisation the draft's residual stream is little more than the input token's
    embedding, which a tied head maps back onto that same token with a huge logit (initial CE
    ~100 on SmolLM2). Starting from the target's norm weights scaled by 0.1 keeps the first
    logits near uniform (CE ~ ln V) so training starts from a sane point."""
    found = read_tensors(target_dir, {"model.norm.weight"})
    weight = found.get("model.norm.weight")
    draft.norm.weight.copy_(0.1 * (weight if weight is not None else draft.norm.weight).to(
        draft.norm.weight.dtype))


@torch.no_grad()
def init_from_drafter(draft: DFlashDraftModel, path: str) -> None:
    """Continue from a trained drafter (e.g. more steps on more answers): its architecture (layers,
    FFN width), taps, block size and mask token must be the ones this run trains."""
    start = load_dflash(path, torch.float32, next(draft.parameters()).device)
    mine, theirs = draft.cfg, start.cfg
    got = (theirs.base.num_layers, theirs.base.intermediate_size, theirs.target_layer_ids,
           theirs.block_size, theirs.mask_token_id, theirs.layer_passes)
    want = (mine.base.num_layers, mine.base.intermediate_size, mine.target_layer_ids,
            mine.block_size, mine.mask_token_id, mine.layer_passes)
    if got != want:
        raise ValueError(f"--init-from {path}: (layers, FFN width, taps, block size, mask id, "
                         f"layer passes) {got} differ from this run's {want}")
    draft.load_state_dict(start.state_dict())
    log.info("starting from the weights of %s", path)


# a decoder layer's tensors, HF names below "layers.N."; copied from the target by the warm start
_LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                  "mlp.down_proj.weight", "input_layernorm.weight",
                  "post_attention_layernorm.weight")


def warm_start_problem(intermediate_size: int, target_raw: dict) -> str:
    """Why --init-from-target cannot start a drafter of this FFN width (0 = the target's) from
    the target whose config.json is target_raw, or ''."""
    width = int(target_raw["intermediate_size"])
    if intermediate_size in (0, width):
        return ""
    return (f"--init-from-target copies the target's FFN ({width} wide): the drafter's FFN width "
            f"{intermediate_size} differs from the target's; leave --intermediate-size at 0 or "
            f"{width}")


@torch.no_grad()
def init_from_target_layers(draft: DFlashDraftModel, target_dir: str) -> list[int]:
    """Warm start: draft layer i <- target layer T-L+i (attention, MLP and their norms; the draft's
    q_norm / k_norm stay unit), fc <- the last tap alone (identity on its slice, zero elsewhere)
    and hidden_norm <- the first copied layer's input norm, so the first draft layer starts by
    projecting the context as the target's layer T-L does from the deepest tapped features.
    The draft's final norm is left as init_output_norm set it. Returns the target layers used.
    ValueError when the draft's FFN width differs from the target's (warm_start_problem)."""
    cfg = draft.cfg
    target_raw = read_config_json(target_dir)
    if problem := warm_start_problem(cfg.base.intermediate_size, target_raw):
        raise ValueError(problem)
    num_target = int(target_raw["num_hidden_layers"])
    source = list(range(num_target - cfg.num_layers, num_target))
    names = {f"model.layers.{j}.{t}" for j in source for t in _LAYER_TENSORS}
    found = read_tensors(target_dir, names)
    if len(found) != len(names):
        raise ValueError(f"target {target_dir} lacks layer tensors: "
                         f"{sorted(names - set(found))[:4]}")
    dtype = draft.fc.weight.dtype
    copy_tensors(draft, {f"layers.{i}.{t}": found[f"model.layers.{j}.{t}"].to(dtype)
                         for i, j in enumerate(source) for t in _LAYER_TENSORS})
    hidden = cfg.hidden_size
    draft.fc.weight.zero_()
    draft.fc.weight[:, -hidden:].copy_(torch.eye(hidden, dtype=dtype))
    draft.hidden_norm.weight.copy_(found[f"model.layers.{source[0]}.input_layernorm.weight"])
    log.info("draft layers start from the target's layers %s", source)
    return source


def batch_lengths(batch: list[Example], max_len: int) -> tuple[list[int], list[int]]:
    """Prompt lengths (at most len-2, so every sequence has an anchor with a label) and lengths
    of the sequences cut at max_len."""
    lens = [min(len(e.ids), max_len) for e in batch]
    return [min(len(e.prompt_ids), n - 2) for e, n in zip(batch, lens)], lens


def batch_tensors(batch: list[Example], max_len: int, device) -> tuple[torch.Tensor, ...]:
    """ids [S, L] (0-padded; sequences cut at max_len), prompt lengths [S], lengths [S]
    (batch_lengths)."""
    plen, lens = batch_lengths(batch, max_len)
    ids = torch.zeros(len(batch), max(lens), dtype=torch.long)
    for i, (e, n) in enumerate(zip(batch, lens)):
        ids[i, :n] = torch.tensor(e.ids[:n])
    return ids.to(device), torch.tensor(plen, device=device), torch.tensor(lens, device=device)


def feature_cache(cfg: TrainConfig, extractor: FeatureExtractor, batcher: Batcher
                  ) -> FeatureCache | None:
    if not cfg.cache_features:
        return None
    seqs = [e.ids[: cfg.max_len] for e in batcher.examples]
    soft = cfg.soft_label_weight > 0
    need = FeatureCache.nbytes(extractor, seqs, soft)
    if torch.device(cfg.device).type == "cuda":
        free = torch.cuda.mem_get_info(torch.device(cfg.device))[0]
        if need > 0.85 * free:
            raise MemoryError(f"the feature cache needs {need / 2**30:.1f} GiB and "
                              f"{free / 2**30:.1f} GiB of device memory is free; train without "
                              "--cache-features or on fewer answers")
    t0 = time.monotonic()
    cache = FeatureCache(extractor, seqs, cfg.batch_sequences, cfg.greedy_labels, soft)
    log.info("feature cache: %d sequences, %.1f GiB, built in %.0f s", len(seqs),
             need / 2**30, time.monotonic() - t0)
    return cache


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def evaluate(draft, head, extractor, batcher, examples: list[Example], cfg: TrainConfig
             ) -> AcceptanceStats:
    total = AcceptanceStats(per_position=[0] * (cfg.block_size - 1))
    draft.eval()
    for i in range(0, len(examples), cfg.batch_sequences):
        chunk = examples[i: i + cfg.batch_sequences]
        ids, plen, lens = batcher.tensors(chunk, cfg.device)
        feats = extractor([e.ids[: cfg.max_len] for e in chunk], greedy=False).feats
        with torch.autocast(device_type=torch.device(cfg.device).type, dtype=torch.bfloat16):
            total.merge(simulate(draft, head, feats, ids, plen, lens, cfg.block_size))
    draft.train()
    return total


@dataclass
class TrainResult:
    finished: bool
    state: TrainState
    out: Path | None = None                     # the exported drafter, when finished
    summary: dict | None = None


def train(cfg: TrainConfig, train_examples: list[Example], eval_examples: list[Example]
          ) -> TrainResult:
    """Trains to cfg.steps and exports - or, with cfg.stop_after_seconds, stops when that much
    time has passed, saves cfg.checkpoint and returns unfinished; the same call resumes it."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    target_raw = read_config_json(cfg.target_dir)
    taps = tapped_layers(cfg, int(target_raw["num_hidden_layers"]))
    raw = draft_config_dict(cfg, target_raw, taps)
    dcfg = DFlashConfig.from_dict(raw)
    draft = build_empty(DFlashDraftModel, dcfg, cfg.device, torch.float32)
    init_random(draft, cfg.seed)
    init_output_norm(draft, cfg.target_dir)
    if cfg.init_from_target:
        init_from_target_layers(draft, cfg.target_dir)
    if cfg.init_from:
        init_from_drafter(draft, cfg.init_from)
    draft.train()
    head = TargetHead.load(cfg.target_dir, torch.bfloat16, cfg.device)
    extractor = FeatureExtractor(cfg.target_dir, taps, cfg.batch_sequences * cfg.max_len + 1024,
                                 torch.bfloat16, cfg.device, cfg.feature_backend)
    batcher = Batcher(train_examples, cfg, rng)
    cache = feature_cache(cfg, extractor, batcher)
    decay = [p for n, p in draft.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in draft.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr,
                            betas=(0.9, 0.95))
    weights = position_weights(cfg.block_size, cfg.gamma, cfg.device)
    state = load_checkpoint(cfg, draft, opt, rng, len(batcher.examples))
    if state.step:
        log.info("resuming from %s at step %d of %d", cfg.checkpoint, state.step, cfg.steps)
    history = state.history
    t0 = time.monotonic() - state.seconds
    t_segment = time.monotonic()
    for step in range(state.step, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        picked = batcher.sample(cfg.batch_sequences)
        batch = [batcher.examples[i] for i in picked]
        ids, _, lens = batcher.tensors(batch, cfg.device)
        target = cache(picked) if cache else \
            extractor([e.ids[: cfg.max_len] for e in batch], greedy=cfg.greedy_labels,
                      final=cfg.soft_label_weight > 0)
        chain = target.greedy if cfg.greedy_labels else None
        anchors = batcher.anchors(batch, cfg.device)
        with torch.autocast(device_type=torch.device(cfg.device).type, dtype=torch.bfloat16):
            if cfg.loop_hops:
                anchors = hop_anchors(draft, head, target.feats, ids, anchors, lens,
                                      cfg.block_size, cfg.mask_token_id, cfg.loop_hops, chain)
        bids, bpos, labels = block_inputs(ids, anchors, cfg.block_size, cfg.mask_token_id, lens,
                                          chain)
        soft = soft_targets(target.final, anchors, cfg.block_size) \
            if target.final is not None else None
        with torch.autocast(device_type=torch.device(cfg.device).type, dtype=torch.bfloat16):
            hidden = draft_hidden(draft, head, target.feats, bids, bpos)
            loss, acc = block_loss(hidden, labels, head, weights, soft, cfg.soft_label_weight,
                                   cfg.reach_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        opt.step()
        if step % 25 == 0 or step == cfg.steps - 1:
            loss_v, acc_v = float(loss.detach()), acc.detach()
            _progress(step, cfg.steps, loss_v, acc_v, float(gnorm), time.monotonic() - t0)
            history.append({"step": step, "loss": round(loss_v, 4),
                            "acc_pos1": round(float(acc_v[0]), 4)})
        if eval_examples and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1):
            st = evaluate(draft, head, extractor, batcher, eval_examples[: cfg.eval_sequences], cfg)
            history[-1]["eval_tau"] = round(st.tau, 3)
            log.info("step %d held-out tau %.3f", step + 1, st.tau)
        if (cfg.stop_after_seconds > 0 and step + 1 < cfg.steps
                and time.monotonic() - t_segment >= cfg.stop_after_seconds):
            state = TrainState(step + 1, time.monotonic() - t0, history)
            if cfg.checkpoint:
                save_checkpoint(cfg, state, draft, opt, rng, len(batcher.examples))
            sys.stderr.write("\n")
            log.info("stopped at step %d of %d after %.0f s; checkpoint %s", step + 1, cfg.steps,
                     time.monotonic() - t_segment, cfg.checkpoint or "(none)")
            return TrainResult(False, state)
    out = save_dflash(draft, cfg.out_dir, dtype=torch.bfloat16)
    summary = {"config": {k: v for k, v in asdict(cfg).items() if k != "extra"},
               "target_layer_ids": list(taps), "history": history,
               "train_seconds": round(time.monotonic() - t0, 1),
               "num_train_examples": len(batcher.examples),
               "num_train_prompts": len({first_prompt_id(e.prompt_id)
                                         for e in batcher.examples}),
               "num_second_turns": sum(is_second_turn(e.prompt_id) for e in batcher.examples),
               "num_self_written": sum(e.category == SELF_WRITTEN for e in batcher.examples),
               "answers_by_temperature": dict(Counter(str(e.temperature)
                                                      for e in batcher.examples))}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.checkpoint:
        Path(cfg.checkpoint).unlink(missing_ok=True)     # the run is done: nothing to resume
    return TrainResult(True, TrainState(cfg.steps, summary["train_seconds"], history), out, summary)


def _progress(step: int, total: int, loss: float, acc: torch.Tensor, gnorm: float,
              seconds: float) -> None:
    width = 30
    done = int(width * (step + 1) / total)
    bar = "#" * done + "." * (width - done)
    sys.stderr.write(f"\r[{bar}] {step + 1}/{total} loss {loss:.3f} acc@1 {float(acc[0]):.3f} "
                     f"acc@4 {float(acc[min(3, len(acc) - 1)]):.3f} |g| {gnorm:.2f} {seconds:.0f}s")
    sys.stderr.flush()
    if step + 1 == total:
        sys.stderr.write("\n")
