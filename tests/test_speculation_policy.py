"""--speculation auto's decision as a pure function of the cost and acceptance models
(gateway/speculation_policy.py, gateway/cost_model.py, gateway/acceptance_model.py), with
synthetic models: cheap verifies make longer blocks win, expensive verifies or low acceptance
shorter ones, load makes no drafting win; the models learn from observations."""
from __future__ import annotations

import itertools

import pytest

from gateway.acceptance_model import CHAIN, AcceptanceModel, ServiceAcceptance
from gateway.config import GatewayConfig
from gateway.cost_model import CostModel, monotone_fit
from gateway.speculation_policy import (
    NO_DRAFTING,
    Limits,
    Option,
    Shape,
    SpeculationPolicy,
    choose,
)


def flat_then_linear(knee: int, base: float, per_token: float) -> list[tuple[int, float]]:
    """A GPU-like curve: constant up to `knee` tokens, then linear."""
    return [(t, base + per_token * max(0, t - knee)) for t in (1, 2, 4, 8, 16, 32, 64, 128, 256)]


def chain_options(p: float, max_drafts: int = 15) -> list[Option]:
    """Chains with a constant conditional acceptance p."""
    out = [Option(NO_DRAFTING, 1.0)]
    for k in range(1, max_drafts + 1):
        out.append(Option(Shape(k), 1.0 + sum(p ** j for j in range(1, k + 1))))
    return out


def seed_timed(c: CostModel, seeds: list[tuple[int, float]]) -> None:
    """The draft's warm-up curve, and one Propose alone and one beside other requests timed by
    serving on it (prices that are serving's own: no exploration of an untimed price)."""
    c.seed_proposes(seeds)
    rows, seconds = seeds[0]
    for busy in (False, True):
        c.observe_propose(seconds, rows, forward_s=seconds, busy=busy)


def cost(curve, propose=0.0, overhead=0.0) -> CostModel:
    c = CostModel(curve)
    c.propose_s, c.overhead_s = propose, overhead
    return c


def test_cheap_verify_and_high_acceptance_choose_a_long_block():
    best = choose(chain_options(0.9), cost(flat_then_linear(32, 0.010, 0.0003), propose=0.001))
    assert best.shape.drafts == 15


def test_expensive_verify_chooses_a_shorter_block():
    cheap = choose(chain_options(0.8), cost(flat_then_linear(32, 0.010, 0.0003), propose=0.001))
    costly = choose(chain_options(0.8), cost([(1, 0.010), (16, 0.080)], propose=0.001))
    assert 0 < costly.shape.drafts < cheap.shape.drafts


def test_low_acceptance_chooses_a_shorter_block_or_none():
    c = cost([(1, 0.010), (16, 0.030)], propose=0.003)
    high = choose(chain_options(0.85), c)
    low = choose(chain_options(0.3), c)
    none = choose(chain_options(0.02), c)
    assert high.shape.drafts > low.shape.drafts
    assert none.shape == NO_DRAFTING


def test_load_makes_no_drafting_win():
    """Compute-bound verifies (linear in tokens) for a batch of 32: drafts cost the whole batch
    more than they bring, where one request alone gains from them."""
    c = cost([(1, 0.02), (32, 0.08), (512, 1.0)], propose=0.004)
    alone = choose(chain_options(0.5), c)
    batch = [Option(o.shape, 32 * o.expected, 32 * o.shape.tokens) for o in chain_options(0.5)]
    assert alone.shape.drafts > 0
    assert choose(batch, c).shape == NO_DRAFTING


def test_a_tree_wins_when_its_acceptance_pays_for_its_tokens():
    c = cost(flat_then_linear(64, 0.010, 0.0003), propose=0.001)
    tree = Option(Shape(15, tree=True), 4.5)
    assert choose(chain_options(0.6) + [tree], c).shape == Shape(15, True)
    c_cpu = cost([(1, 0.010), (16, 0.040), (64, 0.16)], propose=0.001)
    assert not choose(chain_options(0.6) + [tree], c_cpu).shape.tree


def test_ties_prefer_fewer_drafts():
    c = cost([(1, 0.010), (64, 0.010)])
    assert choose([Option(Shape(3), 1.0), Option(NO_DRAFTING, 1.0)], c).shape == NO_DRAFTING


def test_cost_model_fits_a_non_decreasing_curve_and_extrapolates():
    c = CostModel([(1, 0.060), (2, 0.040), (4, 0.050), (8, 0.060)])
    ys = [c.verify_s(t) for t in (1, 2, 3, 4, 8)]
    assert ys == sorted(ys)                      # the noisy first point is pooled
    assert c.verify_s(16) > c.verify_s(8) > 0     # past the last point: still growing
    assert monotone_fit([(1, 3.0, 1.0), (2, 1.0, 1.0)]) == [(1, 2.0), (2, 2.0)]


def test_cost_model_follows_observed_forwards():
    c = CostModel([(1, 0.010), (16, 0.020)])
    for _ in range(60):
        c.observe_verify(16, 0.040, 0.045)
        c.observe_propose(0.003)
    assert c.verify_s(16) == pytest.approx(0.040, rel=0.05)
    assert c.overhead_s == pytest.approx(0.005, rel=0.05)
    assert c.propose_s == pytest.approx(0.003)
    assert not CostModel().known and CostModel().verify_s(8) == 0.0


