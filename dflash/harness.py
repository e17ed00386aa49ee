"""A target or draft service started with test or benchmark hooks (services/common/hooks.py):

    python -m dflash.harness target [HOOKS] -- SERVICE FLAGS     (as python -m services.target)
    python -m dflash.harness draft  [HOOKS] -- SERVICE FLAGS     (as python -m services.draft)

HOOKS: --warmup-delay S, --random-weights (both); target only: --force-tau T,
--force-profile P1,P2,.. (conditional acceptance by draft position), --hybrid-wrapper,
--no-mamba-commit, --skip-mamba-commit, --backend-delay S. (TargetHooks.nan_logits_for is for in-process tests.) The services themselves read no such flag or
environment variable: a deployment cannot switch them on. Every hook in use is logged loudly."""
from __future__ import annotations

import argparse
import random
import sys
from dataclasses import asdict, dataclass, fields

from services.common.hooks import ServiceHooks
from services.target.hooks import TargetHooks


class ForcedAcceptance:
    """Benchmarks: accepted drafts per chain verify, floor(tau-1) or one more, so that the mean
    committed tokens per step is tau (clamped to the drafts there are). The output is NOT the
    target's: speed measurements only."""

    def __init__(self, tau: float, seed: int = 0) -> None:
        if tau < 1.0:
            raise ValueError(f"a forced tau must be >= 1 (committed tokens per step), got {tau}")
        self.tau = tau
        self.mean = tau - 1.0
        self.rng = random.Random(seed)

    def accepted(self, num_drafts: int) -> int:
        base = int(self.mean)
        a = base + (1 if self.rng.random() < self.mean - base else 0)
        return min(a, num_drafts)


class ForcedProfile:
    """Benchmarks: a chain's drafts accepted position by position, draft d (1-based) with
    probability p[d - 1] once d - 1 were (the last p repeats), like a drafter that is surer of
    its first drafts than of its last - an acceptance that depends on the block, so adaptive
    speculation has something to learn. The output is NOT the target's: speed only."""

    def __init__(self, profile: str, seed: int = 0) -> None:
        try:
            self.p = [float(x) for x in profile.split(",")]
        except ValueError:
            self.p = []
        if not self.p or not all(0.0 <= p <= 1.0 for p in self.p):
            raise ValueError(f"a forced profile is comma-separated probabilities in [0, 1], "
                             f"got {profile!r}")
        self.rng = random.Random(seed)

    def accepted(self, num_drafts: int) -> int:
        a = 0
        while a < num_drafts and self.rng.random() < self.p[min(a, len(self.p) - 1)]:
            a += 1
        return a

    def expected(self, num_drafts: int) -> float:
        """Mean committed tokens of a step with num_drafts drafts (the bonus included)."""
        out, reach = 1.0, 1.0
        for d in range(num_drafts):
            reach *= self.p[min(d, len(self.p) - 1)]
            out += reach
        return out


