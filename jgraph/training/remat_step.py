"""The Optimizer's `remat=`: regions, a policy, or a budget, applied to its gradient micro-step.

Regions and policies apply to the backward graph, before `accumulate`. A budget plans the step
that runs: with a period, `grad_step` plans both the accumulated step and the backward step
before accumulation (whose nesting XLA may place in less memory once accumulation is added),
compiles both accumulated steps, and keeps the cheapest that fits the budget, or else the one
XLA places in the least temp (`info["remat"]["xla_temp"]` is then that step's).

The step that ends a period (the update appended) is planned too (`period_step`), guard
included: it holds the params, optimizer state and accumulators at once.

Without a period, the optimizer step is the step that runs: `whole_step` leaves its gradients
out (nothing reads them; the update fused where they are made then leaves no stacked gradient)
and plans a budget on the whole step, update included.
"""

from __future__ import annotations

import warnings

from jgraph.errors import BudgetWarning, TransformError
from jgraph.fuse import without_grads
from jgraph.ir import Graph
from jgraph.planner.search import xla_temp
from jgraph.remat import planned_then
from jgraph.remat import remat as remat_transform
from jgraph.target import measuring_on
from jgraph.training.guard import unguarded
from jgraph.training.optimizer_step import optimizer_step


def apply_remat(graph: Graph, remat):
    if remat is None or remat is False:
        return graph
    if remat is True:
        return remat_transform(graph)
    if isinstance(remat, dict):
        return remat_transform(graph, **remat)
    return remat_transform(graph, policy=remat)


def grad_step(bwd: Graph, remat, accumulate, whole: bool = False, guard=None) -> Graph:
    """The gradient micro-step: `accumulate(graph)` (None: no period) of `bwd` with `remat`.
    `whole`: the step that runs is the optimizer step, a budget is planned there
    (`whole_step`), so the gradient step is `bwd` with no plan. `guard` (Graph -> Graph that
    `guard_nonfinite`s; None: none): how the accumulated step runs. A budget is planned and
    measured on the guarded step (the guard keeps the old accumulator beside the new, and XLA
    allocates that too); the step returned is left unguarded."""
    if whole and isinstance(remat, dict) and remat.get("budget") is not None:
        return bwd
    if accumulate is None:
        return apply_remat(bwd, remat)
    if not (isinstance(remat, dict) and remat.get("budget") is not None):
        return accumulate(apply_remat(bwd, remat))
    runs = (lambda g: g) if guard is None else guard  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BudgetWarning)
        on_step = _planned(accumulate(bwd), remat, guard)
        report = on_step.info["remat"]
        if report.get("xla_temp") is None or (report["plan"] == "no remat"
                                               and not report.get("unmet")):
            return _warned(on_step, caught)  # nothing to plan, or no remat fits
        try:
            before = accumulate(apply_remat(bwd, remat))
        except TransformError:
            return _warned(on_step, caught)
    budget, planned = report["budget"], before.info.get("remat") or {}
    with measuring_on(remat.get("target")):
        figure = xla_temp(runs(before))
    other = before.replace(info={**before.info, "remat": {
        **planned, "budget": budget, "xla_temp": figure,
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


def _planned(step: Graph, remat: dict, guard) -> Graph:
    """`step` planned under `remat`'s budget as `guard(step)` runs (a percentage is of the
    guarded step), returned unguarded."""
    if guard is None:
        return apply_remat(step, remat)
    return unguarded(planned_then(step, guard, **remat))


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


def period_step(bwd: Graph, opt: Graph, accumulate, tx, remat, guard) -> Graph:
    """The step that ends a period (`opt`: the accumulated micro-step with the update appended)
    as it runs, `guard` (Graph -> Graph; None: none) last. A budget is planned on it too, guard
    included (a percentage of its own temp without remat): it reads the accumulators and writes
    the params and optimizer state, and with "raise" or "skip" keeps the old state beside the
    new, so it can need more than the micro-steps planned by `grad_step`."""
    if not (isinstance(remat, dict) and remat.get("budget") is not None):
        return opt if guard is None else guard(opt)
    step = optimizer_step(accumulate(bwd), tx)
    return apply_remat(step, remat) if guard is None else planned_then(step, guard, **remat)


def one_warning(caught, stacklevel: int = 4) -> None:
    """Warn again what `warnings.catch_warnings(record=True)` caught: the BudgetWarnings of the
    steps planned as one (each step's message), the others as they were."""
    budgets = [str(w.message) for w in caught if issubclass(w.category, BudgetWarning)]
    for w in caught:
        if not issubclass(w.category, BudgetWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if len(budgets) == 1:
        warnings.warn(budgets[0], BudgetWarning, stacklevel=stacklevel)
    elif budgets:
        warnings.warn(f"remat: {len(budgets)} steps miss the budget: the micro-step: {budgets[0]}"
                      f"; the step ending the period: {'; '.join(budgets[1:])}", BudgetWarning,
                      stacklevel=stacklevel)


def whole_step(bwd: Graph, opt: Graph, tx, remat, guard) -> Graph:
    """The optimizer step of period 1 (`opt`: the update appended to `bwd` with `remat`)
    without its gradients, `None` in their place, then `guard` (Graph -> Graph: the non-finite
    guard; None: none). A budget is planned on the whole step as it runs, guard included
    (`jg.remat` of it: loop modes, fused updates, the loss head in chunks) instead: the guard
    keeps the old params and state beside the new until the step is known finite, and XLA
    allocates that too."""
    if not (isinstance(remat, dict) and remat.get("budget") is not None):
        step = without_grads(opt, placeholder=True)
        return step if guard is None else guard(step)
    step = without_grads(optimizer_step(bwd, tx), placeholder=True)
    return apply_remat(step, remat) if guard is None else planned_then(step, guard, **remat)