def test_acceptance_model_counts_by_depth_and_blends_the_service():
    service = ServiceAcceptance()
    a = AcceptanceModel(service)
    assert a.p(CHAIN, 1) == pytest.approx(0.8)   # the optimistic prior
    for _ in range(50):
        a.observe(CHAIN, 4, 1)                   # the first draft accepted, the second refused
    assert a.p(CHAIN, 1) > 0.95 and a.p(CHAIN, 2) < 0.1
    assert a.p(CHAIN, 3) == pytest.approx(0.8, abs=0.05)   # never tried: the prior
    assert a.expected(CHAIN, 4) < 2.2
    b = AcceptanceModel(service)                 # a new request starts from the service's counts
    assert b.p(CHAIN, 2) < 0.3
    a.observe(15, 5, 5)
    assert a.tree_depth(15, 3) == 5 and a.tree_depth(63, 7) == 7


def test_policy_learns_low_acceptance_and_stops_drafting():
    policy = SpeculationPolicy([(1, 0.010), (16, 0.030), (64, 0.10)])
    policy.cost.propose_s = 0.005
    a = policy.model()
    limits = Limits(max_chain=15, max_tree=63, tree_depth=15)
    first = policy.decide("r", a, limits)
    assert first.drafts > 0                      # optimistic at first
    for _ in range(200):
        shape = policy.decide("r", a, limits)
        if shape.drafts:
            depth = shape.drafts if not shape.tree else min(shape.drafts, 15)
            policy.observe(a, shape, depth, 0)   # nothing is ever accepted
    assert policy.decide("r", a, limits) == NO_DRAFTING


def test_policy_counts_the_other_running_requests():
    policy = SpeculationPolicy([(1, 0.02), (32, 0.08), (512, 1.0)])
    policy.cost.propose_s = 0.004
    limits = Limits(max_chain=3, max_tree=0, tree_depth=3)
    models = {f"r{i}": policy.model() for i in range(32)}
    for r, m in models.items():
        for i in range(30):
            m.observe(CHAIN, 3, i % 2)         # half the first drafts accepted, no second
    alone = policy.decide("r0", models["r0"], limits)
    for r, m in models.items():
        policy.decide(r, m, limits)
    loaded = policy.decide("r0", models["r0"], limits)
    assert alone.drafts > 0 and loaded == NO_DRAFTING
    for r in models:
        policy.forget(r)
    assert policy.decide("r0", models["r0"], limits).drafts > 0


@pytest.mark.parametrize("value", ["auto", "fixed", "1", "4"])
def test_speculation_flag_values(value):
    GatewayConfig(target="t:1", tokenizer_dir="x", speculation=value)


@pytest.mark.parametrize("value", ["", "0", "-3", "tree", "Auto", "4.5"])
def test_speculation_flag_refuses_other_values(value):
    with pytest.raises(ValueError, match="--speculation .*allowed auto"):
        GatewayConfig(target="t:1", tokenizer_dir="x", speculation=value)


def test_fixed_flags_override_auto():
    assert GatewayConfig(target="t:1", tokenizer_dir="x").auto_speculation
    assert not GatewayConfig(target="t:1", tokenizer_dir="x", block_size=4).auto_speculation
    assert not GatewayConfig(target="t:1", tokenizer_dir="x", spec_tree_nodes=15).auto_speculation
    assert not GatewayConfig(target="t:1", tokenizer_dir="x", speculation="6").auto_speculation
    assert GatewayConfig(target="t:1", tokenizer_dir="x", speculation="6").fixed_block == 6


def test_sizes_serving_never_runs_follow_the_observed_scale():
    """A calibration slowed twice over by a busy start-up: serving observes one size at its true
    time, and the sizes it never runs come down with it (the curve's shape is kept)."""
    c = CostModel([(1, 0.080), (4, 0.100), (16, 0.160)])
    for _ in range(200):
        c.observe_verify(4, 0.050, 0.052)
    assert c.verify_s(4) == pytest.approx(0.050, rel=0.02)
    assert c.verify_s(1) == pytest.approx(0.040, rel=0.1)
    assert c.verify_s(16) == pytest.approx(0.080, rel=0.1)


def test_sizes_serving_never_runs_do_not_drift_when_the_fit_pools_observed_sizes():
    """At 16-32 requests without drafts serving times only rows 16-32, and two neighbouring
    sizes whose times violate the curve's order are pooled by the fit: every observation was
    off the fit by the same few percent, the unobserved sizes were nudged by each, and after
    thousands of steps an H100 run priced a chain step (512 rows, never run) at minutes."""
    c = CostModel([(1, 0.00136), (16, 0.00139), (31, 0.00141), (32, 0.00143), (64, 0.00159),
                   (256, 0.00188), (512, 0.00244)])
    for _ in range(5000):
        for _ in range(9):
            c.observe_verify(32, 0.0013, 0.0015)
        c.observe_verify(31, 0.0016, 0.0018)
    assert c.verify_s(512) == pytest.approx(0.00244 * 0.0013 / 0.00143, rel=0.2)
    assert c.verify_s(256) < c.verify_s(512) < 0.004


def test_requests_that_have_not_chosen_yet_count_as_load():
    """Just-admitted requests are in the batch too, with the service's acceptance."""
    policy = SpeculationPolicy([(1, 0.02), (32, 0.08), (512, 1.0)])
    policy.cost.propose_s = 0.004
    m = policy.model()
    for i in range(30):
        m.observe(CHAIN, 3, i % 2)
    limits = Limits(max_chain=3, max_tree=0, tree_depth=3)
    assert policy.decide("r0", m, limits, running=1).drafts > 0
    assert policy.decide("r0", m, limits, running=32) == NO_DRAFTING


