"""The Optimizer's `remat=`: regions, a policy, or a budget, applied to its gradient micro-step.

Regions and policies apply to the backward graph, before `accumulate`. A budget plans the step
that runs: with a period, `grad_step` plans both the accumulated step and the backward step
before accumulation (whose nesting XLA may place in less memory once accumulation is added),
compiles both accumulated steps, and keeps the cheapest that fits the budget, or else the one
XLA places in the least temp (`info["remat"]["xla_temp"]` is then that step's).
"""

from __future__ import annotations

import warnings

from jgraph.errors import BudgetWarning, TransformError
from jgraph.ir import Graph
from jgraph.planner.search import xla_temp
from jgraph.remat import remat as remat_transform


def apply_remat(graph: Graph, remat):
    if remat is None or remat is False:
        return graph
    if remat is True:
        return remat_transform(graph)
    if isinstance(remat, dict):
        return remat_transform(graph, **remat)
    return remat_transform(graph, policy=remat)


def grad_step(bwd: Graph, remat, accumulate) -> Graph:
    """The gradient micro-step: `accumulate(graph)` (None: no period) of `bwd` with `remat`."""
    if accumulate is None:
        return apply_remat(bwd, remat)
    if not (isinstance(remat, dict) and remat.get("budget") is not None):
        return accumulate(apply_remat(bwd, remat))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BudgetWarning)
        on_step = apply_remat(accumulate(bwd), remat)
        report = on_step.info["remat"]
        if report.get("xla_temp") is None or (report["plan"] == "no remat"
                                               and not report.get("unmet")):
            return _warned(on_step, caught)  # nothing to plan, or no remat fits
        try:
            before = accumulate(apply_remat(bwd, remat))
        except TransformError:
            return _warned(on_step, caught)
    budget, planned = report["budget"], before.info.get("remat") or {}
    other = before.replace(info={**before.info, "remat": {
        **planned, "budget": budget, "xla_temp": xla_temp(before),
        "planned_on": "the backward step, before accumulation"}})
    steps = [on_step, other]
    fitting = [g for g in steps if g.info["remat"]["xla_temp"] <= budget]
    if fitting:
        chosen = min(fitting, key=lambda g: g.info["remat"].get("recompute_flops", 0.0))
    else:
        chosen = min(steps, key=lambda g: g.info["remat"]["xla_temp"])
    unmet = None if fitting else True
    chosen = chosen.replace(info={**chosen.info, "remat": {
        **chosen.info["remat"], "unmet": unmet}})
    return _warned(chosen, caught)


def _warned(graph: Graph, caught) -> Graph:
    """`graph`, warning again (once) the BudgetWarning caught if its budget is unmet."""
    remat = graph.info.get("remat") or {}
    if remat.get("unmet"):
        message = next((str(w.message) for w in caught if issubclass(w.category, BudgetWarning)),
                       f"remat: the budget of {remat.get('budget')} bytes is not reachable")
        if remat.get("planned_on"):
            message += (f" (kept: the plan made {remat['planned_on']}, {remat['xla_temp']} bytes "
                        "of XLA temp on the accumulated step)")
        warnings.warn(message, BudgetWarning, stacklevel=4)
    return graph
