"""The exact planner: the chain model's plan of least recompute cost, as a MILP (HiGHS, through
`scipy.optimize.milp`), in a Checkmate-style formulation specialised to jgraph's schedule (the
forward, then the backward of stage S-1, ..., of stage 0).

Variables, for backward steps t = S-1 .. 0 (step t runs stage t's backward) and boundaries j
(boundary j is the input of stage j; boundary 0, the graph's inputs, is always at hand):

    y[t, k]   stage t is in mode k (a keep set: what the forward keeps of it; k = 0 keeps nothing)
    S[t, j]   boundary j is held when step t starts (j <= t); S[S-1, j]: the forward stored it
    R[t, j]   boundary j is computed during step t, advancing through stage j-1 (j <= t)
    H[t, j]   boundary j is held at some moment of step t
    A[t, j, k] >= R[t, j] + y[j-1, k] - 1     (the advance's cost depends on stage j-1's mode)

Constraints: one mode per stage; stage t's backward (and its leaf recompute) needs boundary t
held or computed at step t; R[t, j] <= S[t, j-1] + R[t, j-1] (a run advances from
a held boundary); S[t-1, j] <= S[t, j] + R[t, j] (a boundary is held only once computed);
S[t-1, j] >= S[t, j] (a boundary once held stays held until its stage's backward: without it
the MILP drops a boundary and computes it again later, a schedule nested segments cannot say);
H[t, j] >= S[t, j], S[t-1, j], and H[t, t] >= R[t, t]; and at every step t

    sum_j b_j H[t, j] + sum_{j<t, k} kept[j, k] y[j, k] + sum_k peak[t, k] y[t, k] <= budget

with `peak` the stage's backward peak in that mode (`jgraph.planner.chain.Stage.measure`).
Objective: sum advance[j-1, k] A[t, j, k] + sum (leaf[t, k] + c kept[t, k]) y[t, k] +
sum c b_j S[S-1, j], with c the memory traffic of a byte kept from the forward to the backward
(`jgraph.planner.cost.KEPT_BYTE_COST`), plus a tie-breaking epsilon per held or computed
boundary. With the holding rule, in an optimum the boundaries each step computes form a run
from the highest held one, and the runs nest: the solution reads back as nested segments
(`_segments`), the plan space of `jgraph.planner.fast`, where the modes are a global keep set
instead of one per stage. The MILP is exact for the chain model (no memory discretization;
solved without HiGHS's presolve, which spoils MILPs of this kind now and then:
`jgraph.planner.dag`) and stops at `TIME_LIMIT` seconds with the best plan found
(`planner="auto"`: no longer than the planning's compiles so far, within `AUTO_TIME_LIMIT`:
`jgraph.planner.search._exactly`). `small_enough`: what
`planner="auto"` solves here.
"""

from __future__ import annotations

import itertools

import numpy as np

from jgraph.planner.cost import KEPT_BYTE_COST
from jgraph.planner.fast import FastPlanner, keep_sets
from jgraph.planner.plan import Plan, Segment

TIME_LIMIT = 60.0  # planner="exact": the whole planning, MILP included, within this
AUTO_TIME_LIMIT = 10.0  # planner="auto": the MILP only looks for a plan cheaper than the DP's
MAX_EXACT_EQNS = 500  # "auto" solves graphs up to this many eqns exactly
EPSILON = 1e-6  # relative tie-break: hold and compute no boundary without need


def small_enough(problem) -> bool:
    return len(problem.graph.eqns) <= MAX_EXACT_EQNS