def test_trees_have_their_own_cost_curve():
    """On a GPU a tree size without a CUDA graph runs eagerly: its curve, not the chains', says
    what a tree costs, and an expensive tree loses to the chain of the same tokens."""
    chains = flat_then_linear(64, 0.010, 0.0003)
    tree = Option(Shape(7, tree=True), 3.0)
    chain = Option(Shape(7), 2.9)
    cheap = CostModel(chains, [(8, 0.010), (16, 0.010), (64, 0.012)])
    eager = CostModel(chains, [(8, 0.060), (16, 0.010), (64, 0.012)])
    assert choose([Option(NO_DRAFTING, 1.0), chain, tree], cheap).shape.tree
    assert choose([Option(NO_DRAFTING, 1.0), chain, tree], eager).shape == Shape(7)
    assert CostModel(chains).verify_s(8, tree=True) == CostModel(chains).verify_s(8)
    eager.observe_verify(8, 0.055, 0.06, tree=True)
    assert eager.verify_s(8) == pytest.approx(0.010)            # chains untouched


def test_the_batch_runs_one_shape_fitted_to_each_request():
    """A GPU loses its CUDA graphs on a batch of mixed shapes: every running request gets the
    batch's shape, cut to what it may run (a request near its end: a shorter chain)."""
    policy = SpeculationPolicy(flat_then_linear(64, 0.010, 0.0003))
    policy.cost.propose_s = 0.001
    sure, unsure = policy.model(), policy.model()
    for _ in range(50):
        sure.observe(CHAIN, 7, 7)
        unsure.observe(CHAIN, 7, 1)
    wide = Limits(max_chain=7, max_tree=0, tree_depth=7)
    short = Limits(max_chain=2, max_tree=0, tree_depth=2)
    a = policy.decide("sure", sure, wide, running=3)
    b = policy.decide("unsure", unsure, wide, running=3)
    c = policy.decide("end", policy.model(), short, running=3)
    assert a == b and a.drafts > 2 and c == Shape(2)


def test_fit_cuts_a_shape_to_a_request_s_limits():
    from gateway.speculation_policy import fit
    limits = Limits(max_chain=3, max_tree=7, tree_depth=3)
    assert fit(Shape(8), limits) == Shape(3) and fit(Shape(2), limits) == Shape(2)
    assert fit(Shape(7, True), limits) == Shape(7, True)
    assert fit(Shape(15, True), limits) == Shape(3)            # no room for the tree: a chain


def test_a_loaded_batch_of_sure_requests_still_drafts():
    """One Propose serves the whole batch: 32 requests whose drafts are nearly always accepted
    keep drafting on a GPU-like curve, where 32 of low acceptance stop."""
    curve = flat_then_linear(128, 0.010, 0.0002)
    for accepted, drafts in ((3, True), (0, False)):
        policy = SpeculationPolicy(curve)
        policy.cost.propose_s = 0.003
        limits = Limits(max_chain=3, max_tree=0, tree_depth=3)
        models = {f"r{i}": policy.model() for i in range(32)}
        for m in models.values():
            for _ in range(40):
                m.observe(CHAIN, 3, accepted)
        shapes = [policy.decide(r, m, limits, running=32) for r, m in models.items()]
        assert len(set(shapes)) == 1 and (shapes[0].drafts > 0) == drafts


def test_overhead_excludes_the_wait_in_the_target_queue():
    """A Verify's round trip = its wait behind other batches + its forward + the overhead; the
    wait is the others' load (the batch model counts it), not this step's overhead."""
    c = CostModel([(1, 0.010), (16, 0.020)])
    c.observe_verify(4, 0.012, wall_s=0.050, queue_s=0.030)
    assert c.overhead_s == pytest.approx(0.008)
    c.observe_verify(4, 0.012, wall_s=0.020)
    assert c.overhead_s == pytest.approx(0.008 + 0.1 * (0.008 - 0.008))


def test_padded_chains_cost_their_padded_rows():
    """A GPU target pads a batch of chains to a captured block (verify_padded_blocks): a chain
    of 4 tokens costs the rows of 16, so with a curve that grows per row the policy takes the
    longest chain the padding pays for, where without padding a shorter one wins."""
    c = CostModel([(1, 0.010), (16, 0.016), (64, 0.040)], padded_blocks=(1, 16))
    assert c.chain_rows([4, 4]) == 32 and c.chain_rows([1, 1]) == 2
    assert c.chain_rows([17]) == 17 and CostModel().chain_rows([4, 3]) == 7
    curve = [(1, 0.010), (4, 0.013), (8, 0.017), (16, 0.025), (64, 0.080)]
    limits = Limits(max_chain=15, max_tree=0, tree_depth=15)
    shapes = {}
    for padded in ((), (1, 16)):
        policy = SpeculationPolicy(curve, padded_blocks=padded)
        m = policy.model()
        for _ in range(100):
            m.observe(CHAIN, 15, 3)                 # 3 of 15 accepted: the first drafts are good
        shapes[padded] = policy.decide("r", m, limits)
    assert 0 < shapes[()].drafts < 15 and shapes[(1, 16)] == Shape(15)


def test_one_slow_propose_does_not_stop_drafting():
    """The first Propose of a shape may run a kernel for the first time: the propose estimate
    is a median, so one 200 ms outlier among 2 ms ones leaves it near 2 ms."""
    c = CostModel([(1, 0.002), (16, 0.003)])
    c.observe_propose(0.200)
    assert c.propose_s == pytest.approx(0.200)
    for _ in range(4):
        c.observe_propose(0.002)
    assert c.propose_s == pytest.approx(0.002)


