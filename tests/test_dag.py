"""jg.planner.Dag / schedule / replay: hand-derived optima, the MILP against brute force over
Checkmate's schedule space on tiny random DAGs, the fast solver always within budget, the replay
rejecting bad schedules, and clear errors for bad DAGs and budgets."""

import itertools
import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import jgraph as jg
from jgraph.errors import GraphError, TransformError
from jgraph.planner.dag import _Milp, _stage_events

Dag, schedule, replay = jg.planner.Dag, jg.planner.schedule, jg.planner.replay


def contract_dag():
    return Dag(memory={"a": 4, "b": 4, "c": 4, "d": 1}, cost={"a": 1, "b": 1, "c": 1, "d": 1},
               edges=[("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")], order=["a", "b", "c", "d"])


def skip_chain():
    """a -> b -> c -> d -> e and a -> e: holding a over c and d costs 2 + 3 + 3 = 8."""
    return Dag(memory={"a": 2, "b": 3, "c": 3, "d": 3, "e": 1},
               cost={"a": 5, "b": 1, "c": 1, "d": 1, "e": 1},
               edges=[("a", "b"), ("b", "c"), ("c", "d"), ("d", "e"), ("a", "e")])


def diamond():
    return Dag(memory={"s": 2, "l": 3, "r": 3, "t": 1}, cost=dict.fromkeys("slrt", 1),
               edges=[("s", "l"), ("s", "r"), ("l", "t"), ("r", "t")])


def computes(sch):
    return [node for kind, node in sch.events if kind == "compute"]


def check(dag, sch, budget):
    measured = replay(dag, sch.events)
    assert (measured.peak, measured.cost) == (sch.peak, sch.cost)
    assert sch.peak <= budget


# --- hand-derived cases -----------------------------------------------------------------------


def test_contract_example():
    dag = contract_dag()
    free = schedule(dag, budget=10**6)
    assert free.cost == 4 and free.peak == 12 and free.solver == "topological"
    assert computes(free) == ["a", "b", "c", "d"]
    tight = schedule(dag, budget=free.peak)
    assert tight.peak <= free.peak and computes(tight)
    # Below 12, a is freed after b and computed again for d: a + c + d = 9 at most.
    for budget in (9, 10, 11):
        for solver in ("auto", "exact", "fast"):
            sch = schedule(dag, budget, solver=solver)
            check(dag, sch, budget)
            assert (sch.cost, sch.peak) == (5, 9), solver
            assert computes(sch) == ["a", "b", "c", "a", "d"]
    assert schedule(dag, 9, solver="exact").status == "optimal"


def test_skip_chain_recomputes_the_costly_source_once():
    # Topological: a, b, c (a + b + c = 8), d (a + c + d = 8), e: peak 8, cost 9. Under 8, a
    # cannot be held while c or d runs (2 + 3 + 3), so it is computed again for e: cost 14.
    dag = skip_chain()
    assert dag.topological_peak() == 8 and dag.lower_bound() == 6 and dag.total_cost == 9
    for budget in (6, 7):
        for solver in ("exact", "fast"):
            sch = schedule(dag, budget, solver=solver)
            check(dag, sch, budget)
            assert sch.cost == 14 and computes(sch).count("a") == 2 and sch.recomputes == 1
    assert schedule(dag, 8).cost == 9


def test_diamond_needs_its_three_values_together():
    # r reads s, t reads l and r: l is held over r (s + l + r = 8), or computed again in t's
    # stage, where it reads s while r waits (8 again). No schedule peaks below 8, though the
    # largest node with its inputs (t, l, r) is 7.
    dag = diamond()
    assert dag.lower_bound() == 7 and dag.topological_peak() == 8
    sch = schedule(dag, 8)
    assert sch.cost == 4 and computes(sch) == ["s", "l", "r", "t"]
    with pytest.raises(TransformError, match=r"budget=7.*least peak found is 8 "):
        schedule(dag, 7)


def test_budget_below_the_lower_bound():
    with pytest.raises(TransformError, match=r"budget=8.*at least 9"):
        schedule(contract_dag(), 8)


def test_outputs_stay_resident():
    dag = Dag(memory={"a": 1, "b": 1, "c": 1}, cost=dict.fromkeys("abc", 1),
              edges=[("a", "b"), ("a", "c")], outputs=["b", "c"])
    sch = schedule(dag, 100)
    assert ("free", "b") not in sch.events and ("free", "c") not in sch.events
    default = Dag(memory={"a": 1, "b": 1, "c": 1}, cost=dict.fromkeys("abc", 1),
                  edges=[("a", "b"), ("a", "c")])
    assert default.outputs == ("c",) and ("free", "b") in schedule(default, 100).events


# --- the replay --------------------------------------------------------------------------------


def test_replay_measures_a_schedule():
    events = [("compute", "a"), ("compute", "b"), ("free", "a"), ("compute", "c"),
              ("free", "b"), ("compute", "a"), ("compute", "d")]
    measured = replay(contract_dag(), events)
    assert (measured.peak, measured.cost, measured.recomputes) == (9, 5, 1)


