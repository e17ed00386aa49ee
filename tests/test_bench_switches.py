"""Benchmark-only switches (runtime/bench_switches.py): forced acceptance reaches the target
engine only through its environment variable, is logged loudly, and makes the mean committed
tokens per verify step equal tau; no service flag can turn it on. Also the batched greedy
acceptance decided on the device."""
from __future__ import annotations

import logging
import random

import pytest
import torch
from support.inproc_target import loaded_worker, run, started_engine
from support.tiny_models import make_tiny

from runtime.bench_switches import FORCE_TAU_ENV, RANDOM_WEIGHTS_ENV, ForcedAcceptance
from runtime.sampling import SamplingConfig, greedy_accept_batch
from services.target.engine import PrefillCall


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny_switches"), "qwen3")


def _mean_committed(engine, blocks: int, block: int = 16) -> tuple[float, list[int]]:
    rng = random.Random(0)
    pre = run(engine.prefill(PrefillCall("s", [1, 2, 3, 4], SamplingConfig(), (), torch.bfloat16)))
    anchor, committed, out = pre.next_token, 0, []
    for _ in range(blocks):
        drafts = [rng.randrange(200) for _ in range(block - 1)]
        v = run(engine.verify("s", [anchor] + drafts))
        assert v.committed[: v.accepted] == drafts[: v.accepted]
        committed += len(v.committed)
        out.append(v.accepted)
        anchor = v.committed[-1]
    run(engine.release("s"))
    return committed / blocks, out


def test_forced_tau_sets_the_mean_committed_per_step(model_dir, monkeypatch, caplog):
    monkeypatch.setenv(FORCE_TAU_ENV, "3.5")
    with caplog.at_level(logging.WARNING, logger="dflash.bench"):
        engine = started_engine(loaded_worker(model_dir, kv_budget_bytes=32 << 20))
    try:
        assert any("BENCHMARK-ONLY" in r.message and FORCE_TAU_ENV in r.message
                   for r in caplog.records), "the forced acceptance must be logged loudly"
        mean, accepted = _mean_committed(engine, 120)
        assert abs(mean - 3.5) < 0.2
        assert set(accepted) == {2, 3}                      # floor(tau-1) or one more
        assert engine.stats.accepted_tokens == sum(accepted)
    finally:
        engine.stop()


def test_without_the_switch_random_drafts_are_rejected(model_dir, monkeypatch):
    monkeypatch.delenv(FORCE_TAU_ENV, raising=False)
    engine = started_engine(loaded_worker(model_dir, kv_budget_bytes=32 << 20))
    try:
        assert engine.forced is None
        mean, _ = _mean_committed(engine, 10)
        assert mean < 1.5
    finally:
        engine.stop()


def test_bad_tau_is_refused(monkeypatch):
    monkeypatch.setenv(FORCE_TAU_ENV, "0.5")
    from runtime.bench_switches import forced_tau
    with pytest.raises(ValueError, match=">= 1"):
        forced_tau()


def test_forced_acceptance_is_clamped_to_the_drafts():
    f = ForcedAcceptance(6.4)
    assert all(f.accepted(3) <= 3 for _ in range(50))
    assert {f.accepted(15) for _ in range(200)} == {5, 6}


@pytest.mark.parametrize("module", ["services.target.__main__", "services.draft.__main__",
                                    "gateway.__main__"])
def test_no_service_flag_reaches_the_switches(module, capsys):
    """The switches are environment-only: no --help of a service mentions them."""
    import importlib
    mod = importlib.import_module(module)
    with pytest.raises(SystemExit):
        mod.parse_args(["--help"])
    text = capsys.readouterr().out.lower()
    for word in ("force", "tau", "random-weights", RANDOM_WEIGHTS_ENV.lower()):
        assert word not in text


def sequential_greedy(drafts: list[int], argmax: list[int]) -> tuple[int, int]:
    """The rule written out: accept while the draft equals the target's argmax; the bonus is the
    argmax at the first mismatch (or after the last draft)."""
    a = 0
    while a < len(drafts) and drafts[a] == argmax[a]:
        a += 1
    return a, argmax[a]


def test_greedy_acceptance_batch_matches_the_sequential_rule():
    rng = random.Random(3)
    drafts, argmax, expect = [], [], []
    for _ in range(40):
        n = rng.randrange(0, 8)
        am = [rng.randrange(3) for _ in range(n + 1)]
        d = [rng.randrange(3) for _ in range(n)]
        drafts.append(d)
        argmax.append(am)
        expect.append(sequential_greedy(d, am))
    width = max(len(d) for d in drafts)
    dt = torch.full((len(drafts), width), -1, dtype=torch.int64)
    at = torch.zeros((len(drafts), width + 1), dtype=torch.int64)
    for i, (d, am) in enumerate(zip(drafts, argmax)):
        dt[i, : len(d)] = torch.tensor(d, dtype=torch.int64)
        at[i, : len(am)] = torch.tensor(am)
        at[i, len(am):] = am[-1]
    assert greedy_accept_batch(dt, at).tolist() == [list(e) for e in expect]
    assert any(a > 0 for a, _ in expect) and any(a < len(d) for (a, _), d in zip(expect, drafts))