def test_the_draft_s_warm_up_curve_prices_proposes_until_serving_times_them():
    """DraftCapabilities.propose_cost seeds the Propose line: a steady Propose is priced at
    the warm-up's engine time from the start (not at the first Propose serving happens to
    time, which carries the prompt or a backlog), trees on their own line; serving's own
    Proposes then take over the window, and a second seed (a draft restart's capabilities
    refetched) does not overwrite them."""
    c = CostModel([(1, 0.002), (16, 0.003)])
    c.seed_proposes([(1, 0.020), (4, 0.022), (16, 0.030)], [(1, 0.030), (4, 0.033)])
    assert c.propose_cost(1) == pytest.approx(0.020, rel=0.05)
    assert c.propose_cost(16) == pytest.approx(0.030, rel=0.05)
    assert c.propose_cost(1, tree=True) == pytest.approx(0.030, rel=0.05)
    for _ in range(40):
        c.observe_propose(0.010, 2)
    assert c.propose_cost(2) == pytest.approx(0.010)
    c.seed_proposes([(1, 0.5)])
    assert c.propose_cost(2) == pytest.approx(0.010)


def test_tree_costs_are_read_as_measured_and_grow_with_rows_past_them():
    """The H200's warm-up: a tree of 7 drafts has no CUDA graph (24 ms), trees of 15 and 63
    have (1.5-1.7 ms). Trees are not forced into a non-decreasing curve (that pooled all three
    at 9 ms: trees of 63 looked dear and trees of 7 cheap), and a batch of 32 trees costs the
    one measured tree plus what its further rows cost chains (it looked free)."""
    chains = [(1, 0.0013), (16, 0.0014), (64, 0.003), (512, 0.015)]
    c = CostModel(chains, [(8, 0.0238), (16, 0.0015), (64, 0.0017)])
    assert c.verify_s(8, tree=True) == pytest.approx(0.0238)
    assert c.verify_s(64, tree=True) == pytest.approx(0.0017)
    assert c.verify_s(32 * 64, tree=True) == pytest.approx(
        0.0017 + c.verify_s(32 * 64) - c.verify_s(64))
    assert c.verify_s(32 * 64, tree=True) > 0.015



def test_a_batch_of_trees_costs_its_tree_size_not_its_rows():
    """The H200 of session 37: two trees of 7 drafts (16 rows) were priced at the tree of 15's
    graph (1.6 ms) and ran eagerly at 22.8 ms a step - auto at 2 requests fell to 0.45x not
    drafting. A batch of trees is its size's point plus the further rows at chain rates; a tree
    size dearer than twice a bigger one (no CUDA graph) is never chosen; and only a tree that ran
    alone teaches the tree curve (a batch's rows would land on another size's point)."""
    chains = [(1, 0.0013), (16, 0.0014), (64, 0.003), (512, 0.015)]
    c = CostModel(chains, [(8, 0.0228), (16, 0.0016), (64, 0.0018)])
    assert c.verify_s(16, tree=True, unit=8) == pytest.approx(0.0228 + c.verify_s(16)
                                                              - c.verify_s(8))
    assert c.verify_s(128, tree=True, unit=64) == pytest.approx(0.0018 + c.verify_s(128)
                                                                - c.verify_s(64))
    assert c.tree_dominated(7) and not c.tree_dominated(15) and not c.tree_dominated(63)
    c.observe_verify(16, 0.0228, 0.024, tree=True, unit=8)        # two trees of 7
    assert c.verify_s(16, tree=True) == pytest.approx(0.0016)
    c.observe_verify(16, 0.0017, 0.002, tree=True, unit=16)       # one tree of 15
    assert c.verify_s(16, tree=True) > 0.0016
    policy = SpeculationPolicy(chains, [(8, 0.0228), (16, 0.0016), (64, 0.0018)])
    policy.cost.propose_s = 0.0005
    limits = Limits(max_chain=15, max_tree=63, tree_depth=15)
    models = [policy.model() for _ in range(2)]
    shapes = {policy.decide(f"r{i}", m, limits, running=2) for _ in range(20)
              for i, m in enumerate(models)}
    assert Shape(7, tree=True) not in shapes
    cpu = CostModel(chains, [(8, 0.010), (16, 0.018), (64, 0.060)])  # trees grow with size
    assert not any(cpu.tree_dominated(n) for n in (7, 15, 63))

def _simulate(policy: SpeculationPolicy, steps: int) -> list[Shape]:
    """Two requests whose drafts are mostly accepted, on a GPU-like target whose true verify
    time grows slowly with rows; the policy learns from what each step it chose would cost."""
    def truth(rows: int) -> float:
        return 0.0013 + 0.00002 * rows
    limits = Limits(max_chain=15, max_tree=0, tree_depth=15)
    models = {r: policy.model() for r in ("a", "b")}
    for m in models.values():
        for _ in range(40):
            m.observe(CHAIN, 15, 6)
    chosen = []
    for _ in range(steps):
        shapes = [policy.decide(r, m, limits, running=2) for r, m in models.items()]
        rows = policy.cost.chain_rows([s.tokens for s in shapes])
        policy.cost.observe_verify(rows, truth(rows), truth(rows) + 0.0005)
        if shapes[0].drafts:
            policy.cost.observe_propose(0.001)
        for r, shape in zip(models, shapes):    # each request's step period
            policy.observe_period(r, shape, truth(rows) + 0.0005 + 0.001 * (shape.drafts > 0))
        chosen.append(shapes[0])
    return chosen


