"""Benchmark-only switches. They are read from environment variables (never from a service's
flags), logged loudly at start-up, and reported beside every number they touch.

DFLASH_BENCH_RANDOM_WEIGHTS=1   models are random-initialised on the device instead of loaded
                                (the speed of a forward does not depend on the values).
DFLASH_BENCH_FORCE_TAU=6.4      the target accepts a forced number of drafts per verify so that
                                the mean committed tokens per step is tau (output is NOT the
                                target's: speed measurements only)."""
from __future__ import annotations

import logging
import os
import random

log = logging.getLogger("dflash.bench")

RANDOM_WEIGHTS_ENV = "DFLASH_BENCH_RANDOM_WEIGHTS"
FORCE_TAU_ENV = "DFLASH_BENCH_FORCE_TAU"


def random_weights() -> bool:
    on = os.environ.get(RANDOM_WEIGHTS_ENV, "") not in ("", "0")
    if on:
        log.warning("BENCHMARK-ONLY: %s is set: weights are random, outputs are meaningless",
                    RANDOM_WEIGHTS_ENV)
    return on


def forced_tau() -> float | None:
    text = os.environ.get(FORCE_TAU_ENV, "")
    if not text:
        return None
    tau = float(text)
    if tau < 1.0:
        raise ValueError(f"{FORCE_TAU_ENV} must be >= 1, got {tau}")
    log.warning("BENCHMARK-ONLY: %s=%s: acceptance is forced, the output is NOT the target's",
                FORCE_TAU_ENV, tau)
    return tau


class ForcedAcceptance:
    """Accepted drafts per step: floor(tau-1) or one more, so that the mean is tau-1 (clamped
    to the drafts available)."""

    def __init__(self, tau: float, seed: int = 0) -> None:
        self.mean = tau - 1.0
        self.rng = random.Random(seed)

    def accepted(self, num_drafts: int) -> int:
        base = int(self.mean)
        a = base + (1 if self.rng.random() < self.mean - base else 0)
        return min(a, num_drafts)
