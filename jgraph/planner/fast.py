"""The fast planner: nested checkpointing of the stage chain by dynamic programming, with a
knapsack-style choice of the values kept inside stages.

Keep sets. A value is worth keeping by what recomputing its eqn costs per byte it holds
(`jgraph.planner.cost`): dots and convolutions cost hundreds of flops per byte, a fused
elementwise op almost none. `keep_sets` offers the values above a few thresholds of that ratio
(none, contractions only, everything but fused elementwise ops, everything).

Segments. For one keep set, `chain_dp` finds the nesting of segments of least recompute cost
whose peak fits the budget in the chain model. It is the recursion of Revolve generalised to
stages of different costs and sizes (as Beaumont et al.'s Rotor does), over jgraph's regions:

    opt(s, t, m)   stages [s, t) recomputed from boundary s within m bytes
                 = leaf(s)                                            if t = s + 1
                 = min over s < u < t of  advance(s..u) + opt(u, t, m - b_u) + opt(s, u, m)
    root(s, m)     stages [s, S) that the forward computed, boundary s held
                 = min( stage s kept whole:   root(s + 1, m - kept_s - b_{s+1}),
                        a root checkpoint u:  root(u, m - b_u) + opt(s, u, m),
                        one segment:          opt(s, S, m) )

with memory counted in `UNITS` steps of the budget (rounded up: the DP never under-counts). On a
chain of equal stages it reaches Revolve's binomial optimum (`binomial_recompute`). Its cost is
O(S^3 x UNITS) for S stages (at most `jgraph.planner.chain.MAX_STAGES`). A plan's cost is its
recompute flops plus the memory traffic of what the forward keeps for the backward (`cost`).
"""

from __future__ import annotations

import math

import numpy as np

from jgraph.opkinds import nbytes
from jgraph.planner.chain import Stage, StageCost
from jgraph.planner.cost import KEPT_BYTE_COST, eqn_cost
from jgraph.planner.plan import Plan, Segment

UNITS = 256
MAX_UNITS = 1024
# Keep sets: the values whose recompute costs more flops per byte than the threshold.
# A contraction over K elements costs K/2 flops per byte of its f32 output, a memory-bound op
# about half a flop, a transcendental 0.05, a fused elementwise op 0.0125 (`cost`).
THRESHOLDS = {"keep nothing": math.inf, "keep contractions over 64 elements": 32.0,
              "keep contractions": 0.75, "keep all but fused elementwise": 0.02,
              "keep everything": -1.0}


def keep_sets(stages: list[Stage]) -> dict[str, frozenset]:
    """Candidate keep sets, by name, from the recompute cost per byte of each stage value
    (duplicates dropped)."""
    if not stages:
        return {"keep nothing": frozenset()}
    forward = stages[0].forward
    boundaries = {v for s in stages for v in s.boundary_out}  # the segments decide those
    values = [v for s in stages for v in s.values if v not in boundaries]
    ratio = {v: eqn_cost(forward.eqns[forward.producer[v]]) / max(nbytes(v.aval), 1)
             for v in values}
    found: dict[str, frozenset] = {}
    for name, theta in THRESHOLDS.items():
        keep = frozenset(v for v in values if ratio[v] > theta or theta < 0)
        if keep not in found.values():
            found[name] = keep
    return found


