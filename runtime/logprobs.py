"""Log-probabilities of committed tokens (SamplingParams.logprobs), as pure tensor functions.

Which distribution: `raw` (the default, vLLM's raw_logprobs) is the log-softmax of the model's
logits before anything the request changes (temperature, top-k / top-p, min_tokens' suppression,
structured-output masks); `processed` is the distribution the token was chosen from (after all
of them; for a greedy request, the masked logits without temperature). Either way a committed
token's row is the target's own at that position, so the value does not depend on whether the
token was drafted, accepted or the bonus (within the forward's rounding)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling import SamplingConfig, target_probs


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float                                   # of the committed token
    top: tuple[tuple[int, float], ...] = ()          # (token, logprob), most likely first


def processed_logprobs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [N, V] after masks and suppression -> log-probabilities [N, V] of the distribution
    tokens are chosen from (-inf where a token cannot be chosen)."""
    if cfg.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log(target_probs(logits.float(), cfg))


class LogprobBatch:
    """The logprobs one forward's works asked for, gathered on the device and read back in one
    transfer: add() per work (its rows' log-probabilities [n, V] and the n tokens committed
    there), then read()."""

    def __init__(self) -> None:
        self.parts: list[tuple[torch.Tensor, int, int]] = []   # (packed values, n, k)

    def add(self, logprobs: torch.Tensor, tokens: list[int], k: int) -> None:
        """logprobs [n, V] (n = len(tokens)); k: top tokens per row (0..V)."""
        index = torch.tensor(tokens, dtype=torch.int64).to(logprobs.device, non_blocking=True)
        chosen = logprobs.gather(1, index[:, None])[:, 0]                   # [n]
        top = logprobs.topk(k, dim=-1) if k else None
        values = [chosen.double()]
        if top is not None:     # float64 holds both token ids and float32 values exactly
            values += [top.indices.double().flatten(), top.values.double().flatten()]
        self.parts.append((torch.cat(values), len(tokens), k))

    def read(self) -> list[list[TokenLogprobs]]:
        """One list per add(), one entry per token, in order (one host sync)."""
        if not self.parts:
            return []
        flat = torch.cat([v for v, _, _ in self.parts]).tolist()
        out, at = [], 0
        for _, n, k in self.parts:
            chosen, ids = flat[at: at + n], flat[at + n: at + n + n * k]
            vals = flat[at + n + n * k: at + n + 2 * n * k]
            at += n + 2 * n * k
            out.append([TokenLogprobs(chosen[i], tuple(
                (int(ids[i * k + j]), vals[i * k + j]) for j in range(k))) for i in range(n)])
        return out
