"""Rematerialization of any DAG of costed nodes: the solvers behind `schedule`.

The problem (Checkmate's; MOCCASIN's too), `Dag` and `replay` are in `jgraph.planner.dag_model`.
`schedule` returns a replayed `Schedule` whose peak fits the budget. Its schedules lie in
Checkmate's space: `order[t]` is first computed in stage t, and each stage first recomputes a set
of earlier nodes, each once, in `order` (MOCCASIN's space is the same, with at most two computes
per node; the fast solver may order a stage's recomputes depth first instead). A schedule is
then its stages: given them, the least memory holds a value only from a compute to its last use
before it is computed again (`_stage_events`), so every choice of stages is a valid schedule.

Solvers:
- `topological`: each node once, in `order`, freed after its last use. No schedule costs less;
  it is the answer whenever its peak fits the budget.
- `fast`: a greedy run through the stages. A stage computes its node after the missing values
  it needs, recursively, depth first; when a compute does not fit, it evicts a held value, the
  one with the largest memory x distance to its next need / cost to recompute it (Belady's rule
  weighed as in DTR, Kirisame et al. 2021; a value is needed when it or a missing reader of it
  is, and its recompute cost counts missing inputs a few levels up). Several weightings run,
  then random restarts (scores scaled per node) within the time limit; recomputes that the
  schedule fits without are dropped, and the cheapest schedule is kept.
- `exact`: Checkmate's MILP over the stages (binary R[t, i]: node i computed in stage t,
  S[t, i]: held into stage t), solved by HiGHS through `scipy.optimize.milp` with a time limit
  and bounded by the fast schedule's cost. Frees are continuous variables bounded by the
  binaries (a free can only help memory), and "used later in the stage" is a monotone chain per
  value, so the binaries are the only integers. Exact within the space above: its optimum is
  brute force's over the stages on tiny DAGs (tests/test_dag.py), solved without presolve
  (HiGHS 1.12's presolve spoils it now and then: issue 27).

`solver="auto"` takes the topological schedule when it fits, else the fast one (with restarts),
improved or proven optimal by the MILP when the graph is small enough (`EXACT_MAX_VARIABLES`).
`time_limit` (default `TIME_LIMIT`) bounds "auto"'s restarts and MILP together, and "exact"'s
MILP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from jgraph.errors import TransformError
from jgraph.planner.dag_model import (
    Dag,
    _Index,
    _peak,
    _stage_events,
    _stages_cost,
    _walk,
    replay,
)

TIME_LIMIT = 30.0  # seconds "auto" and "exact" may take, by default
FAST_SECONDS, FAST_RESTARTS = 10.0, 6  # solver="fast": its greedy restarts and their time
AUTO_RESTARTS = 200, 1000  # solver="auto": greedy restarts before the MILP, or without one
EXACT_MAX_VARIABLES = 100_000  # "auto" runs the MILP on problems up to this many variables
SMALL_MILP = 10_000  # ... and below this many, skips the greedy restarts: the MILP is quick
EXACT_HARD_LIMIT = 3_000_000  # "exact" refuses bigger MILPs (building them alone takes minutes)
SOLVERS = ("auto", "exact", "fast")
NOISE, NUDGE = 0.7, 0.3  # the spreads (log scale) of restarts' random factors: fresh, nudged
DEPTH = 4  # the eviction score counts the cost of absent inputs this many levels up
# (memory, distance, recompute cost) exponents of the eviction score m^a d^b / c^g, and whether
# a recompute visits a node's inputs last first
WEIGHTINGS = ((1, 1, 1, False), (1, 2, 1, False), (1, 1, 0.5, False), (1, 3, 1, False),
              (1, 2, 0.5, False), (0.5, 1, 1, False), (1, 2, 1, True))


@dataclass(frozen=True)
class Schedule:
    """A schedule, its replayed peak and cost, and how it was found."""

    events: tuple  # ("compute", node) and ("free", node), in order
    peak: float  # replayed: the largest resident memory over the computes
    cost: float  # replayed: the sum of the costs of all the computes
    budget: float  # the budget it was asked to fit
    solver: str  # "topological", "fast" or "exact"
    status: str  # "optimal" (proven: none of Checkmate's space costs less) or "feasible"
    seconds: float  # the time `schedule` took
    lower_bound: float | None = None  # no schedule of Checkmate's space costs less (proven)

    @property
    def recomputes(self) -> int:
        """Computes beyond the first of each node."""
        return sum(kind == "compute" for kind, _ in self.events) - len(
            {node for kind, node in self.events if kind == "compute"})


# --- the fast solver ---------------------------------------------------------------------------
def _reads(ix: _Index):
    """The sparse matrix whose row y has a one for each input of y."""
    from scipy import sparse  # heavy: imported when a schedule needs recomputes

    rows = [y for y in range(ix.n) for _ in ix.preds[y]]
    cols = [p for y in range(ix.n) for p in ix.preds[y]]
    return sparse.csr_array((np.ones(len(rows)), (rows, cols)), shape=(ix.n, ix.n))


def _closure(ix: _Index, t, resident, reverse) -> list:
    """t and the missing values it needs, recursively, in depth-first post-order (a value's
    inputs first, the last input first when `reverse`)."""
    stage, seen = [], {t}
    stack = [(t, iter(reversed(ix.preds[t]) if reverse else ix.preds[t]))]
    while stack:
        y, inputs = stack[-1]
        for p in inputs:
            if not resident[p] and p not in seen:
                seen.add(p)
                stack.append((p, iter(reversed(ix.preds[p]) if reverse else ix.preds[p])))
                break
        else:
            stack.pop()
            stage.append(y)
    return stage


def _simulate(ix: _Index, budget, weighting, noise=1.0) -> list | None:
    """One greedy run through the stages (see the module docstring); None if a stage's pinned
    values alone exceed the budget."""
    a, b, g, reverse = weighting
    n = ix.n
    output = np.asarray(ix.output)
    m = np.asarray(ix.memory, dtype=float)
    c = np.asarray(ix.cost, dtype=float)
    far = 4.0 * n
    next_use = np.array([s[0] if s else far for s in ix.succs], dtype=float)
    use_ptr = [0] * n
    # horizon[x]: the last position that may need x, through recomputes of its descendants
    horizon = [-1] * n
    for x in range(n - 1, -1, -1):
        horizon[x] = max((max(s, horizon[s]) for s in ix.succs[x]), default=-1)
        if ix.output[x]:
            horizon[x] = n
    readers = _reads(ix)
    src = np.array([p for y in range(n) for p in ix.preds[y]], dtype=np.int64)
    dst = np.array([y for y in range(n) for _ in ix.preds[y]], dtype=np.int64)
    resident = np.zeros(n, dtype=bool)
    pinned = np.zeros(n, dtype=np.int64)
    m_pow = m ** a
    memory = 0.0
    stages = []

    def drop(x):
        nonlocal memory
        resident[x] = False
        memory -= m[x]

    for t in range(n):
        stage = _closure(ix, t, resident, reverse)
        for y in stage:
            for p in ix.preds[y]:
                pinned[p] += 1
        for y in stage:
            while memory + m[y] > budget:
                candidates = resident & (pinned == 0) & ~output
                if not candidates.any():
                    return None
                absent = ~resident
                rebuild = c.copy()  # what recomputing each value costs, inputs absent to DEPTH
                needed = next_use.copy()  # a value is needed when an absent reader is
                for _ in range(DEPTH):
                    rebuild = c + readers @ (absent * rebuild)
                    np.minimum.at(needed, src, np.where(absent[dst], needed[dst], far))
                distance = np.maximum(needed - t, 1.0)
                score = noise * m_pow * distance**b / (rebuild + 1e-12) ** g
                score[~candidates] = -1.0
                drop(int(np.argmax(score)))
            resident[y] = True
            memory += m[y]
            for p in ix.preds[y]:
                pinned[p] -= 1
        stages.append(stage)
        for p in ix.preds[t]:
            use_ptr[p] += 1
            succ = ix.succs[p]
            next_use[p] = succ[use_ptr[p]] if use_ptr[p] < len(succ) else far
        for y in stage:
            for x in (*ix.preds[y], y):
                if resident[x] and horizon[x] <= t:
                    drop(x)
    return stages


def _profile(ix: _Index, stages):
    """The memory after each event of the stages' schedule, the end (event index) of each stage,
    and the index of the free ending each compute: {(node, stage computing it): index}."""
    level, ends, frees, computed_in = [], [0] * ix.n, {}, {}
    memory = 0
    for kind, x, t in _walk(ix, stages):
        if kind == "compute":
            memory += ix.memory[x]
            computed_in[x] = t
        else:
            memory -= ix.memory[x]
            frees[x, computed_in.pop(x)] = len(level)
        level.append(memory)
        ends[t] = len(level)
    return np.asarray(level, dtype=float), ends, frees


def _drop_recomputes(ix: _Index, stages, budget, deadline, exact=False) -> list:
    """Greedily remove recomputes, the most costly first, while the schedule still fits: without
    its compute in stage t, a value is held from its previous compute's free to the end of stage
    t (an upper bound on the memory it adds: its inputs may be freed earlier; `exact` replays
    the moves this bound refuses)."""
    stages = [list(s) for s in stages]
    moves = sorted(((ix.cost[i], t, i) for t, s in enumerate(stages) for i in s if i != t),
                   reverse=True)
    level, ends, frees = _profile(ix, stages)
    for _, t, i in moves:
        if time.monotonic() > deadline:
            break
        before = max(u for u in range(t) if i in stages[u])
        start = frees[i, before]
        trial = stages[t]
        stages[t] = [y for y in trial if y != i]
        if level[start:ends[t]].max(initial=0.0) + ix.memory[i] > budget and (
                not exact or _peak(ix, stages) > budget):
            stages[t] = trial
            continue
        level, ends, frees = _profile(ix, stages)
    return stages


def _fast(ix: _Index, budget, deadline, restarts=0, seed=0) -> list | None:
    """The cheapest stages found: a greedy run under each weighting, then `restarts` more (until
    the deadline) with the scores of each node scaled by random factors (half drawn afresh,
    the others nudging the cheapest run's), each improved by dropping recomputes; the cheapest
    two dropped again with exact replays. None if no run fits."""
    rng = np.random.default_rng(seed)
    runs, best = [], None  # best: (cost, weighting, noise) of the cheapest run
    for k in range(len(WEIGHTINGS) + restarts):
        if k >= len(WEIGHTINGS) and time.monotonic() > deadline:
            break
        weighting, noise = WEIGHTINGS[k % len(WEIGHTINGS)], np.ones(ix.n)
        if k >= len(WEIGHTINGS) and best is not None and k % 2:  # perturb the best run
            weighting, noise = best[1], best[2] * np.exp(NUDGE * rng.standard_normal(ix.n))
        elif k >= len(WEIGHTINGS):
            noise = np.exp(NOISE * rng.standard_normal(ix.n))
        stages = _simulate(ix, budget, weighting, noise)
        if stages is not None:
            stages = _drop_recomputes(ix, stages, budget, deadline)
            cost = _stages_cost(ix, stages)
            runs.append((cost, k, stages))
            if best is None or cost < best[0]:
                best = (cost, weighting, noise)
    if not runs:
        return None
    best = [_drop_recomputes(ix, stages, budget, deadline + 1.0, exact=True)
            for _, _, stages in sorted(runs)[:2]]
    best.sort(key=lambda stages: _stages_cost(ix, stages))
    # the greedy runs add memory in floats: the replay's exact sums decide
    return next((stages for stages in best if _peak(ix, stages) <= budget), None)


# --- the exact solver --------------------------------------------------------------------------


def _milp_size(ix: _Index) -> int:
    """About how many variables `_Milp` has: R and S, a free, a chain link and a memory level
    per use of a value in each stage."""
    useful = sum(bool(s) or o for s, o in zip(ix.succs, ix.output, strict=True))
    uses = sum(len(s) for s in ix.succs)
    return useful * ix.n + 3 * ix.n * (uses + ix.n) // 2


class _Milp:
    """Checkmate's MILP for one budget (see the module docstring). Positions: stage t computes
    t and may recompute any i < t that has a successor or is an output."""

    def __init__(self, ix: _Index, budget):
        self.ix, self.budget = ix, budget
        n = ix.n
        self.cost, self.integer = [], []
        useful = [bool(ix.succs[i]) or ix.output[i] for i in range(n)]
        self.R = {(t, i): self._var(ix.cost[i], 1) for t in range(n) for i in range(t)
                  if useful[i]}
        self.S = {(t, i): self._var(0.0, 1) for t in range(1, n) for i in range(t) if useful[i]}
        self.rows, self.lower, self.upper = [], [], []

    def _var(self, cost, integer) -> int:
        self.cost.append(cost)
        self.integer.append(integer)
        return len(self.cost) - 1

    def _row(self, terms, lower=-np.inf, upper=np.inf):
        self.rows.append(terms)
        self.lower.append(lower)
        self.upper.append(upper)

    def _r(self, t, i):
        """R[t, i] as (variable or None, constant)."""
        if i == t:
            return None, 1.0
        v = self.R.get((t, i))
        return (v, 0.0) if v is not None else (None, 0.0)

    def _s(self, t, i):
        if t == self.ix.n:
            return None, float(self.ix.output[i])
        v = self.S.get((t, i))
        return (v, 0.0) if v is not None else (None, 0.0)

    def _add(self, terms, lower, upper, *pairs):
        """A row over (coefficient, (variable, constant)) pairs: constants move to the bounds."""
        shift = 0.0
        for coef, (var, const) in pairs:
            if var is None:
                shift += coef * const
            else:
                terms.append((var, coef))
        if not terms:
            if lower - 1e-9 > shift or upper + 1e-9 < shift:
                raise _Infeasible
            return
        self._row(terms, lower - shift, upper - shift)

    def build(self, cost_bound=None):
        ix, inf = self.ix, np.inf
        m = [x / self.budget for x in ix.memory]  # memory in budgets: rows of order one
        for t in range(ix.n):
            positions = [k for k in range(t + 1) if k == t or (t, k) in self.R]
            for k in positions:  # a compute reads resident inputs
                for p in ix.preds[k]:
                    self._add([], -inf, 0.0, (1.0, self._r(t, k)), (-1.0, self._r(t, p)),
                              (-1.0, self._s(t, p)))
            for i in range(t + 1):  # held into the next stage: held or computed in this one
                if self._s(t + 1, i) == (None, 0.0):
                    continue
                self._add([], -inf, 0.0, (1.0, self._s(t + 1, i)), (-1.0, self._s(t, i)),
                          (-1.0, self._r(t, i)))
                if i < t and (t, i) in self.R and (t, i) in self.S:
                    self._row([(self.R[t, i], 1.0), (self.S[t, i], 1.0)], upper=1.0)
            frees = {k: [] for k in positions}  # frees[k]: (value, free variable) after k
            for i in range(t + 1):
                computed = self._r(t, i)
                if computed == (None, 0.0) and self._s(t, i) == (None, 0.0):
                    continue  # never resident in stage t
                keep = self._s(t + 1, i)
                if keep == (None, 1.0):
                    continue  # held to the next stage: never freed in this one
                users = [j for j in ix.succs[i] if j <= t and (j == t or (t, j) in self.R)]
                if users and users[-1] == t:  # used by t itself: freed after t only
                    slots = [t]
                else:
                    slots = ([i] if computed != (None, 0.0) else []) + users
                later = None  # the chain variable "some later user is computed"
                for k in reversed(slots):
                    f = self._var(0.0, 0)
                    frees[k].append((i, f))
                    self._add([(f, 1.0)], -inf, 0.0, (-1.0, self._r(t, k)))
                    self._add([(f, 1.0)], -inf, 1.0, (1.0, keep))
                    if later is not None:
                        self._row([(f, 1.0), (later, 1.0)], upper=1.0)
                    if k != i:  # k is a user: it joins the chain for earlier slots
                        link = self._var(0.0, 0)
                        self._add([(link, 1.0)], 0.0, inf, (-1.0, self._r(t, k)))
                        if later is not None:
                            self._row([(link, 1.0), (later, -1.0)], lower=0.0)
                        later = link
            level = None  # memory during the compute at the previous position
            previous = None
            for k in positions:
                u = self._var(0.0, 0)
                if level is None:
                    terms = [(u, 1.0)] + [(self.S[t, i], -m[i]) for i in range(t)
                                          if (t, i) in self.S]
                    self._add(terms, 0.0, 0.0, (-m[k], self._r(t, k)))
                else:
                    terms = [(u, 1.0), (level, -1.0)] + [(f, m[i]) for i, f in frees[previous]]
                    self._add(terms, 0.0, 0.0, (-m[k], self._r(t, k)))
                level, previous = u, k
        if cost_bound is not None and max(ix.cost) > 0:  # no worse than a known schedule
            scale = max(ix.cost)
            self._row([(v, ix.cost[i] / scale) for (t, i), v in self.R.items() if ix.cost[i]],
                      upper=cost_bound / scale)

    def solve(self, seconds, cost_bound=None):
        """(stages or None, status, dual bound on the recompute cost): HiGHS's status through
        `scipy.optimize.milp`, 0 optimal, 1 time limit, 2 infeasible."""
        from scipy import sparse  # heavy: imported when a MILP is solved
        from scipy.optimize import LinearConstraint, milp

        try:
            self.build(cost_bound)
        except _Infeasible:
            return None, 2, None
        nvar = len(self.cost)
        data, rows, cols = [], [], []
        for r, terms in enumerate(self.rows):
            for col, value in terms:
                rows.append(r)
                cols.append(col)
                data.append(value)
        matrix = sparse.csr_array((data, (rows, cols)), shape=(len(self.rows), nvar))
        scale = max(max(self.cost), 1e-30)
        cost = np.asarray(self.cost) / scale
        lower_rows, upper_rows = np.asarray(self.lower), np.asarray(self.upper)
        # no presolve: HiGHS 1.12's (SciPy 1.17's) spoils this MILP now and then, ending
        # "optimal" above the optimum, "infeasible" or in a solve error (issue 27)
        result = milp(cost, integrality=np.asarray(self.integer), bounds=(0.0, 1.0),
                      constraints=LinearConstraint(matrix, lower_rows, upper_rows),
                      options={"time_limit": max(float(seconds), 0.5), "mip_rel_gap": 1e-6,
                               "presolve": False})
        if result.x is None:
            return None, result.status, None
        x = result.x
        stages = [[t] for t in range(self.ix.n)]
        for (t, i), v in self.R.items():
            if x[v] > 0.5:
                stages[t].append(i)
        stages = [sorted(stage) for stage in stages]
        bound = getattr(result, "mip_dual_bound", None)
        bound = None if bound is None or not np.isfinite(bound) else bound * scale
        return stages, result.status, bound


class _Infeasible(Exception):
    pass


# --- the front door ----------------------------------------------------------------------------


def schedule(dag: Dag, budget, solver: str = "auto", time_limit: float | None = None) -> Schedule:
    """A schedule of `dag` whose peak is at most `budget`, at the least recompute cost found.

    `solver`: "auto" (topological if it fits, else fast with restarts, improved or proven optimal
    by the MILP on graphs small enough), "exact" (the MILP, with the fast schedule as its bound
    and fallback) or "fast" (a few greedy runs, seconds). `time_limit` (default `TIME_LIMIT`
    seconds) bounds "auto" as a whole and "exact"'s MILP. Raises `TransformError` when no
    schedule is found within the budget, naming the least peak possible and the least found."""
    return scheduled(dag, budget, solver, time_limit)


def scheduled(dag: Dag, budget, solver: str = "auto", time_limit: float | None = None,
              explain: bool = True) -> Schedule:
    """`schedule`; with `explain=False`, a budget no solver meets raises at once, without
    looking for the least peak the fast solver reaches (seconds) to name in the error."""
    start = time.monotonic()
    if not isinstance(dag, Dag):
        raise TransformError(f"schedule: dag is a {type(dag).__name__}, not a jg.planner.Dag")
    if solver not in SOLVERS:
        raise TransformError(f"schedule: solver={solver!r}; expected one of {SOLVERS}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer,
                                                           np.floating)) or not budget > 0:
        raise TransformError(f"schedule: budget={budget!r}; expected a number > 0")
    seconds = TIME_LIMIT if time_limit is None else float(time_limit)
    ix = dag._ix
    lower = dag.lower_bound()
    if budget < lower:
        raise TransformError(
            f"schedule: no schedule fits budget={budget}: the least peak possible is at least "
            f"{lower} (a node and all its inputs resident together; topological peak "
            f"{dag.topological_peak()})")
    topological = [[t] for t in range(ix.n)]

    def result(stages, solver_name, status, bound=None):
        events = tuple(_stage_events(ix, stages))
        measured = replay(dag, events)
        if measured.peak > budget:  # a bug if it happens: the solvers' memory model is replay's
            raise TransformError(f"schedule: the {solver_name} schedule peaks at "
                                 f"{measured.peak} > budget {budget} (internal error)")
        return Schedule(events, measured.peak, measured.cost, budget, solver_name, status,
                        time.monotonic() - start, bound)

    if _peak(ix, topological) <= budget:
        return result(topological, "topological", "optimal", dag.total_cost)
    size = _milp_size(ix)
    if solver == "exact" and size > EXACT_HARD_LIMIT:
        raise TransformError(
            f"schedule: the MILP of this {ix.n}-node graph has about {size} variables, more "
            f"than solver='exact' builds ({EXACT_HARD_LIMIT}); use solver='auto'")
    exact = solver == "exact" or solver == "auto" and size <= EXACT_MAX_VARIABLES
    milp = _Milp(ix, budget) if exact else None
    if solver == "fast":
        best = _fast(ix, budget, start + min(seconds, FAST_SECONDS), FAST_RESTARTS)
    elif solver == "exact":
        best = _fast(ix, budget, start + min(seconds, FAST_SECONDS))
    else:  # auto: the restarts share the time with the MILP, if any (none for a tiny MILP)
        restarts = AUTO_RESTARTS[milp is None] if size > SMALL_MILP or milp is None else 0
        best = _fast(ix, budget, start + seconds / (3 if milp else 1), restarts)
    name, status, bound = "fast", "feasible", None
    if milp is not None:
        base = dag.total_cost
        left = max(start + seconds - time.monotonic(), 1.0) if solver == "auto" else seconds
        cut = None if best is None else _stages_cost(ix, best) - base
        stages, code, dual = milp.solve(left, cut)
        if stages is not None and _peak(ix, stages) <= budget and (  # replay decides
                best is None or _stages_cost(ix, stages) <= _stages_cost(ix, best)):
            best, name = stages, "exact"
            status = "optimal" if code == 0 else "feasible"
            bound = None if dual is None else base + dual
        elif code == 2 and best is not None:  # nothing in Checkmate's space as cheap as best
            status, bound = "optimal", _stages_cost(ix, best)
    if best is None:
        raise TransformError(_no_schedule(dag, budget, lower) if explain else
                             f"schedule: no schedule found within budget={budget}")
    return result(best, name, status, bound)


def _no_schedule(dag: Dag, budget, lower) -> str:
    """The error for a budget no solver met, with the least peak the fast solver reaches."""
    ix = dag._ix
    top = least = dag.topological_peak()
    lo, hi = float(budget), float(top)
    for _ in range(12):  # bisect the budget the fast solver meets
        mid = (lo + hi) / 2
        stages = _fast(ix, mid, time.monotonic() + 2.0)
        if stages is None:
            lo = mid
        else:
            hi = mid
            least = min(least, _peak(ix, stages))
    return (f"schedule: no schedule found within budget={budget}; no schedule can peak below "
            f"{lower} (a node and all its inputs resident together), and the least peak found "
            f"is {least} (topological peak {top})")
