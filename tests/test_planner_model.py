"""The planner's model: cost model, stage cuts, keep sets, the chain DP against Revolve's binomial
optimum, the MILP against the DP, and plans read back from the graph they build."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jgraph as jg
from jgraph.planner import exact, fast
from jgraph.planner.chain import StageCost
from jgraph.planner.cost import (
    FUSED_PER_ELEMENT,
    TRANSCENDENTAL_PER_ELEMENT,
    eqn_cost,
    recompute_flops,
)
from jgraph.planner.plan import Segment
from jgraph.planner.problem import Problem
from jgraph.regions import without_regions

F32 = jnp.float32


def joint(fn, *args):
    return jg.backward(jg.trace(fn, *args, param_argnums=0))


def tanh_chain(layers, width=16, batch=8):
    ws = [jnp.full((width, width), 0.01 * (i + 1), F32) for i in range(layers)]

    def loss(ws, h):
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.sum(h)

    return loss, (ws, jnp.ones((batch, width), F32))


# -- Revolve's binomial optimum ------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def revolve(steps, slots):
    """Fewest forward steps reversing `steps` equal steps with `slots` checkpoints, by brute force
    over where the first checkpoint goes (Griewank's recursion)."""
    if steps == 1:
        return 0
    if slots == 0:
        return math.inf
    return min(first + revolve(steps - first, slots - 1) + revolve(first, slots)
               for first in range(1, steps))


@pytest.mark.parametrize("steps,slots", [(8, 2), (16, 3), (32, 3), (32, 4), (20, 2), (10, 1),
                                         (64, 5)])
def test_binomial_formula_is_revolves_optimum(steps, slots):
    assert fast.binomial_recompute(steps, slots) == revolve(steps, slots)


@pytest.fixture
def flops_only(monkeypatch):
    """Plans costed by recompute flops alone (Revolve's model): no memory traffic term."""
    monkeypatch.setattr(fast, "KEPT_BYTE_COST", 0.0)
    monkeypatch.setattr(exact, "KEPT_BYTE_COST", 0.0)


class _Stage:
    def __init__(self, out_bytes):
        self.out_bytes = out_bytes


def uniform_chain(steps, size=1 << 20):
    """The chain model of `steps` equal stages: a boundary of `size` bytes each, one unit of
    flops to advance through a stage, nothing else to recompute or hold."""
    stages = [_Stage(size) for _ in range(steps)]
    costs = [StageCost(advance=1.0, leaf=0.0, leaf_peak=0, kept_bytes=0, whole_peak=0,
                       whole_bytes=0) for _ in range(steps)]
    return stages, costs


@pytest.mark.parametrize("steps,slots", [(8, 2), (16, 3), (32, 3), (32, 4), (20, 2), (64, 5)])
def test_the_chain_dp_reaches_the_binomial_optimum(steps, slots, flops_only):
    """The forward sweep is free in the DP (the forward runs anyway): its recompute is Revolve's
    count less the steps - 1 of the first sweep, exactly (the bar: within 10%)."""
    stages, costs = uniform_chain(steps)
    dp = fast.ChainDP(stages, costs, slots << 20)
    cost, _ = dp.best(slots << 20)
    assert cost == fast.binomial_recompute(steps, slots) - (steps - 1)


def scanned_dp(dp):
    """The DP's recursions (module docstring of `fast`) as a plain scan over splits, in units:
    {(s, t or "root", m): (cost, choice)}, the first cheapest split winning a tie."""
    S, adv, inf = dp.S, dp.adv, math.inf

    @functools.lru_cache(maxsize=None)
    def opt(s, t, m):
        if m < 0:
            return inf, -1
        if t == s + 1:
            return (dp.leaf_cost[s] if m >= dp.leaf_need[s] else inf), -1
        found = (inf, -1)
        for u in range(s + 1, t):
            cost = (adv[u] - adv[s]) + opt(u, t, m - dp.b[u - 1])[0] + opt(s, u, m)[0]
            found = (cost, u) if cost < found[0] else found
        return found

    @functools.lru_cache(maxsize=None)
    def root(s, m):
        if m < 0 or s == S:
            return (inf if m < 0 else 0.0), -1
        held = dp.whole_held[s] + (dp.b[s] if s + 1 < S else 0)
        kept = dp.whole_cost[s] + (dp.boundary_cost[s] if s + 1 < S else 0)
        found = ((kept + root(s + 1, m - held)[0]) if m >= dp.whole_need[s] else inf), -1
        for u in range(s + 1, S + 1):
            cost = opt(s, S, m)[0] if u == S else (
                dp.boundary_cost[u - 1] + root(u, m - dp.b[u - 1])[0] + opt(s, u, m)[0])
            found = (cost, u) if cost < found[0] else found
        return found

    return opt, root


def test_the_chain_dp_tables_are_a_scan_over_splits():
    """The DP's tables, computed a whole span of segments at a time, hold what a scan over each
    segment's splits finds, ties included (stages of unequal costs and sizes)."""
    rng = np.random.default_rng(0)
    stages = [_Stage(int(b)) for b in rng.choice([0, 64, 128, 512], 9)]
    costs = [StageCost(advance=float(rng.choice([0.0, 1.0, 3.5])), leaf=float(rng.choice([0, 2])),
                       leaf_peak=int(rng.integers(0, 20)) * 64, kept_bytes=int(rng.choice([0, 64])),
                       whole_peak=int(rng.integers(0, 40)) * 64,
                       whole_bytes=int(rng.integers(0, 20)) * 64) for _ in stages]
    dp = fast.ChainDP(stages, costs, 4096)
    opt, root = scanned_dp(dp)
    for m in range(dp.K + 1):
        assert (dp.root[0][m], dp.root_choice[0][m]) == root(0, m)
        for s in range(dp.S):
            for t in range(s + 2, dp.S + 1):
                cost, u = opt(s, t, m)
                assert dp.choice[s][t][m] == (u if math.isfinite(cost) else -1)


@pytest.mark.parametrize("steps,slots", [(8, 2), (10, 3), (12, 2)])
def test_the_milp_reaches_the_binomial_optimum(steps, slots, flops_only):
    stages, costs = uniform_chain(steps)
    modes = [[(frozenset(), c)] for c in costs]
    plan = exact._Milp(stages, modes, slots << 20).solve(seconds=60)
    assert plan.label == "MILP, optimal"
    assert round(plan.cost) == fast.binomial_recompute(steps, slots) - (steps - 1)


def simulated(plan, stages, costs):
    """(recompute cost, peak bytes) of running `plan`'s segments as the builder does: a segment
    advances from its start to its last child's start, storing each child's start, then runs its
    children last to first, each child's start held until that child is done; a leaf runs its
    stage's backward on its held start; the forward stores each top segment's start."""
    b = [0] + [s.out_bytes for s in stages]  # b[j]: boundary j, the input of stage j
    adv = [c.advance for c in costs]
    total, peak = 0.0, 0

    def run(seg, held):
        nonlocal total, peak
        if not seg.children:
            assert seg.stop == seg.start + 1
            total += costs[seg.start].leaf
            peak = max(peak, held + costs[seg.start].leaf_peak)
            return
        starts = [c.start for c in seg.children]
        assert starts[0] == seg.start and seg.children[-1].stop == seg.stop
        total += sum(adv[seg.start:starts[-1]])
        for i in reversed(range(len(starts))):
            run(seg.children[i], held + sum(b[j] for j in starts[1:i + 1]))

    tops, at = [], 0  # a stage in no segment, of no leaf cost, is a leaf the forward stored
    for seg in plan.segments + (Segment(len(stages), len(stages)),):
        while at < seg.start:
            assert costs[at].leaf == 0
            tops, at = tops + [Segment(at, at + 1)], at + 1
        tops, at = tops + [seg], seg.stop
    tops = tops[:-1]
    for i in reversed(range(len(tops))):
        total += exact.KEPT_BYTE_COST * b[tops[i].start]
        run(tops[i], sum(b[s.start] for s in tops[1:i + 1]))
    return total, peak


def random_chains(seed, count=5):
    """(stages, costs, budgets) of `count` chains of unequal stages, sizes in units of 64 bytes;
    seed None: a chain where dropping a boundary and computing it again later is cheapest."""
    if seed is None:
        sizes, advance, leaf, peak = [1, 7, 3, 1, 2, 3], [4, 1, 2, 2, 3, 1], [3, 2, 3, 0, 3, 0], [
            9, 4, 8, 3, 9, 10]
        yield ([_Stage(64 * x) for x in sizes], [
            StageCost(advance=float(a), leaf=float(f), leaf_peak=64 * p, kept_bytes=0,
                      whole_peak=1 << 40, whole_bytes=0)
            for a, f, p in zip(advance, leaf, peak, strict=True)], [15 * 64])
        return
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(4, 9))
        stages = [_Stage(int(rng.integers(1, 8)) * 64) for _ in range(n)]
        costs = [StageCost(advance=float(rng.integers(1, 6)), leaf=float(rng.integers(0, 4)),
                           leaf_peak=int(rng.integers(1, 12)) * 64, kept_bytes=0,
                           whole_peak=1 << 40, whole_bytes=0) for _ in range(n)]
        top = sum(s.out_bytes for s in stages) + max(c.leaf_peak for c in costs)
        yield stages, costs, {int(x) // 64 * 64 for x in rng.uniform(0.2, 1.0, 4) * top}


@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3])
def test_the_milp_plans_what_the_builder_builds_at_the_dps_cost(seed):
    """On chains of unequal stages, the MILP's plan (one mode per stage) costs what the DP's
    does, exactly (the DP counts memory in the sizes' common unit here), and its segments, run
    as the builder runs them, fit the budget at the cost the MILP claims. Without the rule
    that a boundary stays held until its stage's backward, the MILP dropped a boundary and
    computed it again later (cost 30, a schedule segments cannot say) and read it back as a
    plan 64 bytes above its budget (seed None; the DP's plan costs 34)."""
    for stages, costs, budgets in random_chains(seed):
        for budget in budgets:
            best = fast.ChainDP(stages, costs, budget).best(budget)
            plan = exact._Milp(stages, [[(frozenset(), c)] for c in costs], budget).solve(20)
            if best is None:
                assert plan is None
                continue
            assert plan.label == "MILP, optimal"
            assert plan.cost == pytest.approx(best[0], abs=1e-6)
            cost, peak = simulated(plan, stages, costs)
            assert cost == pytest.approx(plan.cost, abs=1e-6) and peak <= budget