def test_exploration_corrects_a_warm_up_point_that_was_too_dear(monkeypatch):
    """The H200's warm-up put 15 ms on every batch of 2+ sequences (the shapes' first runs)
    where they take about 2 ms: with nothing drafting, nothing corrected it. Once every
    EXPLORE_EVERY batch decisions the runner-up of other rows runs; its true cost replaces the
    warm-up's, and the batch drafts from then on (and, the runner-up now not drafting, whose
    rows serving has timed often, explores no more). Without exploration it never does."""
    import gateway.speculation_policy as sp
    calibrated = [(1, 0.0013), (2, 0.0013), (16, 0.0014), (24, 0.020), (32, 0.015), (64, 0.016)]
    learned = _simulate(SpeculationPolicy(calibrated, padded_blocks=(1, 16)), 3 * sp.EXPLORE_EVERY)
    assert learned[0] == NO_DRAFTING
    assert all(s.drafts >= 8 for s in learned[-2 * sp.EXPLORE_EVERY:])
    monkeypatch.setattr(sp, "EXPLORE_EVERY", 10 ** 9)
    stuck = _simulate(SpeculationPolicy(calibrated, padded_blocks=(1, 16)), 3 * 32)
    assert all(s == NO_DRAFTING for s in stuck)


def test_exploration_stops_once_the_runner_up_was_timed_often_enough():
    """On a CPU where not drafting wins, the runner-up (a chain) runs once every EXPLORE_EVERY
    decisions only until serving has timed its rows EXPLORE_RUNS times; then auto stays with
    the best option (exploring a price it knows cost 3 % of the autoregressive speed)."""
    import gateway.speculation_policy as sp
    policy = SpeculationPolicy([(1, 0.010), (2, 0.019), (4, 0.038), (8, 0.075)])
    m = policy.model()
    for _ in range(40):
        m.observe(CHAIN, 3, 0)
    limits = Limits(max_chain=3, max_tree=0, tree_depth=3)
    chosen = []
    for _ in range(10 * sp.EXPLORE_EVERY):
        shape = policy.decide("a", m, limits)
        policy.cost.observe_verify(shape.tokens, 0.0095 * shape.tokens, 0.0095 * shape.tokens)
        if shape.drafts:
            policy.cost.observe_propose(0.002)
        policy.observe_period("a", shape, 0.0095 * shape.tokens + 0.002 * (shape.drafts > 0))
        chosen.append(shape)
    explored = [i for i, s in enumerate(chosen) if s != NO_DRAFTING]
    assert len(explored) == sp.EXPLORE_RUNS
    assert all((i + 1) % sp.EXPLORE_EVERY == 0 for i in explored)


def test_robust_line_recovers_a_line_through_outliers():
    from gateway.propose_line import robust_line
    points = [(x, 0.008 + 0.001 * x) for x in (1, 2, 3, 5, 8, 30, 40)] + [(2, 0.200)]
    intercept, slope = robust_line(points)
    assert intercept == pytest.approx(0.008, abs=1e-4) and slope == pytest.approx(0.001, rel=0.01)
    assert robust_line([(0, 0.004), (0, 0.002), (0, 0.3)]) == (0.004, 0.0)
    assert robust_line([(1, 0.01), (9, 0.002)])[1] == 0.0         # never a negative slope


def test_proposes_are_priced_by_the_rows_a_steady_step_appends():
    """The EPYC at one request: not drafting verifies 1 token in 26 ms; a chain of 2 drafts
    verifies 3 in 28 ms, and its Propose appends what the last step committed (about 2 rows)
    in 8 ms + 1 ms a row. Auto had timed only Proposes after stretches without drafting (30-40
    rows of backlog, 40-50 ms each) and priced every Propose so: chains never won. Priced by
    rows appended, the chain of 2 wins, as measured (32.6 against 30.5 tokens/s)."""
    c = cost([(1, 0.026), (3, 0.028), (5, 0.030)])
    for appended in (30, 35, 40, 32):
        c.observe_propose(0.008 + 0.001 * appended, appended)
    c.observe_propose(0.011, 3)                       # the first exploration of a chain
    options = [Option(NO_DRAFTING, 1.0), Option(Shape(2), 2.0), Option(Shape(4), 2.05)]
    assert choose(options, c).shape == Shape(2)
    assert c.propose_cost(2) == pytest.approx(0.010, abs=1e-3)
    as_before = cost([(1, 0.026), (3, 0.028), (5, 0.030)], propose=0.040)   # the median
    assert choose(options, as_before).shape == NO_DRAFTING


def test_tree_proposes_do_not_price_chains():
    """The first steps draft trees under the optimistic prior; their Proposes (ranking each
    position's likeliest tokens) must not make every chain Propose look as dear."""
    c = cost([(1, 0.026), (8, 0.030)])
    for _ in range(5):
        c.observe_propose(0.040, 2, tree=True)
    assert c.propose_cost(2) == 0.0 and c.propose_cost(2, tree=True) == pytest.approx(0.040)
    c.observe_propose(0.012, 2)
    assert c.propose_cost(2) == pytest.approx(0.012)


