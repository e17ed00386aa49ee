"""What tests and benchmarks may change in a model service that a deployment never does.

No flag and no environment variable of a service sets these: its `main(argv, hooks)` takes them
as an argument, and only `dflash/harness.py` (which tests and benchmarks start instead of
`python -m services.<role>`) or an in-process caller passes anything but the defaults."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceHooks:
    warmup_delay_s: float = 0.0        # start-up tests: make warm-up observably slow
    random_weights: bool = False       # benchmarks: random weights instead of the checkpoint's
                                       # (a forward's speed does not depend on the values)


NO_HOOKS = ServiceHooks()              # what a deployment runs with