def test_a_planned_tanh_chain_recomputes_what_the_model_counts(flops_only):
    """On a real chain the DP's cost is the flops of the recompute eqns of the graph it builds:
    the recompute count of the plan is the model's (hence binomial on a uniform chain)."""
    fn, args = tanh_chain(12)
    problem = Problem.of(without_regions(joint(fn, *args)))
    assert len(problem.stages) == 13  # a cut after each tanh, and the loss
    planner = fast.FastPlanner(problem.stages, jg.memory(problem.graph).peak_bytes)
    least, plan = planner.smallest()
    for budget in (least, 1.5 * least, 2 * least):
        plan = min(planner.plans(budget), key=lambda p: p.cost)
        graph = problem.build(plan)
        assert recompute_flops(graph) == pytest.approx(plan.cost, rel=1e-9)
        assert jg.memory(graph).peak_bytes <= budget * 1.05


# -- the cost model, cuts and keep sets ----------------------------------------------------------
def test_cost_model_counts_contractions_loops_and_fused_ops():
    def f(w, x):
        y = jnp.tanh(x @ w)
        return jnp.sum(lax.scan(lambda c, _: (c @ w + 1.0, None), y, None, length=5)[0])

    g = jg.trace(f, jnp.ones((8, 8)), jnp.ones((4, 8)), param_argnums=0)
    costs = {e.op: eqn_cost(e) for e in g.eqns}
    assert costs["dot_general"] == 2 * 4 * 8 * 8
    scan = next(e for e in g.eqns if e.op == "scan")
    assert costs["scan"] == 5 * (2 * 4 * 8 * 8 + FUSED_PER_ELEMENT * 32)
    assert eqn_cost(next(e for e in g.eqns if e.op == "tanh")) == TRANSCENDENTAL_PER_ELEMENT * 32
    assert scan.params["length"] == 5