@pytest.mark.parametrize("events, message", [
    ([("compute", "b")], r"computes 'b', but its input 'a' is not resident"),
    ([("compute", "a"), ("free", "a"), ("free", "a")], r"event 2 frees 'a', which is not"),
    ([("compute", "a"), ("compute", "a")], r"computes 'a', which is resident already"),
    ([("compute", "z")], r"'z', which is not a node"),
    ([("run", "a")], r"not \('compute' \| 'free', node\)"),
    ([("compute", "a"), ("compute", "b")], r"never computes 'c'"),
    ([("compute", "a"), ("compute", "b"), ("compute", "c"), ("compute", "d"), ("free", "d")],
     r"output 'd' is not resident at the end"),
])
def test_replay_rejects_a_bad_schedule(events, message):
    with pytest.raises(GraphError, match=message):
        replay(contract_dag(), events)


# --- bad input ---------------------------------------------------------------------------------

M, C = {"a": 1, "b": 1}, {"a": 1, "b": 1}


@pytest.mark.parametrize("kwargs, message", [
    ({"edges": [("a", "x")]}, r"names 'x', a node with no memory or cost"),
    ({"edges": [("a", "b"), ("b", "a")]}, r"cycle"),
    ({"edges": [("a", "a")]}, r"cycle"),
    ({"edges": [("a", "b")], "order": ["b", "a"]}, r"not topological: 'a' -> 'b'"),
    ({"edges": [], "order": ["a"]}, r"order misses the nodes \['b'\]"),
    ({"edges": [], "order": ["a", "b", "a"]}, r"names 'a' twice"),
    ({"edges": [], "memory": {"a": -1, "b": 1}}, r"memory\['a'\] = -1"),
    ({"edges": [], "memory": {"a": float("nan"), "b": 1}}, r"memory\['a'\] = nan"),
    ({"edges": [], "cost": {"a": 1}}, r"'b' has a memory but no cost"),
    ({"edges": [("a",)]}, r"not a pair"),
    ({"edges": [], "outputs": ["q"]}, r"outputs names 'q'"),
])
def test_bad_dags(kwargs, message):
    args = {"memory": M, "cost": C, **kwargs}
    with pytest.raises(GraphError, match=message):
        Dag(**args)


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": 0}, r"budget=0; expected a number > 0"),
    ({"budget": "1GB"}, r"budget='1GB'"),
    ({"budget": 10, "solver": "magic"}, r"solver='magic'"),
])
def test_bad_schedule_arguments(kwargs, message):
    with pytest.raises(TransformError, match=message):
        schedule(contract_dag(), **kwargs)


def test_default_order_is_topological():
    dag = Dag(memory={"c": 1, "b": 1, "a": 1}, cost={"c": 1, "b": 1, "a": 1},
              edges=[("a", "b"), ("b", "c")])
    assert dag.order == ("a", "b", "c") and dag.outputs == ("c",)


# --- the MILP against brute force, the fast solver within budget -------------------------------


@st.composite
def dags(draw, max_nodes=5):
    """A random DAG (from a drawn seed: hypothesis's small values would mostly give DAGs that
    need no recompute) and a budget from its lower bound to below no recompute's peak."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    for _ in range(100):  # most tiny DAGs need no recompute at any budget: look for one that does
        n = rng.randint(3, max_nodes)
        # a chain with a skip from the first node to the last (a value held across), and more
        edges = [(i, j) for j in range(n) for i in range(j)
                 if j == i + 1 or (i, j) == (0, n - 1) or rng.random() < 0.3]
        dag = Dag({i: rng.randint(1, 6) for i in range(n)},
                  {i: rng.randint(0, 4) for i in range(n)}, edges)
        lower, top = dag.lower_bound(), dag.topological_peak()
        if lower < top:
            break
    return dag, rng.randint(lower, max(lower, top - 1))


def brute_force(dag, budget):
    """The least cost over every choice of stages (node i < t computed again in stage t or not,
    each stage in order): Checkmate's space. None if none fits."""
    ix = dag._ix
    slots = [(t, i) for t in range(ix.n) for i in range(t)]
    best = None
    for chosen in itertools.product((False, True), repeat=len(slots)):
        stages = [[t] for t in range(ix.n)]
        for (t, i), on in zip(slots, chosen, strict=True):
            if on:
                stages[t].append(i)
        measured = replay(dag, _stage_events(ix, [sorted(s) for s in stages]))
        if measured.peak <= budget and (best is None or measured.cost < best):
            best = measured.cost
    return best


