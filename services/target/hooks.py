"""The target's test and benchmark hooks (services/common/hooks.py says who may set them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from services.common.hooks import ServiceHooks


class AcceptanceOverride(Protocol):
    def accepted(self, num_drafts: int) -> int:
        """How many of a chain's num_drafts drafts to accept instead of the target's choice."""


@dataclass(frozen=True)
class TargetHooks(ServiceHooks):
    hybrid_wrapper: bool = False       # wrap a dense model's backend in HybridAttnBackend: the
                                       # delegating wrapper of the seed bug must not claim a commit
    mamba_commit: bool = True          # False: a hybrid backend that cannot commit recurrent state
    skip_mamba_commit: bool = False    # advertise the mamba commit and skip it: WRONG output, for
                                       # the tests that prove the commit matters
    forced_acceptance: AcceptanceOverride | None = None   # benchmarks: accepted drafts per chain
                                       # verify (the output is NOT the target's; speed only)
    nan_logits_for: str = ""           # tests: sequences whose id starts with this get NaN
                                       # logits (per-sequence failure isolation)
    fail_cost_calibration: bool = False   # tests: the warm-up verify cost calibration raises
                                       # (the service must start anyway, with no cost curve)
    backend_delay_s: float = 0.0       # tests: seconds spent building the attention backend
                                       # (a slow backend initialisation, the seed's scenario)
    fail_tensor_parallel_rank: int = 0   # tests: this follower rank (1..) raises at start-up
    pad_verify_to: tuple[int, ...] = ()   # tests: pad chain verify blocks as if CUDA graphs of
                                       # these sizes were captured (the padding runs on the CPU)
    pad_prefill_to: tuple[int, ...] = ()  # tests: the same for a lone prompt chunk


NO_TARGET_HOOKS = TargetHooks()        # what a deployment runs with