@dataclass(frozen=True)
class HookFlags:
    """The hooks as command-line flags (what a Stack or a test passes to this module). Each
    field is one flag: --warmup-delay, --random-weights, --force-tau, ... (its help: FLAG_HELP)."""
    warmup_delay_s: float = 0.0
    random_weights: bool = False
    force_tau: float = 0.0              # 0 = the target's own acceptance
    force_profile: str = ""             # "" = the target's own acceptance
    hybrid_wrapper: bool = False
    no_mamba_commit: bool = False
    skip_mamba_commit: bool = False
    fail_cost_calibration: bool = False
    backend_delay_s: float = 0.0
    fail_tensor_parallel_rank: int = 0

    def argv(self) -> list[str]:
        """The flags that differ from the defaults, for `python -m dflash.harness ROLE`."""
        out: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out += [_flag(f.name)] if value is True else [_flag(f.name), str(value)]
        return out

    def module(self, role: str) -> list[str]:
        """What follows `python -m` up to the service's own flags: the service itself, or this
        harness when any hook is set."""
        if self == HookFlags():
            return [f"services.{role}"]
        return ["dflash.harness", role, *self.argv(), "--"]

    def target_hooks(self) -> TargetHooks:
        return TargetHooks(
            warmup_delay_s=self.warmup_delay_s, random_weights=self.random_weights,
            hybrid_wrapper=self.hybrid_wrapper, mamba_commit=not self.no_mamba_commit,
            skip_mamba_commit=self.skip_mamba_commit,
            fail_cost_calibration=self.fail_cost_calibration,
            backend_delay_s=self.backend_delay_s, forced_acceptance=self._forced(),
            fail_tensor_parallel_rank=self.fail_tensor_parallel_rank)

    def _forced(self) -> ForcedAcceptance | ForcedProfile | None:
        if self.force_tau and self.force_profile:
            raise ValueError("--force-tau and --force-profile: one or the other")
        if self.force_profile:
            return ForcedProfile(self.force_profile)
        return ForcedAcceptance(self.force_tau) if self.force_tau else None

    def draft_hooks(self) -> ServiceHooks:
        target_only = ("force_tau", "force_profile", "hybrid_wrapper", "no_mamba_commit",
                       "skip_mamba_commit", "fail_cost_calibration", "backend_delay_s")
        used = [k for k in target_only if getattr(self, k) != getattr(HookFlags(), k)]
        if used:
            raise ValueError(f"target-only hooks given to a draft: {sorted(used)}")
        return ServiceHooks(warmup_delay_s=self.warmup_delay_s, random_weights=self.random_weights)


NO_HOOK_FLAGS = HookFlags()
FLAG_HELP = {
    "warmup_delay_s": "extra seconds of warm-up",
    "random_weights": "random weights, not loaded",
    "force_tau": "target: accept drafts so that the mean committed tokens per step is T",
    "force_profile": "target: accept draft d of a chain with probability P_d once d - 1 were "
                     "(comma-separated; the last repeats)",
    "hybrid_wrapper": "target: wrap a dense model's backend in the hybrid wrapper",
    "no_mamba_commit": "target: a hybrid backend that cannot commit recurrent state",
    "skip_mamba_commit": "target: advertise the mamba commit and skip it (WRONG output)",
    "fail_cost_calibration": "target: the verify cost calibration fails (start-up goes on)",
    "backend_delay_s": "target: extra seconds while the attention backend is built",
    "fail_tensor_parallel_rank": "target: this tensor-parallel rank (1..) fails at start-up",
}


def _flag(field_name: str) -> str:
    return "--" + field_name.removesuffix("_s").replace("_", "-")


def parse(argv: list[str]) -> tuple[str, HookFlags, list[str]]:
    """(role, hooks, the service's own argv)."""
    if "--" in argv:
        cut = argv.index("--")
        mine, service_argv = argv[:cut], argv[cut + 1:]
    else:
        mine, service_argv = argv, []
    p = argparse.ArgumentParser(prog="python -m dflash.harness", description=__doc__.splitlines()[0])
    p.add_argument("role", choices=("target", "draft"))
    for f in fields(HookFlags):
        if f.type == "bool":
            p.add_argument(_flag(f.name), dest=f.name, action="store_true", help=FLAG_HELP[f.name])
        elif f.type == "str":
            p.add_argument(_flag(f.name), dest=f.name, default=f.default, help=FLAG_HELP[f.name])
        else:
            p.add_argument(_flag(f.name), dest=f.name, default=f.default, help=FLAG_HELP[f.name],
                           type=int if f.type == "int" else float)
    a = vars(p.parse_args(mine))
    role = a.pop("role")
    return role, HookFlags(**a), service_argv


def main(argv: list[str] | None = None) -> int:
    role, flags, service_argv = parse(sys.argv[1:] if argv is None else argv)
    print(f"WARNING dflash.harness: TEST/BENCHMARK HOOKS on this {role}: "
          f"{ {k: v for k, v in asdict(flags).items() if v} }", file=sys.stderr, flush=True)
    if role == "target":
        from services.target.__main__ import main as target_main
        return target_main(service_argv, flags.target_hooks())
    from services.draft.__main__ import main as draft_main
    return draft_main(service_argv, flags.draft_hooks())


if __name__ == "__main__":
    raise SystemExit(main())