@settings(max_examples=60, deadline=None)
@given(dags())
def test_milp_is_exact_on_tiny_dags(case):
    dag, budget = case
    event("recompute needed" if budget < dag.topological_peak() else "no recompute")
    best = brute_force(dag, budget)
    event("infeasible" if best is None else "feasible")
    stages, status, bound = _Milp(dag._ix, budget).solve(10.0)
    if best is None:
        assert stages is None and status == 2
        return
    measured = replay(dag, _stage_events(dag._ix, stages))
    assert status == 0 and measured.peak <= budget and measured.cost == best
    assert bound == pytest.approx(best - dag.total_cost, rel=1e-5, abs=1e-6)
    sch = schedule(dag, budget, solver="exact")
    check(dag, sch, budget)
    # the fast schedule it starts from may order a stage's recomputes depth first, outside
    # Checkmate's space: never worse than its optimum, maybe better
    assert sch.cost <= best and sch.status == "optimal"


# DAGs where HiGHS 1.12 with presolve goes wrong (issue 27), found by the property above:
# (DAG, budget, the least cost, what HiGHS with presolve answers)
HIGHS_FAULTS = [
    (Dag(memory={0: 3, 1: 4, 2: 6, 3: 3, 4: 5}, cost={0: 4, 1: 0, 2: 1, 3: 1, 4: 0},
         edges=[(0, 1), (1, 2), (2, 3), (0, 4), (3, 4)]), 11, 10, "11, above its bound"),
    (Dag(memory={0: 3, 1: 2, 2: 6, 3: 2, 4: 3}, cost={0: 3, 1: 3, 2: 1, 3: 3, 4: 2},
         edges=[(0, 1), (1, 2), (1, 3), (2, 3), (0, 4), (3, 4)]), 10, 15, "infeasible"),
    (Dag(memory={0: 2, 1: 4, 2: 6, 3: 1, 4: 5}, cost={0: 1, 1: 0, 2: 0, 3: 4, 4: 3},
         edges=[(0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (0, 4), (3, 4)]), 12, 9,
     "10, its bound too"),
]


@pytest.mark.parametrize("dag, budget, least, fault", HIGHS_FAULTS,
                         ids=[fault for *_, fault in HIGHS_FAULTS])
def test_milp_finds_the_optimum_here(dag, budget, least, fault):
    assert brute_force(dag, budget) == least
    stages, status, bound = _Milp(dag._ix, budget).solve(10.0)
    assert status == 0 and replay(dag, _stage_events(dag._ix, stages)).cost == least
    assert bound == pytest.approx(least - dag.total_cost)
    sch = schedule(dag, budget, solver="exact")
    check(dag, sch, budget)
    assert (sch.cost, sch.status) == (least, "optimal")


def test_milp_proves_the_fast_schedule_optimal_here():
    # Bounded by the fast schedule's cost (19: 0 again for 4), HiGHS 1.12 with presolve ends in
    # a solve error here, which left the schedule "feasible".
    dag = Dag(memory={0: 3, 1: 3, 2: 5, 3: 3, 4: 4}, cost={0: 4, 1: 0, 2: 3, 3: 4, 4: 4},
              edges=[(0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (0, 4), (3, 4)])
    assert brute_force(dag, 13) == 19 and dag.total_cost == 15
    stages, status, bound = _Milp(dag._ix, 13).solve(10.0, cost_bound=4.0)
    assert status == 0 and replay(dag, _stage_events(dag._ix, stages)).cost == 19
    sch = schedule(dag, 13, solver="exact")
    check(dag, sch, 13)
    assert (sch.cost, sch.status, sch.lower_bound) == (19, "optimal", pytest.approx(19))


def test_milp_with_no_costs():
    # every recompute free: the bound from the fast schedule (0 over) adds no row (it divided
    # by the largest cost, 0)
    dag = Dag(memory={"a": 2, "b": 3, "c": 3, "d": 3, "e": 1}, cost=dict.fromkeys("abcde", 0),
              edges=[("a", "b"), ("b", "c"), ("c", "d"), ("d", "e"), ("a", "e")])
    sch = schedule(dag, 6, solver="exact")
    check(dag, sch, 6)
    assert (sch.cost, sch.status) == (0, "optimal")


@settings(max_examples=25, deadline=None)
@given(dags(max_nodes=12))
def test_fast_fits_the_budget(case):
    dag, budget = case
    try:
        sch = schedule(dag, budget, solver="fast")
    except TransformError as e:
        assert "no schedule found" in str(e)
        return
    check(dag, sch, budget)
    assert sch.cost >= dag.total_cost
    auto = schedule(dag, budget)
    check(dag, auto, budget)
    assert auto.cost <= sch.cost


def test_exact_refuses_a_huge_milp():
    n = 1500  # a chain whose second node is large, and a skip from the first to the last
    memory = {i: 10 if i == 1 else 1 for i in range(n)}
    dag = Dag(memory, dict.fromkeys(range(n), 1),
              [(i, i + 1) for i in range(n - 1)] + [(0, n - 1)])
    assert (dag.lower_bound(), dag.topological_peak()) == (11, 12)
    with pytest.raises(TransformError, match=r"about \d+ variables.*use solver='auto'"):
        schedule(dag, 11, solver="exact")
    sch = schedule(dag, 11, solver="fast")
    check(dag, sch, 11)
    assert sch.cost == n + 1  # node 0 again, for the last node