def test_stages_are_cut_between_residual_blocks():
    def blocks(ps, h):
        for w1, w2 in ps:
            h = h + jnp.tanh(h @ w1) @ w2
        return jnp.sum(h * h)

    ps = [(jnp.full((8, 32), 0.01, F32), jnp.full((32, 8), 0.01, F32)) for _ in range(5)]
    problem = Problem.of(without_regions(joint(blocks, ps, jnp.ones((4, 8), F32))))
    cuts = [s.stop for s in problem.stages[:-1]]
    ops = [problem.forward.eqns[c - 1].op for c in cuts]
    assert ops.count("add") >= 4  # after each block's residual add (and maybe after tanh)
    assert all(s.out_bytes <= 4 * 32 * 4 for s in problem.stages)


def test_keep_sets_keep_contractions_by_their_cost_per_byte():
    fn, args = tanh_chain(4)
    problem = Problem.of(without_regions(joint(fn, *args)))
    sets = fast.keep_sets(problem.stages)
    assert sets["keep nothing"] == frozenset()
    producer = problem.forward.producer
    ops = {problem.forward.eqns[producer[v]].op for v in sets["keep contractions"]}
    assert ops == {"dot_general"}


def test_save_values_saves_exactly_its_values_and_is_no_jax_policy():
    g = jg.trace(lambda w, x: jnp.sum(jnp.sin(x @ w)), jnp.ones((3, 3)), jnp.ones((2, 3)),
                 param_argnums=0)
    dot = next(e for e in g.eqns if e.op == "dot_general")
    policy = jg.policies.SaveValues(frozenset(dot.outputs))
    assert [jg.policies.saves(policy, e) for e in g.eqns] == [e is dot for e in g.eqns]
    with pytest.raises(jg.TransformError, match="cannot answer for a JAX primitive"):
        jax.grad(jax.checkpoint(lambda x: jnp.sum(jnp.sin(x)), policy=policy))(np.ones(3))


