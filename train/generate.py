"""Step 1 of training: the target answers the training prompts itself (greedy and sampled) with
the project's own model code, paged KV cache and attention backend (`TargetRunner`), in waves:
a wave of up to `concurrency` prompts is prefilled in one forward, then decoded one token per
sequence per forward until each sequence stops (EOS or max_new); finished sequences leave the
batch. Sampling happens on the device from one seeded generator per wave."""
from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from runtime.attention.metadata import SeqSlice
from runtime.sampling import SamplingConfig, target_probs
from runtime.tokenizer import ChatTokenizer
from train.target_runner import TargetRunner

log = logging.getLogger("dflash.train.generate")


@dataclass(frozen=True)
class Example:
    """One training sequence: chat-formatted prompt ids and the target's own response ids."""
    prompt_id: str
    category: str
    prompt_ids: list[int]
    response_ids: list[int]
    temperature: float

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def chat_prompt_ids(tok: ChatTokenizer, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True)
    return tok.encode(rendered)


def pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """logits fp32 [N, V] -> int64 [N]: argmax at temperature 0, else a draw from the target's
    sampling distribution at that temperature (runtime.sampling.target_probs)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = target_probs(logits, SamplingConfig(temperature=temperature))
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


@torch.inference_mode()
def answer_wave(runner: TargetRunner, prompts: list[list[int]], temperature: float,
                max_new: int, seed: int) -> list[list[int]]:
    """Responses (each ending at its EOS, or max_new tokens long) to one wave of prompts."""
    eos = set(runner.eos_token_ids)
    gen = torch.Generator(device=runner.device)
    gen.manual_seed(seed)
    tables = runner.tables([len(p) + max_new for p in prompts])
    try:
        flat = torch.tensor([i for p in prompts for i in p], device=runner.device)
        out = runner.forward([SeqSlice(t, 0, len(p)) for t, p in zip(tables, prompts)], flat)
        last = torch.tensor([len(p) for p in prompts], device=runner.device).cumsum(0) - 1
        nxt = pick(runner.model.compute_logits(out.hidden[last]), temperature, gen)
        responses: list[list[int]] = [[] for _ in prompts]
        active = list(range(len(prompts)))
        while active:
            toks = nxt.tolist()
            keep = []                                  # (row in nxt, sequence) still going
            for row, i in enumerate(active):
                responses[i].append(toks[row])
                if toks[row] not in eos and len(responses[i]) < max_new:
                    keep.append((row, i))
            if not keep:
                break
            rows = torch.tensor([r for r, _ in keep], device=runner.device)
            active = [i for _, i in keep]
            slices = [SeqSlice(tables[i], len(prompts[i]) + len(responses[i]) - 1, 1)
                      for i in active]
            out = runner.forward(slices, nxt[rows])
            nxt = pick(runner.model.compute_logits(out.hidden), temperature, gen)
        return responses
    finally:
        runner.release(tables)


def generate(runner: TargetRunner, prompts: list, ids: list[list[int]], temperature: float,
             max_new: int, seed: int, concurrency: int) -> list[Example]:
    """prompts: records with .id, .category, .text; ids: their chat-formatted token ids
    (chat_prompt_ids) -> Examples in the same order. Waves hold prompts of similar length
    (sorted), `concurrency` at most."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    responses: dict[int, list[int]] = {}
    t0, tokens = time.monotonic(), 0
    for w, start in enumerate(range(0, len(order), concurrency)):
        wave = order[start: start + concurrency]
        for i, resp in zip(wave, answer_wave(runner, [ids[i] for i in wave], temperature,
                                             max_new, seed * 100_003 + w)):
            responses[i] = resp
            tokens += len(resp)
        log.info("generated %d/%d answers, %d tokens, %.0f tokens/s (T=%s)", len(responses),
                 len(ids), tokens, tokens / max(1e-9, time.monotonic() - t0), temperature)
    return [Example(rec.id, rec.category, ids[i], responses[i], temperature)
            for i, rec in enumerate(prompts)]


def save_examples(examples: list[Example], path: Path) -> None:
    write_whole(path, "".join(json.dumps(asdict(e)) + "\n" for e in examples))


def write_whole(path: Path, text: str) -> None:
    """Written whole or not at all (runs sharing a --work folder may write the same file)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def shuffled(examples: list[Example], seed: int) -> list[Example]:
    """A seeded shuffle: the first N of a held-out split become a sample of every category
    (split files are grouped by category)."""
    out = list(examples)
    random.Random(seed).shuffle(out)
    return out


def load_examples(path: Path) -> list[Example]:
    with open(path) as f:
        return [Example(**json.loads(line)) for line in f if line.strip()]
