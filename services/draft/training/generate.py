"""Step 1 of training: the target answers the training prompts itself (greedy and sampled),
through the project's own target engine - many sequences batched per forward."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from runtime.sampling import SamplingConfig
from runtime.tokenizer import ChatTokenizer
from services.target.engine import PrefillCall, TargetEngine

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


async def _answer(engine: TargetEngine, seq_id: str, prompt: list[int], sampling: SamplingConfig,
                  max_new: int, eos: set[int]) -> list[int]:
    """Autoregressive decoding through the engine (Verify of the anchor alone)."""
    first = await engine.prefill(PrefillCall(seq_id, prompt, sampling, (), torch.bfloat16))
    out = [first.next_token]
    while out[-1] not in eos and len(out) < max_new:
        out.extend((await engine.verify(seq_id, [out[-1]])).committed)
    await engine.release(seq_id)
    return out


async def generate(engine: TargetEngine, tok: ChatTokenizer, prompts: list, temperature: float,
                   max_new: int, seed: int, concurrency: int) -> list[Example]:
    """prompts: records with .id, .category, .text. Keeps `concurrency` sequences in flight."""
    eos = set(engine.worker.facts.eos_token_ids)
    sem = asyncio.Semaphore(concurrency)
    done = 0
    t0 = time.monotonic()

    async def one(i: int, rec) -> Example:
        nonlocal done
        async with sem:
            ids = chat_prompt_ids(tok, rec.text)
            sampling = SamplingConfig(temperature=temperature, seed=seed + i)
            resp = await _answer(engine, f"gen-{temperature}-{i}", ids, sampling, max_new, eos)
            done += 1
            if done % 500 == 0:
                log.info("generated %d/%d (%.0f s)", done, len(prompts), time.monotonic() - t0)
            return Example(rec.id, rec.category, ids, resp, temperature)

    return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(prompts))))


def save_examples(examples: list[Example], path: Path) -> None:
    with open(path, "w") as f:
        for e in examples:
            f.write(json.dumps(asdict(e)) + "\n")


def load_examples(path: Path) -> list[Example]:
    with open(path) as f:
        return [Example(**json.loads(line)) for line in f if line.strip()]
