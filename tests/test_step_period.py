"""--speculation auto's step-period correction (gateway/step_period.py): a request's measured
step against the price of the batch decision it ran under, per kind of step and load, and the
decision it changes - the H200 case of SmolLM2 at 4 requests, where steps without drafts took
about twice their price and chains about their price, and auto kept choosing not to draft."""
from __future__ import annotations

import math

import pytest

from gateway.acceptance_model import CHAIN
from gateway.speculation_policy import NO_DRAFTING, Limits, Shape, SpeculationPolicy
from gateway.step_period import PERIOD_TRUST, StepPeriods, band


def test_nothing_measured_changes_nothing():
    p = StepPeriods()
    assert p.factor("none", 1) == p.factor("tree", 32) == 1.0


def test_a_kind_s_own_ratio_after_enough_periods_and_the_level_for_the_others():
    p = StepPeriods()
    for _ in range(PERIOD_TRUST - 1):
        p.observe("none", 4, 0.006, 0.003)
    assert p.factor("none", 4) == 1.0                    # not trusted yet
    p.observe("none", 5, 0.006, 0.003)                   # 4-7 requests: one band
    assert p.factor("none", 4) == pytest.approx(2.0)
    assert p.factor("chain", 6) == pytest.approx(2.0)    # unmeasured: the band's level ...
    assert p.factor("none", 8) == 1.0                    # ... of its own band only
    for _ in range(PERIOD_TRUST):
        p.observe("chain", 4, 0.019, 0.019)
    assert p.factor("chain", 4) == pytest.approx(1.0)
    assert p.factor("tree", 4) == pytest.approx(math.sqrt(2.0))   # the level of both


def test_a_first_run_is_outvoted_and_a_ratio_counts_at_most_8x():
    p = StepPeriods()
    p.observe("tree", 1, 0.100, 0.010)                   # a kernel's first run: 10x
    for _ in range(PERIOD_TRUST - 1):
        p.observe("tree", 1, 0.008, 0.010)
    assert p.factor("tree", 1) == pytest.approx(0.8)     # the median, not the first
    for _ in range(20):
        p.observe("chain", 1, 0.010, 0.010)
    p.observe("chain", 1, 5.0, 0.010)                    # a 500x stall
    assert p.factor("chain", 1) == pytest.approx(1.0)
    q = StepPeriods()
    for _ in range(PERIOD_TRUST):
        q.observe("tree", 2, 1.0, 0.001)
    assert q.factor("tree", 2) == pytest.approx(8.0)


def test_bands():
    assert [band(n) for n in (0, 1, 2, 3, 4, 7, 8, 31, 32, 500)] == [1, 1, 2, 2, 3, 3, 4, 5, 6, 7]


def _policy_at_four() -> tuple[SpeculationPolicy, dict, Limits]:
    """4 requests whose chains of 3 commit about 2.5 tokens a step; drafting promises too little at
    the model's prices for not drafting to lose."""
    policy = SpeculationPolicy([(1, 0.003), (4, 0.0032), (16, 0.0036), (64, 0.006)],
                               padded_blocks=(1, 4, 16))
    policy.cost.propose_s, policy.cost.overhead_s = 0.004, 0.0004
    models = {f"r{i}": policy.model() for i in range(4)}
    for m in models.values():
        for i in range(40):
            m.observe(CHAIN, 3, [0, 1, 2, 3][i % 4])
    return policy, models, Limits(max_chain=3, max_tree=0, tree_depth=3)


def _batch_shape(policy: SpeculationPolicy, models: dict, limits: Limits) -> Shape:
    shape = NO_DRAFTING
    for r, m in models.items():
        shape = policy.decide(r, m, limits, running=len(models))
    return shape


def test_steps_without_drafts_that_take_twice_their_price_make_chains_win():
    policy, models, limits = _policy_at_four()
    assert _batch_shape(policy, models, limits) == NO_DRAFTING
    priced = policy._priced[2]
    for _ in range(PERIOD_TRUST):                        # served: twice the price
        for r in models:
            policy.observe_period(r, NO_DRAFTING, 2 * priced)
    # chains, not measured yet, share the level: a slower host alone changes no choice
    assert _batch_shape(policy, models, limits) == NO_DRAFTING
    for _ in range(PERIOD_TRUST):                        # exploration times chains: as priced
        policy.periods.observe("chain", 4, 0.008, 0.008)
    assert policy.periods.factor("chain", 4) == pytest.approx(1.0)
    shape = NO_DRAFTING
    for _ in range(len(models)):                         # the next batch decision
        shape = _batch_shape(policy, models, limits)
    assert shape.drafts > 0 and not shape.tree
    chain_price = policy._priced[2]
    for _ in range(PERIOD_TRUST):                        # the chains it runs: as priced
        policy.observe_period("r0", shape, chain_price)
    assert policy._priced[0] == "chain" and policy.periods.factor("chain", 4) == pytest.approx(1.0)
    assert _batch_shape(policy, models, limits).drafts > 0     # and they stay


def test_a_period_of_another_kind_than_the_decision_s_is_not_counted():
    policy, models, limits = _policy_at_four()
    _batch_shape(policy, models, limits)                 # decided: no drafts
    for _ in range(PERIOD_TRUST):
        policy.observe_period("r0", Shape(3), 1.0)       # a request that ran a chain anyway
    assert policy.periods.factors(4) == {"none": 1.0, "chain": 1.0, "tree": 1.0}


def test_a_period_counts_against_the_decision_its_request_ran_under():
    """At many requests the next batch decision is taken while a request's step still runs:
    its period is compared with the price of the decision it ran under, not the newest."""
    policy, models, limits = _policy_at_four()
    _batch_shape(policy, models, limits)                 # every request: no drafts
    priced = policy._priced[2]
    policy._priced = ("chain", 4, 1.0)                   # a later decision (while they ran)
    for r in models:
        policy.observe_period(r, NO_DRAFTING, 3 * priced)
    assert policy.periods.factor("none", 4) == pytest.approx(3.0)
    policy.forget("r0")
    policy.observe_period("r0", NO_DRAFTING, 100 * priced)    # gone: nothing to compare with
    assert policy.periods.factor("none", 4) == pytest.approx(3.0)