def test_a_batch_s_proposes_are_priced_as_one_draft_forward_of_all_their_rows():
    """The EPYC at 8 requests: the draft batches the 8 Proposes into one forward, whose time
    grows with every sequence's appended rows and block (8 ms + 1 ms a row here). Priced per
    request (one request's rows), drafting looked cheap at 8 and auto drafted 1-token chains,
    22 % below not drafting; priced by the batch's rows it drafts at 1 request only."""
    verify = [(n, 0.020 + 0.005 * n) for n in (1, 2, 3, 8, 16, 24)]
    chosen = {}
    for running in (1, 8):
        policy = SpeculationPolicy(verify)
        seed_timed(policy.cost, [(rows, 0.008 + 0.001 * rows) for rows in (4, 16, 32)])
        limits = Limits(max_chain=2, max_tree=0, tree_depth=2)
        models = [policy.model() for _ in range(running)]
        for m in models:
            for _ in range(40):
                m.observe(CHAIN, 2, 1)              # the first draft accepted, the second not
        chosen[running] = [policy.decide(str(i), m, limits, running)
                           for i, m in enumerate(models)][-1]
    assert chosen[1] == Shape(1) and chosen[8] == NO_DRAFTING


def test_a_propose_s_round_trip_beyond_its_forward_is_its_overhead():
    """With the draft's report of its forward, the line holds forward times by batch rows and
    the rest of the round trip (the wire, the queue) is priced once on top."""
    c = CostModel([(1, 0.010)])
    for rows in (4, 8, 16, 32):
        c.observe_propose(0.003 + 0.008 + 0.001 * rows, rows, forward_s=0.008 + 0.001 * rows)
    assert c.propose_overhead_s == pytest.approx(0.003, rel=0.01)
    assert c.propose_cost(10) == pytest.approx(0.003 + 0.018, rel=0.01)


def test_a_propose_s_wait_behind_other_proposes_is_not_its_overhead():
    """An H200 at 32 requests: each first Propose waited behind the others' forwards (20 ms
    round trips around 2-9 ms forwards). The wait is the other forwards' cost, which a batch's
    rows price already; counted as overhead too, it priced drafting at three times a step
    without drafts. The draft reports the wait (ProposeResponse.queue_seconds)."""
    c = CostModel([(1, 0.010)])
    for _ in range(5):
        c.observe_propose(0.0205, 559, forward_s=0.0032, busy=True, queue_s=0.0160)
    assert c.propose_overhead_s == pytest.approx(0.0013)
    without = CostModel([(1, 0.010)])
    for _ in range(5):
        without.observe_propose(0.0205, 559, forward_s=0.0032, busy=True)
    assert without.propose_overhead_s == pytest.approx(0.0173)


def test_one_slow_first_propose_does_not_price_its_overhead_into_every_step():
    """The EPYC, structured output at one request: the process's first Propose took 97 ms for
    a 19 ms forward (first use of the stream and the plane). Taken whole, that 78 ms priced
    every chain 2-4x its cost, auto never drafted again and so never timed a Propose to learn
    better. The overhead is a median, the Verify's overhead standing in for Proposes not yet
    timed; two Proposes that agree carry it."""
    c = CostModel([(1, 0.010)])
    c.observe_verify(1, 0.010, 0.012)                   # the wire: 2 ms beyond the forward
    assert c.propose_overhead_s == pytest.approx(0.002)
    c.observe_propose(0.097, 49, forward_s=0.019)       # the cold first one
    assert c.propose_overhead_s == pytest.approx(0.002)
    c.observe_propose(0.014, 9, forward_s=0.011)
    assert c.propose_overhead_s == pytest.approx(0.003)
    for _ in range(3):                                  # a draft that really is far away
        c.observe_propose(0.060, 9, forward_s=0.010)
    assert c.propose_overhead_s == pytest.approx(0.050)


def test_an_untimed_kind_of_propose_takes_the_level_serving_found_for_its_sibling():
    """The EPYC at one request: the draft's warm-up (beside the target's calibration) put a
    Propose at about 3x what serving's tree Proposes alone took (scale 0.36). Chains alone,
    never timed, stayed at the warm-up's level - a chain of 2 priced at 70 ms a step where a
    step without drafts took 31 - so auto never ran one, though chains of 2 won by 13 %. A
    line serving has not timed borrows its sibling's scale (same warm-up, same regime); busy
    lines are a regime of their own and lend nothing to alone's."""
    c = CostModel([(1, 0.030)])
    c.seed_proposes([(2, 0.036), (8, 0.040), (16, 0.046)], [(2, 0.039), (8, 0.042)])
    assert c.propose_cost(3) == pytest.approx(0.0365, rel=0.02)         # the warm-up's level
    for _ in range(3):
        c.observe_propose(0.0145, 8, tree=True, forward_s=0.0144)      # 0.34x the seeds
    scale = c.tree_proposes.seed_scale
    assert scale == pytest.approx(0.0144 / 0.042, rel=0.03)
    assert c.chain_proposes.seed_scale == pytest.approx(scale)
    assert c.propose_cost(3) == pytest.approx(c.propose_overhead_s + 0.0365 * scale, rel=0.05)
    assert c.busy_proposes[False].seed_scale == 1.0                     # busy: untouched
    from gateway.propose_line import SCALE_TRUST
    c.observe_propose(0.020, 3, forward_s=0.019)        # its own: dearer than the borrowed
    assert c.chain_proposes.seed_scale == pytest.approx(scale)          # level: not yet ...
    for _ in range(SCALE_TRUST - 1):
        c.observe_propose(0.020, 3, forward_s=0.019)
    assert c.chain_proposes.seed_scale == pytest.approx(0.019 / 0.0365, rel=0.03)   # ... now