class ChainDP:
    """The DP tables of one keep set, for every budget up to `budget` (see the module
    docstring)."""

    def __init__(self, stages: list[Stage], costs: list[StageCost], budget: float):
        self.stages, self.costs = stages, costs
        S, self.S = len(stages), len(stages)
        self.unit, self.K = _units(stages, costs, budget)
        up = self._units
        self.b = [up(s.out_bytes) for s in stages]  # boundary after stage j
        self.boundary_cost = [KEPT_BYTE_COST * s.out_bytes for s in stages]
        # Kept values of the earlier stages are held while a stage's backward runs.
        before = np.concatenate([[0], np.cumsum([c.kept_bytes for c in costs])[:-1]])
        self.leaf_need = [up(k + c.leaf_peak) for c, k in zip(costs, before, strict=True)]
        self.whole_need = [up(k + c.whole_peak) for c, k in zip(costs, before, strict=True)]
        self.whole_held = [max(up(c.whole_bytes - c.kept_bytes), 0) for c in costs]
        # advance(s..u) = adv[u] - adv[s]
        self.adv = np.concatenate([[0.0], np.cumsum([c.advance for c in costs])])
        # opt[s, t]: the table of opt(s, t, .); shifted[u, t]: opt(u, t, . - b_{u-1}), the
        # right part of a split at u (cubes, so that a segment's splits are one array op)
        self.opt = np.full((S + 1, S + 1, self.K + 1), np.inf)
        self.shifted = np.full((S + 1, S + 1, self.K + 1), np.inf)
        self.choice = np.full((S + 1, S + 1, self.K + 1), -1, dtype=np.int16)
        m = np.arange(self.K + 1)
        # What a stage costs as a leaf: its recompute, and the traffic of what it keeps.
        self.leaf_cost = [c.leaf + KEPT_BYTE_COST * c.kept_bytes for c in costs]
        self.whole_cost = [KEPT_BYTE_COST * max(c.whole_bytes, c.kept_bytes) for c in costs]
        for s in range(S):
            self.opt[s, s + 1] = np.where(m >= self.leaf_need[s], self.leaf_cost[s], np.inf)
        self._shifted(np.arange(S), 1)
        for span in range(2, S + 1):
            self._segments(span)
        self._root()
        del self.opt, self.shifted  # the plans read the choices and the roots only

    def _units(self, x) -> int:
        return int(math.ceil(x / self.unit - 1e-9))

    def _shift(self, table, b):
        if b <= 0:
            return table
        out = np.full_like(table, np.inf)
        if b <= self.K:
            out[b:] = table[:self.K + 1 - b]
        return out

    def _shifted(self, s, span):
        """shifted[s, s + span] for the segments starting at the stages `s` (an array)."""
        s = s[s > 0]
        b = np.asarray(self.b, dtype=np.int64)[s - 1][:, None]
        at = np.arange(self.K + 1)[None, :] - b  # opt(s, t, m - b): inf where m < b
        table = self.opt[s, s + span][np.arange(len(s))[:, None], np.maximum(at, 0)]
        self.shifted[s, s + span] = np.where(at >= 0, table, np.inf)

    def _segments(self, span):
        """opt(s, s + span, .) for every s: each split u at once (the first cheapest wins a
        tie, as a scan over u would)."""
        s = np.arange(self.S - span + 1)[:, None]
        u = s + 1 + np.arange(span - 1)[None, :]
        cand = ((self.adv[u] - self.adv[s])[..., None] + self.shifted[u, s + span]
                + self.opt[s, u])
        arg = np.argmin(cand, axis=1)
        best = np.take_along_axis(cand, arg[:, None], axis=1)[:, 0]
        self.opt[s[:, 0], s[:, 0] + span] = best
        self.choice[s[:, 0], s[:, 0] + span] = np.where(np.isfinite(best), arg + s + 1, -1)
        self._shifted(s[:, 0], span)

    def _root(self):
        S = self.S
        m = np.arange(self.K + 1)
        self.root = [None] * (S + 1)
        self.root_choice = [None] * (S + 1)
        self.root[S] = np.zeros(self.K + 1)
        for s in range(S - 1, -1, -1):
            # stage s kept whole: its values held while the later stages' backward runs (and
            # its kept values, which the later stages' needs count already)
            held = self.whole_held[s] + (self.b[s] if s + 1 < S else 0)
            kept = self.whole_cost[s] + (self.boundary_cost[s] if s + 1 < S else 0)
            whole = np.where(m >= self.whole_need[s],
                             kept + self._shift(self.root[s + 1], held), np.inf)
            # a boundary u the forward keeps until the backward, or one segment to the end;
            # the first cheapest wins ties, "kept whole" first
            cand = [whole] + [self.boundary_cost[u - 1] + self._shift(self.root[u], self.b[u - 1])
                              + self.opt[s, u] for u in range(s + 1, S)] + [self.opt[s, S]]
            cand = np.stack(cand)
            arg = np.argmin(cand, axis=0)
            best = cand[arg, m]
            self.root[s] = best
            self.root_choice[s] = np.where(np.isfinite(best) & (arg > 0), arg + s, -1)

    def best(self, budget: float):
        """(cost, segments) of the cheapest plan within `budget` bytes, or None."""
        m = min(int(budget // self.unit), self.K)
        cost = self.root[0][m] if m >= 0 else np.inf
        if not np.isfinite(cost):
            return None
        return float(cost), tuple(self._root_segments(0, m))

    def smallest(self) -> float | None:
        """The fewest bytes any plan of this keep set needs (None: none fits the DP's budget)."""
        feasible = np.flatnonzero(np.isfinite(self.root[0]))
        return float(feasible[0] * self.unit) if feasible.size else None

    def _root_segments(self, s, m):
        segments = []
        while s < self.S:
            u = int(self.root_choice[s][m])
            if u == -1:
                m -= self.whole_held[s] + (self.b[s] if s + 1 < self.S else 0)
                s += 1
                continue
            segments.append(self._tree(s, u, m))
            if u < self.S:
                m -= self.b[u - 1]
            s = u
        return segments

    def _tree(self, s, t, m) -> Segment:
        if t == s + 1:
            return Segment(s, t)
        u = int(self.choice[s][t][m])
        left = self._tree(s, u, m)
        right = self._tree(u, t, m - self.b[u - 1])
        return Segment(s, t, (left, right))


def _units(stages, costs, budget) -> tuple[float, int]:
    """(bytes per unit, units in the budget): the greatest common divisor of the sizes when the
    budget holds at most `MAX_UNITS` of it (exact), else `UNITS` equal steps (sizes rounded up:
    the DP never under-counts)."""
    sizes = [s.out_bytes for s in stages] + [x for c in costs for x in (
        c.leaf_peak, c.whole_peak, c.kept_bytes, c.whole_bytes)]
    g = 0
    for x in sizes:
        g = math.gcd(g, int(x))
    if g and budget / g <= MAX_UNITS:
        return float(g), int(budget // g)
    return max(budget, 1) / UNITS, UNITS


class FastPlanner:
    """Chain DPs of a problem's stages, one per keep set, for budgets up to `max_budget`."""

    def __init__(self, stages: list[Stage], max_budget: float):
        self.tables = {name: (keep, ChainDP(stages, [s.measure(keep) for s in stages],
                                            max_budget))
                       for name, keep in keep_sets(stages).items()}

    def plans(self, budget: float) -> list[Plan]:
        """The cheapest plan of each keep set within `budget` bytes of the model."""
        found = []
        for name, (keep, dp) in self.tables.items():
            best = dp.best(budget)
            if best is not None:
                found.append(Plan(keep, best[1], best[0], int(budget), f"chain DP, {name}"))
        return found

    def smallest(self) -> tuple[float, Plan] | None:
        """(bytes, plan) of the plan needing the fewest bytes of the model."""
        found = [(b, name) for name, (_, dp) in self.tables.items()
                 if (b := dp.smallest()) is not None]
        if not found:
            return None
        least, name = min(found)
        keep, dp = self.tables[name]
        cost, segments = dp.best(least)
        return least, Plan(keep, segments, cost, int(least), f"chain DP, {name}")


def binomial_recompute(steps: int, slots: int) -> int:
    """Revolve's fewest forward steps to reverse `steps` equal steps with `slots` checkpoints
    beyond the initial state (Griewank 1992): r*l - beta(s + 1, r - 1), with r the least
    number of repetitions such that beta(s, r) = C(s + r, s) >= l."""
    r = 0
    while math.comb(slots + r, slots) < steps:
        r += 1
    return r * steps - math.comb(slots + 1 + r - 1, slots + 1)