# -- the MILP against the DP ---------------------------------------------------------------------
def residual_blocks(n=6, width=16, hidden=64, batch=32):
    ps = [(jnp.full((width, hidden), 0.01 * (i + 1), F32),
           jnp.full((hidden, width), 0.02, F32)) for i in range(n)]

    def loss(ps, h):
        for w1, w2 in ps:
            h = h + jnp.tanh(h @ w1) @ w2
        return jnp.sum(h * h)

    return loss, (ps, jnp.ones((batch, width), F32))


def test_the_milp_is_optimal_and_no_costlier_than_the_dp():  # traffic costs included
    """Per-stage keep sets (the DP has one for all stages) and no memory discretization: the
    MILP's plan costs at most the DP's at every budget, and fits the model's budget."""
    fn, args = residual_blocks()
    problem = Problem.of(without_regions(joint(fn, *args)))
    peak = jg.memory(problem.graph).peak_bytes
    planner = exact.ExactPlanner(problem, peak)
    least = planner.smallest()[0]  # the chain's least model peak (about half of no remat's)
    costs = []
    for budget in (0.8 * peak, 0.6 * peak, 1.02 * least):
        dp = min((p.cost for p in planner.plans(budget)), default=math.inf)
        plan = planner.solve(budget)
        assert plan is not None and plan.label == "MILP, optimal"
        assert plan.cost <= dp * (1 + 1e-6) + 1
        assert jg.memory(problem.build(plan)).peak_bytes <= budget * 1.1
        costs.append(plan.cost)
    assert costs[0] <= costs[1] <= costs[2]
    assert planner.solve(0.2 * peak) is None  # below the model's least: no plan