def test_drafting_must_promise_a_margin_over_not_drafting():
    """A near-tie goes to not drafting (DRAFT_MARGIN): on the EPYC at 2-8 requests the options
    were within a few % of each other, and the drafts auto then ran cost 18-23 %."""
    import gateway.speculation_policy as sp
    c = cost([(1, 0.026), (3, 0.040)])
    near = [Option(NO_DRAFTING, 1.0), Option(Shape(2), 1.0 / 0.026 * 0.040 * 1.04)]
    assert choose(near, c).shape == NO_DRAFTING              # 4 % better: not enough
    clear = [Option(NO_DRAFTING, 1.0), Option(Shape(2), 1.0 / 0.026 * 0.040 * 1.2)]
    assert choose(clear, c).shape == Shape(2)                # 20 % better: drafts
    assert sp.DRAFT_MARGIN == pytest.approx(0.1)


def test_a_draft_context_backlog_is_priced_and_its_catch_up_spread_over_later_steps():
    """After steps that did not draft, the next Propose appends their positions: with a CPU-like
    Propose line (per row) a large backlog makes drafting not pay for a request about to end,
    while one with many tokens left pays the catch-up over CATCH_UP_STEPS steps and drafts;
    in steady state (a backlog of about one step's tokens) it drafts as before."""
    curve = [(1, 0.020), (2, 0.022), (4, 0.026), (8, 0.034), (16, 0.050)]
    limits = {"max_chain": 3, "max_tree": 0, "tree_depth": 3}

    def decide(**extra) -> Shape:
        policy = SpeculationPolicy(curve)
        seed_timed(policy.cost, [(1, 0.004), (64, 0.004 + 63 * 0.0004)])
        m = policy.model()
        for _ in range(50):
            m.observe(CHAIN, 3, 2)                  # 2 of 3 accepted
        return policy.decide("r", m, Limits(**limits, **extra))

    assert decide().drafts > 0
    assert decide(backlog=2, remaining=100).drafts > 0
    assert decide(backlog=120, remaining=3) == NO_DRAFTING
    assert decide(backlog=120, remaining=400).drafts > 0
    assert decide(backlog=1000, remaining=4000) == NO_DRAFTING


def test_exploration_costs_at_most_its_share_of_serving_time():
    """A CPU at 8 requests: steps take 120 ms, an exploring one (every request drafts) 300 ms.
    The first exploration comes at EXPLORE_EVERY decisions as before; its 180 ms excess then
    holds the next one back until it is within 2 % of the serving time seen (not 32 steps
    later but about 75); idle gaps between requests count as neither."""
    import gateway.speculation_policy as sp
    from gateway.exploration import EXPLORE_SHARE, ExplorationBudget
    now = [0.0]
    policy = SpeculationPolicy([(1, 0.010), (2, 0.019), (4, 0.038), (8, 0.075)])
    policy.budget = ExplorationBudget(clock=lambda: now[0])
    m = policy.model()
    for _ in range(40):
        m.observe(CHAIN, 3, 0)
    limits = Limits(max_chain=3, max_tree=0, tree_depth=3)
    explored = []
    for i in range(8 * sp.EXPLORE_EVERY):
        shape = policy.decide("a", m, limits)
        if shape.drafts:
            explored.append(i)
        now[0] += 0.300 if shape.drafts else 0.120
        if i == 100:
            now[0] += 60.0                              # nobody ran for a minute
    assert explored[0] == sp.EXPLORE_EVERY - 1
    gaps = [b - a for a, b in itertools.pairwise(explored)]
    assert gaps and all(g >= 2 * sp.EXPLORE_EVERY for g in gaps)
    budget = policy.budget
    assert budget.spent <= EXPLORE_SHARE * budget.elapsed + 0.180
    assert budget.elapsed < 8 * sp.EXPLORE_EVERY * 0.300


def test_the_draft_s_warm_up_curve_follows_serving_s_level_from_the_first_propose():
    """The EPYC: the draft's warm-up (run while the target calibrated on the same two cores)
    put a Propose at 30 ms and more per row; serving's first Propose took 11 ms. The seeds keep
    their shape (what a row costs) and take serving's level from that one point on, so a
    drafting shape is priced as serving will see it - not at three times that until 25
    Proposes have been timed."""
    c = CostModel([(1, 0.040)])
    c.seed_proposes([(1, 0.030), (4, 0.033), (16, 0.045)])
    assert c.propose_cost(4) == pytest.approx(0.033, rel=0.02)
    c.observe_propose(0.011, 4, forward_s=0.011)
    third = 0.011 / 0.033
    assert c.propose_cost(16) == pytest.approx(c.propose_overhead_s + 0.045 * third, rel=0.05)
    assert c.chain_proposes.seed_scale == pytest.approx(third, rel=0.02)


def test_one_dear_first_propose_does_not_price_drafting_out_until_it_is_confirmed():
    """The H200 at one request: the first tree Propose alone ran 8.6x its warm-up point (a
    first run), its sibling chain line borrowed that level, and every drafting shape was priced
    at 10-12 ms a step against 3 without drafts - auto did not draft (so timed nothing to
    correct it) for 20 s. A dearer level than the prior's counts from SCALE_TRUST Proposes on;
    a cheaper one (the EPYC's warm-up, above) from the first."""
    from gateway.propose_line import SCALE_TRUST
    c = CostModel([(1, 0.003)])
    seeds = [(8, 0.00075), (64, 0.0009)]
    c.seed_proposes(seeds, seeds)
    warm = c.propose_cost(20, tree=True)
    c.observe_propose(0.010, 12, tree=True, forward_s=0.0065)        # 8.6x: a first run
    assert c.tree_proposes.seed_scale == c.chain_proposes.seed_scale == 1.0
    assert c.propose_cost(20, tree=True) - c.propose_overhead_s < 2 * (warm - 0.0)
    assert c.propose_cost(20) - c.propose_overhead_s < 0.0015             # chains: the warm-up
    for _ in range(SCALE_TRUST - 1):                                      # confirmed: believed
        c.observe_propose(0.010, 12, tree=True, forward_s=0.0065)
    assert c.tree_proposes.seed_scale == pytest.approx(0.0065 / 0.00077, rel=0.05)
    assert c.chain_proposes.seed_scale == pytest.approx(c.tree_proposes.seed_scale)  # borrowed