class ExactPlanner:
    """The stage modes of a problem, and its MILP solved per budget. Its `plans` and `smallest`
    are the fast planner's (the planning loop calls them often); `solve` is the MILP."""

    def __init__(self, problem, max_budget: float = 0.0):
        self.stages = problem.stages
        self.fast = FastPlanner(self.stages, max(max_budget, 1.0))
        named = keep_sets(self.stages)
        self.modes = []  # per stage: [(keep set of the stage, StageCost)], distinct keep sets
        for stage in self.stages:
            mine, modes = set(stage.values), {}
            for keep in named.values():
                local = frozenset(keep & mine)
                if local not in modes:
                    modes[local] = stage.measure(local)
            self.modes.append(list(modes.items()))

    def plans(self, budget: float) -> list[Plan]:
        return self.fast.plans(budget)

    def smallest(self):
        return self.fast.smallest()

    def solve(self, budget: float, bound: float | None = None,
              seconds: float = TIME_LIMIT) -> Plan | None:
        """The MILP's plan within `budget` bytes of the model, cheaper than `bound` (None: no
        such plan, or none found in `seconds`)."""
        return _Milp(self.stages, self.modes, budget, bound).solve(seconds)


class _Milp:
    def __init__(self, stages, modes, budget, bound=None):
        self.stages, self.modes, self.budget, self.bound = stages, modes, budget, bound
        self.n = 0
        self.cost: list[float] = []
        self.kind: list[int] = []  # 1: integer (binary), 0: continuous in [0, 1]
        S = len(stages)
        self.y = {(t, k): self._var(c.leaf + KEPT_BYTE_COST * c.kept_bytes, 1)
                  for t in range(S) for k, (_, c) in enumerate(modes[t])}
        scale = max((c.leaf + c.advance for m in modes for _, c in m), default=1.0) or 1.0
        # The boundaries the forward keeps cost their traffic; the others a tie-break.
        self.S = {(t, j): self._var(EPSILON * scale + (
            KEPT_BYTE_COST * stages[j - 1].out_bytes if t == S - 1 else 0.0), 1)
            for t in range(S) for j in range(1, t + 1)}
        self.R = {(t, j): self._var(EPSILON * scale, 1) for t in range(S)
                  for j in range(1, t + 1)}
        self.H = {(t, j): self._var(0.0, 0) for t in range(S) for j in range(1, t + 1)}
        self.A = {(t, j, k): self._var(c.advance, 0) for t, j in self.R
                  for k, (_, c) in enumerate(modes[j - 1])}
        self.rows, self.lower, self.upper = [], [], []

    def _var(self, cost, integer) -> int:
        self.cost.append(cost)
        self.kind.append(integer)
        self.n += 1
        return self.n - 1

    def _row(self, terms, lower=-np.inf, upper=np.inf):
        self.rows.append(terms)
        self.lower.append(lower)
        self.upper.append(upper)

    def solve(self, seconds: float) -> Plan | None:
        from scipy import sparse  # heavy: imported when a MILP is solved
        from scipy.optimize import LinearConstraint, milp

        S, y, Sv, R, H = len(self.stages), self.y, self.S, self.R, self.H
        b = [0] + [s.out_bytes for s in self.stages]  # b[j]: boundary j, the input of stage j
        for t in range(S):
            self._row([(y[t, k], 1.0) for k in range(len(self.modes[t]))], 1.0, 1.0)
            if t >= 1:  # the stage's input boundary: its leaf recompute and backward read it
                self._row([(Sv[t, t], 1.0), (R[t, t], 1.0)], 1.0)
            for j in range(2, t + 1):
                self._row([(R[t, j], 1.0), (Sv[t, j - 1], -1.0), (R[t, j - 1], -1.0)],
                          upper=0.0)
            for j in range(1, t):
                self._row([(Sv[t - 1, j], 1.0), (Sv[t, j], -1.0), (R[t, j], -1.0)], upper=0.0)
                # held until its stage's backward: dropping a boundary to compute it again
                # later is a schedule nested segments cannot say (the builder builds those)
                self._row([(Sv[t - 1, j], 1.0), (Sv[t, j], -1.0)], lower=0.0)
            if t >= 1:
                self._row([(H[t, t], 1.0), (R[t, t], -1.0)], lower=0.0)  # the leaf's input
            for j in range(1, t + 1):
                self._row([(H[t, j], 1.0), (Sv[t, j], -1.0)], lower=0.0)
                if j < t:
                    self._row([(H[t, j], 1.0), (Sv[t - 1, j], -1.0)], lower=0.0)
                for k in range(len(self.modes[j - 1])):
                    self._row([(self.A[t, j, k], 1.0), (R[t, j], -1.0), (y[j - 1, k], -1.0)],
                              lower=-1.0)
            memory = [(H[t, j], float(b[j])) for j in range(1, t + 1)]
            memory += [(y[j, k], float(c.kept_bytes)) for j in range(t)
                       for k, (_, c) in enumerate(self.modes[j])]
            memory += [(y[t, k], float(c.leaf_peak)) for k, (_, c) in enumerate(self.modes[t])]
            self._row(memory, upper=float(self.budget))
        if self.bound is not None:  # no worse than a known plan: prunes the search
            self._row([(i, c) for i, c in enumerate(self.cost) if c], upper=self.bound)
        data, rows, cols = [], [], []
        for i, terms in enumerate(self.rows):
            for col, value in terms:
                rows.append(i)
                cols.append(col)
                data.append(value)
        matrix = sparse.csr_array((data, (rows, cols)), shape=(len(self.rows), self.n))
        # Scaled rows (bytes by the budget) and objective (flops by the largest cost): HiGHS
        # works in doubles, and mixing 1e9 flops with 1e-6 epsilons hurts its tolerances.
        norm = np.maximum(abs(matrix).max(axis=1).toarray().ravel(), 1e-30)
        matrix = sparse.diags(1 / norm) @ matrix
        lower, upper = np.asarray(self.lower) / norm, np.asarray(self.upper) / norm
        cost = np.asarray(self.cost) / max(max(self.cost), 1e-30)
        result = milp(cost, integrality=np.asarray(self.kind),
                      bounds=(0, 1), constraints=LinearConstraint(matrix, lower, upper),
                      options={"time_limit": max(seconds, 0.1), "presolve": False})
        if result.x is None:
            return None
        x = np.round(result.x).astype(int)
        mode = [max(range(len(self.modes[t])), key=lambda k: x[y[t, k]]) for t in range(S)]
        keep = frozenset().union(*(self.modes[t][mode[t]][0] for t in range(S)))
        segments = _segments(S, lambda t, j: x[Sv[t, j]], lambda t, j: x[R[t, j]],
                             [self.modes[t][mode[t]][1] for t in range(S)])
        cost = sum(self.cost[i] * x[i] for i in self.y.values()) + sum(
            self.cost[i] * round(result.x[i], 6) for i in self.A.values()) + sum(
            KEPT_BYTE_COST * self.stages[j - 1].out_bytes * x[Sv[S - 1, j]] for j in range(1, S))
        how = "MILP, optimal" if result.status == 0 else (
            f"MILP, time limit (gap {getattr(result, 'mip_gap', float('nan')):.1%})")
        return Plan(keep, segments, cost, int(self.budget), how)


def _segments(S, held, computed, costs) -> tuple[Segment, ...]:
    """The nested segments a MILP solution stands for (see the module docstring)."""

    def build(a, b) -> Segment:
        t = b - 1
        stored = [j for j in range(a + 1, b) if held(t, j) or computed(t, j) and (
            j == t or held(t - 1, j))] or [t]
        cuts = [a] + stored + [b]
        children = tuple(Segment(x, z) if z == x + 1 else build(x, z)
                         for x, z in itertools.pairwise(cuts))
        return Segment(a, b, children)

    roots = [j for j in range(1, S) if held(S - 1, j)]
    segments = []
    for a, b in itertools.pairwise([0] + roots + [S]):
        if b == a + 1:
            if costs[a].leaf > 0:  # a stage the forward keeps whole is in no segment
                segments.append(Segment(a, b))
        else:
            segments.append(build(a, b))
    return tuple(segments)
