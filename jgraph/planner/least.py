"""A percentage no plan meets: the plan reaching the least temp, ranked on the model and
confirmed by one or two compiles (`least_plan`), over every attempt of `jg.remat` together
(`pooled`, `least_of`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings

from jgraph.errors import BudgetWarning
from jgraph.ir import Graph
from jgraph.planner import validate
from jgraph.planner.cost import recompute_flops
from jgraph.planner.plan import HAND
from jgraph.planner.report import peak, reported
from jgraph.target import current

LEAST_COMPILED = 2  # of the plans the model puts least, where no plan meets a percentage (the
# second only where the model puts it within `validate.CLEAR` of the first: it cannot rank them)
SMALL_STEP = 2**16  # (and every hand arrangement, on a step of less temp: `least_plan`)


@dataclasses.dataclass
class Least:
    """One search's least plans where no plan meets a percentage, ranked on the model and not
    yet compiled (`pooled`): `ranked` holds `(plan, graph, model figure)`, `plain` the step
    without a plan; the rest is what `least_plan` reports with."""

    plain: Graph
    ranked: list
    report: dict
    budget: str
    tried: dict
    started: float
    info: dict = dataclasses.field(default_factory=dict)  # added to the plan returned
    fitted: object = None  # the model it was ranked on (`jgraph.memory.model.Calibration`)


_POOL: contextvars.ContextVar = contextvars.ContextVar("jgraph_least_pool", default=None)


@contextlib.contextmanager
def pooled():
    """Inside, a search meeting a percentage no plan reaches on the model compiles nothing: it
    puts its ranked least plans (`Least`) in the list yielded and returns the model's least plan
    (`info["remat"]["confirmed"] == "pooled"`); `least_of(pool)` then compiles the
    `LEAST_COMPILED` plans the model puts least over every search (`jg.remat`'s attempts with
    the loss head whole and in chunks: at most two compiles in all, not two per attempt)."""
    pool: list[Least] = []
    token = _POOL.set(pool)
    try:
        yield pool
    finally:
        _POOL.reset(token)


def least_plan(plain: Graph, smallest: list, report: dict, budget: str, tried: dict,
               started: float) -> Graph:
    """A percentage no plan reaches: the plan reaching the least temp (no remat when none
    lowers it), with a `BudgetWarning` naming both figures. On the model, the `LEAST_COMPILED`
    plans it puts least (the hand arrangements among the candidates) are compiled, and the
    least compiled is returned: one or two compiles, not one per candidate; on a step of less than
    `SMALL_STEP` of temp, where each buffer is a few alignments and the model ranks loosely,
    every hand arrangement of the step as given too (not of its chunked attempts: a
    transformer block of 0.6 MB compiled 29 plans, 0.5 s each, for one least plan). A byte
    budget is a hard limit (the memory a device has) and is an error instead; a percentage is
    a share of this graph's own temp, which on a small graph (parameters and gradients alone)
    nothing lowers.
    Inside `pooled()` the compiles wait for `least_of`."""
    if not validate.on_the_model():
        return _least_found(Least(plain, smallest, report, budget, tried, started), smallest,
                            None)
    least = Least(plain, _distinct(sorted(smallest, key=_model_order)), report, budget, tried,
                  started, fitted=validate.model_in_force())
    pool = _POOL.get()
    if pool is None:
        return least_of([least])
    pool.append(least)
    plan, candidate, figure = min(least.ranked, key=lambda s: s[2],
                                  default=(None, plain, report["no_remat_temp"]))
    return reported(candidate, report | {"confirmed": "pooled"}, "pooled", peak(candidate),
                     figure, len(tried) - 1, 0.0, started)


def least_of(pool: list[Least]) -> Graph:
    """The least plan of the searches in `pool` (`pooled`), the first of which is the step as
    given: the `LEAST_COMPILED` distinct plans the model puts least over all of them (and every
    hand arrangement of the first, where its step has less than `SMALL_STEP` of temp) compiled, on
    TPU at the budget's size, and the least compiled returned (`least_plan`), or the step without a
    plan where none lowers it."""
    first = pool[0]
    everything = _distinct(sorted(((p, c, f, least) for least in pool
                                   for p, c, f in least.ranked), key=_model_order))
    chosen = everything[:1] + [s for s in everything[1:LEAST_COMPILED]
                               if s[2] <= (1 + validate.CLEAR) * everything[0][2]]
    if first.report["no_remat_temp"] < SMALL_STEP:
        chosen += [s for s in everything[LEAST_COMPILED:]
                   if s[3] is first and s[0].label.startswith(HAND)]
    modelled = {id(c): f for _, c, f, _ in chosen}
    modelled[id(first.plain)] = first.report.get("finished_temp", first.report["no_remat_temp"])
    budget = first.report["budget"]
    compiled = [(p, c, compiled_figure(c, f, budget, least.fitted), least)
                for p, c, f, least in chosen]
    unplanned = (compiled_figure(first.plain, modelled[id(first.plain)], budget, first.fitted)
                 if "finished_temp" in first.report else first.report["no_remat_temp"])
    best = min(compiled, key=lambda s: s[2], default=None)
    least = first if best is None or best[2] >= unplanned else best[3]
    report = least.report | {"confirmed": "compiled"}
    if "finished_temp" in report:
        report["finished_temp"] = unplanned
    found = [(p, c, t) for p, c, t, s in compiled if s is least]
    graph = _least_found(dataclasses.replace(least, report=report), found, modelled,
                         unplanned)
    return graph if not least.info else graph.replace(info={**graph.info, "remat": {
        **graph.info["remat"], **least.info}})


def compiled_figure(graph: Graph, modelled: int, budget: int, fitted) -> int:
    """`graph`'s figure compiled, for a least plan: on TPU at the HBM size the model puts it at
    where that is over the budget (a compile at the budget's size fails there, and one far under
    the need fails at buffer assignment, before any code exists: what it names is neither the
    fit figure nor laid out as near it), its code added as the model knows it if it fails even
    there (`Calibration.fit_of`); elsewhere at the budget (its temp: the size changes nothing)."""
    with validate.on_model(None), validate.at_budget(max(budget, modelled)):
        there = validate.xla_figures(graph)
    return there.budget_bytes if fitted is None else fitted.fit_of(there)


def _least_found(least: Least, smallest: list, modelled: dict | None,
                 unplanned: int | None = None) -> Graph:
    """`least_plan`'s plan among `smallest` (`(plan, graph, compiled figure)`), and its warning."""
    plain, report, budget = least.plain, least.report, least.budget
    no_remat = report["no_remat_temp"]
    if unplanned is None:
        unplanned = report.get("finished_temp", no_remat)  # `plain` as it runs (finished)
    plan, candidate, temp = min(smallest, key=lambda s: s[2], default=(None, plain, unplanned))
    if temp >= unplanned:
        plan, candidate, temp = None, plain, unplanned
    if modelled is not None:
        report["model_temp"] = modelled.get(id(candidate), temp)
    how = "without remat" if plan is None else f"with the plan: {plan.describe()}"
    if temp > report["budget"]:  # (the model may have put a plan meeting it over it)
        warnings.warn(
            f"remat(budget={budget!r}): no plan reaches {report['budget']} bytes; returning "
            f"the smallest compiled {current().word} a plan reaches, {temp} bytes, {how} (no "
            f"remat: {no_remat} bytes)", BudgetWarning, stacklevel=4)
        report = report | {"unmet": True}
    return reported(candidate, report, "no remat" if plan is None else
                     plan.describe(), peak(candidate), temp, len(least.tried) - 1,
                     0.0 if plan is None else recompute_flops(candidate), least.started)


def _model_order(candidate) -> tuple:
    """How the model ranks a least plan `(plan, graph, figure, ...)`: its figure, then the less
    recompute (where the model sees no difference in memory, the faster plan; an adam step of an
    8-layer MLP: every arrangement at one figure, and the checkpoint per layer keeping its
    contractions, the least recompute of them, the least temp compiled too)."""
    return candidate[2], recompute_flops(candidate[1])


def _distinct(ranked: list) -> list:
    """`(plan, graph, figure)` candidates, one per arrangement: two plans reaching the same
    model figure with the same recompute (the DP's least plan and a checkpoint per stage, one
    mode's plan and another's) are one arrangement, compiled once."""
    seen, found = set(), []
    for s in ranked:
        key = (s[2], recompute_flops(s[1]))
        if key not in seen:
            seen.add(key)
            found.append(s)
    return found