def test_a_greedy_tree_step_also_counts_for_the_chain_it_contains():
    """Tree [a, b | c under a, d under c]: the chain is a, c, d. Committed [a, c, x, bonus...]
    means the chain held for 2 of its 3 drafts; committed [b, ...] (a sibling's path) means
    it failed at its first."""
    from runtime.draft_tree import DraftTree
    policy = SpeculationPolicy([(1, 0.010)])
    tree = DraftTree([1, 2, 3, 4], [0, 0, 1, 3])
    m = policy.model()
    policy.observe_chain_in_tree(m, tree, [1, 3, 9])
    assert m.own[CHAIN].counts(1) == (1.0, 1.0) and m.own[CHAIN].counts(2) == (1.0, 1.0)
    assert m.own[CHAIN].counts(3) == (0.0, 1.0)
    policy.observe_chain_in_tree(m, tree, [2, 5])
    assert m.own[CHAIN].counts(1) == (1.0, 2.0)


def test_proposes_beside_other_requests_do_not_price_one_alone():
    """The EPYC: the bench's warm-up (two requests at once) timed Proposes at 37 ms - beside the
    other request's verify on the same two cores - where one alone takes 11. One line for both
    kept auto from drafting at one request, where chains won by 4-12 %, and no Propose was
    timed alone to correct it. Busy and alone have lines of their own; the alone line, still
    the warm-up's, is explored at once (not EXPLORE_EVERY decisions later: most of a short
    request), and then the request drafts."""
    import gateway.speculation_policy as sp
    seeds = [(17, 0.036), (18, 0.035), (20, 0.035), (24, 0.036), (32, 0.035)]
    c = CostModel([(1, 0.030), (2, 0.032), (4, 0.036)])
    c.seed_proposes(seeds)
    for _ in range(20):
        c.observe_propose(0.039, 14, forward_s=0.037, busy=True)
    assert c.propose_cost(14, busy=True) == pytest.approx(0.039, rel=0.05)
    assert c.propose_cost(14) == pytest.approx(0.002 + 0.035, rel=0.05)   # still the seeds'
    assert c.propose_runs(busy=True) == 20 and c.propose_runs() == 0

    policy = SpeculationPolicy([(1, 0.030), (2, 0.032), (4, 0.036)])
    policy.cost = c
    m = policy.model()
    for _ in range(40):
        m.observe(CHAIN, 3, 1)                      # the first of three drafts accepted
    limits = Limits(max_chain=3, max_tree=0, tree_depth=3, backlog=3, remaining=40)
    before = sp.rank([Option(NO_DRAFTING, 1.0), Option(Shape(1), m.expected(CHAIN, 1))], c)
    chosen = []
    for _ in range(3 * sp.EXPLORE_EVERY):
        shape = policy.decide("a", m, limits, running=1)
        if shape.drafts:
            policy.cost.observe_propose(0.013, 5, forward_s=0.011)
        chosen.append(shape)
    assert before[0].shape == NO_DRAFTING           # priced at the busy warm-up's 37 ms ...
    assert chosen[0].drafts                         # ... explored at once: alone is untimed
    assert all(s.drafts for s in chosen)            # then drafts alone, priced at 11 ms
    assert c.propose_cost(14, busy=True) == pytest.approx(0.039, rel=0.05)   # busy: as taught


def _worker(padded: tuple[int, ...], max_block: int = 32, budget: int = 4096):
    """What cost_calibration.plan reads of a target worker."""
    from types import SimpleNamespace
    return SimpleNamespace(
        padded_blocks=padded,
        config=SimpleNamespace(max_block_size=max_block, token_budget=budget, page_size=16),
        kv_cache=SimpleNamespace(usable_pages=10_000), facts=SimpleNamespace(max_context=8192))


def test_calibration_times_chains_as_serving_runs_them():
    """With captured chain graphs (a GPU), sizes above the largest captured block are several
    sequences of that block - the graph serving runs for a batch of drafting requests - never
    one sequence's longer block, which runs eagerly (on an H100 11.8 ms against 1.4, and auto
    stopped drafting at 2 requests); without graphs (or with only decode's), up to
    --max-block-size per sequence."""
    from services.target.cost_calibration import chain_block, plan
    gpu = plan(_worker((1, 16)))
    assert chain_block(_worker((1, 16))) == 16
    assert all(block <= 16 for _, block in gpu)
    assert (2, 16) in gpu and (4, 16) in gpu and (1, 16) in gpu and (1, 12) in gpu
    assert max(b for _, b in plan(_worker(()))) == 32 and (1, 24) in plan(_worker(()))
    assert chain_block(_worker((1,))) == 32              # decode's graph only: chains eager
    assert chain_block(_worker((1, 64), max_block=32)) == 32
