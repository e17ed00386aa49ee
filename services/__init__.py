"""The model services (target, draft) and what they share.

Set before torch loads libgomp (importing this package comes first in `python -m
services.target` / `services.draft`): an idle OpenMP worker spins for GOMP_SPINCOUNT rounds
before it sleeps, and libgomp's default (300 000, milliseconds of spinning) lets the target's
idle workers take the cores the draft computes on right after a Verify, and the draft's those
of the next Verify. 10 000 still covers the gaps between the kernels of one forward. Measured
through `dflash up` on 2 cores: a speculative step 43 ms -> 34 ms, autoregressive unchanged
(docs/benchmarks.md, "CPU compute"). See also runtime/threads.py."""
import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")
