"""Test and benchmark hooks (services/common/hooks.py, dflash/harness.py): a forced acceptance
reaches the target engine only as a constructor argument and makes the mean committed tokens per
verify step equal tau; the harness starts a real target with it over gRPC and says so loudly;
no flag and no environment variable of a service can switch a hook on."""
from __future__ import annotations

import importlib
import random

import pytest
import torch
from support.inproc_target import loaded_worker, run, started_engine
from support.procs import start_target
from support.target_client import TargetClient
from support.tiny_models import make_tiny

from dflash.harness import ForcedAcceptance, ForcedProfile, HookFlags, parse
from runtime.sampling import SamplingConfig
from services.target.engine import PrefillCall
from services.target.hooks import TargetHooks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny_hooks"), "qwen3")


def _random_drafts(rng: random.Random, block: int) -> list[int]:
    return [rng.randrange(200) for _ in range(block - 1)]


def _mean_committed(engine, blocks: int, block: int = 16) -> tuple[float, list[int]]:
    rng = random.Random(0)
    pre = run(engine.prefill(PrefillCall("s", [1, 2, 3, 4], SamplingConfig(), (), torch.bfloat16)))
    anchor, committed, out = pre.next_token, 0, []
    for _ in range(blocks):
        drafts = _random_drafts(rng, block)
        v = run(engine.verify("s", [anchor] + drafts))
        assert v.committed[: v.accepted] == drafts[: v.accepted]
        committed += len(v.committed)
        out.append(v.accepted)
        anchor = v.committed[-1]
    run(engine.release("s"))
    return committed / blocks, out


def test_forced_tau_sets_the_mean_committed_per_step(model_dir):
    hooks = TargetHooks(forced_acceptance=ForcedAcceptance(3.5))
    engine = started_engine(loaded_worker(model_dir, hooks, kv_budget_bytes=32 << 20))
    try:
        mean, accepted = _mean_committed(engine, 120)
        assert abs(mean - 3.5) < 0.2
        assert set(accepted) == {2, 3}                      # floor(tau-1) or one more
        assert engine.stats.accepted_tokens == sum(accepted)
    finally:
        engine.stop()


def test_without_the_hook_random_drafts_are_rejected(model_dir, monkeypatch):
    monkeypatch.setenv("DFLASH_BENCH_FORCE_TAU", "6.4")       # the old switch: read by nothing
    engine = started_engine(loaded_worker(model_dir, kv_budget_bytes=32 << 20))
    try:
        assert engine.forced is None
        mean, _ = _mean_committed(engine, 10)
        assert mean < 1.5
    finally:
        engine.stop()


def test_bad_tau_is_refused():
    with pytest.raises(ValueError, match=">= 1"):
        ForcedAcceptance(0.5)


def test_forced_acceptance_is_clamped_to_the_drafts():
    f = ForcedAcceptance(6.4)
    assert all(f.accepted(3) <= 3 for _ in range(50))
    assert {f.accepted(15) for _ in range(200)} == {5, 6}


def test_forced_profile_accepts_position_by_position():
    """Draft d accepted with probability p_d once d - 1 were: the mean over many steps matches
    the profile's expectation, a 0 stops the chain there, and the count never passes the drafts."""
    f = ForcedProfile("0.9,0.8,0.5")
    steps = [f.accepted(6) for _ in range(20000)]
    assert max(steps) <= 6
    assert 1 + sum(steps) / len(steps) == pytest.approx(f.expected(6), rel=0.03)
    assert f.expected(2) == pytest.approx(1 + 0.9 + 0.72)
    assert {ForcedProfile("1,1,0").accepted(8) for _ in range(20)} == {2}


@pytest.mark.parametrize("bad", ["", "0.9,x", "1.5", "-0.1"])
def test_bad_forced_profile_is_refused(bad):
    with pytest.raises(ValueError, match="comma-separated probabilities"):
        ForcedProfile(bad)


def test_force_tau_and_profile_are_exclusive():
    with pytest.raises(ValueError, match="one or the other"):
        HookFlags(force_tau=3.0, force_profile="0.5").target_hooks()


def test_hook_flags_round_trip_through_the_command_line():
    flags = HookFlags(warmup_delay_s=2.5, random_weights=True, force_tau=6.4, no_mamba_commit=True)
    role, parsed, service_argv = parse(["target", *flags.argv(), "--", "--model", "m"])
    assert (role, parsed, service_argv) == ("target", flags, ["--model", "m"])
    hooks = parsed.target_hooks()
    assert hooks.random_weights and not hooks.mamba_commit and hooks.warmup_delay_s == 2.5
    assert hooks.forced_acceptance.tau == 6.4
    assert HookFlags().argv() == []
    profiled = HookFlags(force_profile="0.9,0.7")
    assert parse(["target", *profiled.argv()])[1] == profiled
    assert profiled.target_hooks().forced_acceptance.p == [0.9, 0.7]
    with pytest.raises(ValueError, match="target-only hooks given to a draft"):
        HookFlags(force_tau=3.0).draft_hooks()


@pytest.mark.slow
def test_the_harness_serves_a_target_with_forced_acceptance(model_dir, tmp_path):
    """A real target process through the harness: it says which hooks are on, and random drafts
    are accepted at the forced rate over gRPC."""
    server = start_target(model_dir, tmp_path, hooks=HookFlags(force_tau=5.0))
    try:
        client = TargetClient(server.address)
        anchor = client.prefill("h", [1, 2, 3, 4]).next_token
        rng, accepted = random.Random(1), []
        for _ in range(20):
            v = client.verify("h", [anchor] + _random_drafts(rng, 16))
            accepted.append(v.accepted)
            anchor = v.committed_tokens[-1]
        assert set(accepted) == {4}                         # tau 5.0: exactly 4 every step
        assert "TEST/BENCHMARK HOOKS" in server.log() and "force_tau" in server.log()
    finally:
        server.stop()


@pytest.mark.parametrize("module", ["services.target.__main__", "services.draft.__main__",
                                    "gateway.__main__"])
def test_no_service_flag_reaches_the_hooks(module, capsys):
    """The hooks are constructor arguments only: no --help of a service mentions them."""
    mod = importlib.import_module(module)
    with pytest.raises(SystemExit):
        mod.parse_args(["--help"])
    text = capsys.readouterr().out.lower()
    for word in ("force", "tau", "random-weights", "warmup-delay", "mamba-commit",
                 "hybrid-wrapper"):
        assert word not in text
