"""The planning loop: model, estimate, XLA, and back.

1. The budget in bytes (a percentage is of the no-remat compiled temp). If no remat fits it, the
   graph is returned without regions.
2. The joint graph is derived in each loop mode (`jgraph.planner.loops`; one mode for a graph
   without loops, or one no longer as `jg.backward` returned it) and cut into stages.
3. Each mode's target for the `jg.memory` estimate is the budget less what XLA allocates beyond
   the estimate in that mode without a plan (a scan's stacked gradients, layout copies; measured
   when a plan of the mode is first chosen), less a slack, 0 at first.
4. The planner (`fast` or `exact`) finds the cheapest plan of any mode within its target; the
   plan's graph is built and its `jg.memory` peak checked against the target; while it is over,
   the model's budgets shrink by the ratio and the planner runs again (`ESTIMATE_ROUNDS`).
5. The plan is compiled. When XLA's temp exceeds the budget, the slack grows by what was missed
   (at most halfway to what any mode can take); when a plan fits after a miss, the slack shrinks
   halfway back, in case a cheaper plan fits too (`XLA_RETRIES` compiles at most). A plan is
   returned only when XLA's temp is within the budget: never one above no remat.
6. Before giving up, each mode's plan needing the least memory is compiled, and so is each
   hand arrangement (`jgraph.planner.hand`: a checkpoint per layer with each of JAX's policies, a
   loop mode with no plan around it, as a user writes them); if none fits a byte budget, a
   TransformError states the smallest temp a plan reaches and that plan; for a percentage, that
   plan is returned with a `BudgetWarning` saying so (`info["remat"]["unmet"]`).
7. The exact planner then solves its MILP at the model budget of the plan found, for a cheaper
   plan (per-stage keep sets, no memory discretization), within what is left of its time limit;
   a cheaper plan that fits XLA's budget replaces it (`info["remat"]["milp"]` says what happened).
8. A hand arrangement that recomputes less (jgraph's cost model, on the rematerialized graphs)
   than the plan found and fits XLA's budget replaces it, so the search never loses to one.

On CPU and TPU "compiled" above means predicted by the model (`jgraph.memory.model`, calibrated
by the unplanned step's compile a percentage needs anyway), and only the plan returned is
compiled, to confirm it (`_confirmed`; `info["remat"]["confirmed"]`, `["model_temp"]`); a miss
corrects the model and plans once more, a second miss compiles every candidate as above. A byte
budget no plan meets on the model is the compiler's to decide only near it (`NEAR_MISS`); far
over it, the model's least plan alone is compiled, for the figure the error names
(`_compiled_least`).

`graph.info["remat"]` reports the planner, the budget, the estimate, XLA's temp (and no remat's),
the retries, the recompute flops, the plan, the seconds planning took and (apart) the seconds
XLA took to compile the plans it checked.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
import warnings

from jgraph.backward import backward, forward_of
from jgraph.errors import TransformError
from jgraph.ir import Graph, Var
from jgraph.memory.model import calibration
from jgraph.planner import fast, hand, loops, on_graph, validate
from jgraph.planner.cost import recompute_flops
from jgraph.planner.exact import AUTO_TIME_LIMIT, TIME_LIMIT, ExactPlanner, small_enough
from jgraph.planner.least import compiled_figure, least_plan
from jgraph.planner.plan import HAND, ON_GRAPH, Plan, Segment
from jgraph.planner.problem import Problem
from jgraph.planner.report import peak, reported
from jgraph.planner.validate import parse_budget
from jgraph.regions import without_regions
from jgraph.target import current

PLANNERS = ("auto", "exact", "fast")
ESTIMATE_ROUNDS = 6
XLA_RETRIES = 5
MARGIN = 0.98  # each tightening aims this much below what was missed
ON_GRAPH_SECONDS = 10.0  # planner="exact" schedules the graph itself at least this long


def problems(graph: Graph, rederive=None, traced: Graph | None = None) -> dict[str, Problem]:
    """The graph (regions stripped) in each loop mode, as problems, by mode. A step graph (an
    optimizer update or other untagged eqns appended to what `backward` returned) keeps its
    tail in every mode: the budget is the whole step's. `rederive` (Graph -> Graph: the loss
    head over chunks of rows, ...) rewrites each mode's joint graph before the tail is appended
    (`step_rewritten`); the first mode is then the graph as traced, rewritten (`traced`, when the
    caller has it)."""
    if traced is None:
        traced = without_regions(graph) if rederive is None else step_rewritten(graph, rederive)
    found = {"loops as traced": Problem.of(traced)}
    forward, tail = forward_and_tail(graph)
    if forward is None or not loops.has_loops(forward):
        return found
    for mode, (rewritten, policy) in loops.modes(forward).items():
        if mode != "loops as traced":
            derived = backward(rewritten, loop_policy=policy)
            derived = without_regions(derived if rederive is None else rederive(derived))
            derived = with_tail(derived, graph, tail) if tail else derived
            if derived is not None:
                found[mode] = Problem.of(derived.replace(info=traced.info), mode)
    return found


def step_rewritten(graph: Graph, rederive) -> Graph:
    """`graph` with `rederive` applied to what `backward` returned (its joint part) and its
    tail appended again: `graph` (regions stripped) when it was changed otherwise."""
    plain = without_regions(graph)
    forward, tail = forward_and_tail(graph)
    if forward is None:
        return plain
    again = without_regions(rederive(backward(forward) if tail else graph))
    step = with_tail(again, graph, tail) if tail else again
    if step is None:
        return plain
    info = {k: v for k, v in {**graph.info, **again.info}.items() if k != "backward_of"}
    return step.replace(info=info)


def forward_and_tail(graph: Graph):
    """(the forward `backward` derived `graph` from, the eqns appended since: an optimizer
    update, ...), or (None, ()) when `graph` was changed otherwise."""
    forward = forward_of(graph)
    if forward is not None:
        return forward, ()
    original, eqns = graph.info.get("backward_of", (None, None))
    n = len(eqns or ())
    if original is None or len(graph.eqns) <= n or any(
            a is not b for a, b in zip(graph.eqns, eqns, strict=False)):
        return None, ()
    tail = graph.eqns[n:]
    if any({"backward", "recompute"} & e.tags for e in tail):
        return None, ()
    return original, tail


def with_tail(derived: Graph, graph: Graph, tail) -> Graph | None:
    """`derived` (a joint graph derived again) with `graph`'s tail appended, reading
    `derived`'s inputs and outputs where the tail read `graph`'s at the same positions; None
    when the tail reads anything else of `graph`'s joint part."""
    n_in, n_out = len(derived.inputs), len(derived.outputs)
    if (graph.input_roles[:n_in] != derived.input_roles
            or graph.output_roles[:n_out] != derived.output_roles):
        return None
    subst = dict(zip(graph.inputs[:n_in], derived.inputs, strict=True))
    subst.update((old, new) for old, new in zip(graph.outputs[:n_out], derived.outputs,
                                                strict=True) if isinstance(old, Var))
    known = {*derived.inputs, *graph.inputs[n_in:], *subst.values()}
    eqns = []
    for e in tail:
        inputs = tuple(subst.get(a, a) if isinstance(a, Var) else a for a in e.inputs)
        if any(isinstance(a, Var) and a not in known for a in inputs):
            return None
        eqns.append(dataclasses.replace(e, inputs=inputs))
        known.update(e.outputs)
    extra = tuple(subst.get(a, a) if isinstance(a, Var) else a for a in graph.outputs[n_out:])
    if any(isinstance(a, Var) and a not in known for a in extra):
        return None
    return derived.replace(
        inputs=derived.inputs + graph.inputs[n_in:],
        input_roles=derived.input_roles + graph.input_roles[n_in:],
        eqns=derived.eqns + tuple(eqns), outputs=derived.outputs + extra,
        output_roles=derived.output_roles + graph.output_roles[n_out:],
        in_tree=graph.in_tree, out_tree=graph.out_tree)


def remat_under_budget(graph: Graph, budget, planner: str = "auto", finish=None,
                       reference: int | None = None, rederive=None,
                       calibrated_by: Graph | None = None) -> Graph:
    """See the module docstring. `finish` (Graph -> Graph, such as `jg.fuse_updates`) is
    applied to every graph a plan stands for, before XLA measures it: the plan space is that of
    the finished steps, and the graph returned is finished. `reference`: the no-remat temp a
    percentage budget is a share of, when `graph` is a rewrite of the graph the user gave (its
    loss head in chunks); `graph`'s own by default. `rederive`: a rewrite of `graph`'s joint
    part (the loss head over chunks of rows) planned in every loop mode (`problems`).
    `calibrated_by`: the unplanned graph whose compile calibrates the model (`_confirmed`), when
    `graph` is planned as a rewrite of it: the rewrite is predicted from that one compile
    (the values it shares follow XLA's decisions there), not compiled for a calibration of its
    own. With `finish`, the model is calibrated on the unplanned graph finished, the step as it
    runs: the graphs it predicts are finished too, and that step is compiled already (the
    percentage's reference, the fused updates' decision), so calibrating costs no compile."""
    started, validate.seconds = time.perf_counter(), 0.0
    if planner not in PLANNERS:
        raise TransformError(f"remat(planner={planner!r}): the planner is one of {PLANNERS}")
    kind, amount = parse_budget(budget)
    plain = without_regions(graph) if rederive is None else step_rewritten(graph, rederive)
    done = plain if finish is None else finish(plain)
    if kind == "fraction" and amount >= 1:  # all of no remat's temp: no remat, uncompiled
        return reported(done, {"planner": planner, "budget_given": budget}, "no remat",
                         peak(done), None, 0, 0.0, started)
    no_remat = xla_temp(plain) if reference is None else reference
    target = int(amount) if kind == "bytes" else int(amount * no_remat)
    def search():  # on the model's figures, or XLA's (`_confirmed`)
        report = {"planner": planner, "budget": target, "budget_given": budget,
                  "no_remat_temp": no_remat}
        finished = no_remat if done is plain and reference is None else xla_temp(done)
        if finished != no_remat:
            report["finished_temp"] = finished
        if finished <= target:  # (what it recomputes itself: a loop over chunks' backward)
            return reported(done, report, "no remat", peak(done), finished, 0,
                            recompute_flops(done), started)
        by_mode = problems(graph, rederive, plain)
        for problem in by_mode.values():
            problem.finish = finish
        used = _used(planner, by_mode)
        estimates = {m: peak(p.finished()) for m, p in by_mode.items()}
        # What XLA allocates beyond the estimate in a mode, whatever the plan (a scan's stacked
        # gradients, layout copies): the model's target is the budget less that. Measured on the
        # mode's graph when a plan of that mode is first chosen; until then, no remat's.
        offset = {m: None for m in by_mode} | {"loops as traced": finished - estimates[
            "loops as traced"]}
        room = {}
        for mode, problem in by_mode.items():
            problem.planner = _planner(used, problem, max(estimates[mode], target))
            least = problem.planner.smallest()
            room[mode] = -1 if least is None else target - offset["loops as traced"] - least[0]
        slack, fits, over, tried = 0.0, [], None, {}
        while len(tried) <= XLA_RETRIES:
            guess = offset["loops as traced"]
            budgets = {m: target - (guess if o is None else o) - slack for m, o in offset.items()}
            found = _fit_estimate(by_mode, budgets, used)
            if found is None:
                break
            plan, candidate, estimate = found
            if offset[plan.base] is None:  # calibrate this mode, then plan again
                offset[plan.base] = xla_temp(by_mode[plan.base].finished()) - estimates[plan.base]
                continue
            key = plan.describe()
            if key not in tried:
                tried[key] = xla_temp(candidate)
            temp = tried[key]
            if temp <= target:
                fits.append((plan.cost, temp, plan, candidate, estimate, slack))
                if over is None or over - slack <= 0.01 * target:
                    break
                slack = (slack + over) / 2  # a cheaper plan may fit with less slack
            else:
                over = slack
                least = min((f[5] for f in fits), default=None)
                most = max(room.values())
                if most < 0 or slack >= most:
                    break
                # More slack by what XLA missed; halfway to the known fit, or to the most slack
                # any mode can take (XLA's temp is not the estimate plus a constant).
                slack = ((slack + least) / 2 if least is not None else
                         min(slack + (temp - target) / MARGIN, (slack + most) / 2))
        hands = _hand_arrangements(by_mode)
        if fits:
            _, temp, plan, candidate, estimate, _ = min(fits, key=lambda f: (f[0], f[1]))
        else:  # the plans needing the least memory of each mode and the hand arrangements
            smallest = _smallest_plans(by_mode, tried) + _swept_plans(by_mode, tried) + [
                (plan, candidate, _temp(plan, candidate, tried)) for _, plan, candidate in hands]
            if planner == "exact":  # tried here once: its schedule is one more candidate
                on = _on_graph(by_mode["loops as traced"], float("inf"), target, tried, started)
                report["on_graph"] = on[0]
                if on[1] is not None:
                    smallest.append((on[1][0], on[1][1], on[1][3]))
            fitting = [s for s in smallest if s[2] <= target]
            if not fitting and kind == "fraction":
                return least_plan(done, smallest, report | {"used": used}, budget, tried, started)
            if not fitting:
                raise _unreachable(target, no_remat, tried, report.get("finished_temp"),
                                   min(smallest, key=lambda s: s[2], default=None), done)
            plan, candidate, temp = min(fitting, key=lambda s: (recompute_flops(s[1]), s[2]))
            estimate = peak(candidate)
        if used == "exact" and not plan.label.startswith(HAND):
            exact = _exactly(by_mode[plan.base], plan, target, tried, started, planner)
            report["milp"] = exact[0]
            if exact[1] is not None:
                plan, candidate, estimate, temp = exact[1]
        if planner == "exact" and "on_graph" not in report:
            on = _on_graph(by_mode[plan.base], recompute_flops(candidate), target, tried, started)
            report["on_graph"] = on[0]
            if on[1] is not None:
                plan, candidate, estimate, temp = on[1]
        # a hand arrangement doing less recompute than the plan found, if one fits
        found = _first_fitting(hands, recompute_flops(candidate), target, tried)
        if found is not None:
            plan, candidate, temp = found
            estimate = peak(candidate)
        return reported(candidate, report | {"used": used}, plan.describe(), estimate, temp,
                         len(tried) - 1, recompute_flops(candidate), started)

    with validate.at_budget(target):  # on TPU: a graph compiled at the budget's size
        calibrating = plain if calibrated_by is None else calibrated_by
        if finish is not None:  # the step as it runs, as every graph the model predicts is
            calibrating = finish(calibrating)  # (compiled already: the budget's reference)
            # a step fused on the model's word: the unfused step it was weighed against, whose
            # compile calibrated that model (`jgraph.remat._fused`), calibrates this one too
            calibrating = calibrating.info.get("unfused_step", calibrating)
        return _confirmed(search, calibrating, target)


def _confirmed(search, plain: Graph, target: int) -> Graph:
    """`search()`'s plan. On CPU and TPU the search weighs its candidates on the model
    (`jgraph.memory.model`, calibrated by the compile of the unplanned step `plain` a percentage
    needs anyway: on CPU the simulator, on TPU the compiler's buffer assignment to its first
    check), and only the plan it returns is compiled (on TPU at the budget's size): a miss
    corrects the model by what that compile showed and plans once more; a second miss, or no
    plan fitting the model, and every candidate is compiled, as on GPU."""
    if current().platform not in ("cpu", "tpu"):
        return search()
    fitted = calibration(plain, current())
    for _ in range(CONFIRMS):
        try:
            with warnings.catch_warnings(record=True) as said, validate.on_model(fitted):
                warnings.simplefilter("always")
                found = search()
        except TransformError as error:  # nothing fits the model
            compiled = _compiled_least(error, fitted)
            if compiled is not None:  # far over: its least plan compiled says so
                raise compiled from None
            break  # near the budget: the compiler decides
        info = found.info["remat"]
        if info.get("xla_temp") is None or "confirmed" in info:  # all of no remat's,
            return _said(found, said)  # uncompiled; or the least plans, compiled (`least_plan`)
        predicted = info["xla_temp"]
        if predicted > target:  # the model's least plan: the compiler decides
            break
        if _DEFERRED.get():  # compiled once the caller has chosen among its searches
            return _said(found.replace(info={**found.info, "remat": {
                **info, "confirmed": "deferred"}}), said)
        there = validate.xla_figures(found)
        if there.fits and there.budget_bytes <= target:
            return _said(_compiled(found, there), said)
        fitted = fitted.corrected(predicted, fitted.fit_of(there))
    return search()


_DEFERRED: contextvars.ContextVar = contextvars.ContextVar("jgraph_deferred", default=False)


@contextlib.contextmanager
def deferred():
    """Inside, a search whose plan fits the model returns it uncompiled
    (`info["remat"]["confirmed"] == "deferred"`, its `xla_temp` the model's): `jg.remat`
    weighs the plans of its attempts (the loss head whole and in chunks) on the model, and
    compiles only the one it takes (`confirm`), not one per attempt."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def confirm(graph: Graph) -> Graph | None:
    """A plan `deferred` returned, compiled (on TPU at its budget's size): the plan with the
    compiled figure where it meets its budget, None where it does not. Any other graph is
    returned as it is."""
    info = graph.info["remat"]
    if info.get("confirmed") != "deferred":
        return graph
    with validate.at_budget(info["budget"]):
        there = validate.xla_figures(graph)
    if not there.fits or there.budget_bytes > info["budget"]:
        return None
    return _compiled(graph, there)


def _compiled(plan: Graph, there) -> Graph:
    """`plan`, found on the model, with the figure its compile (`there`) showed."""
    info = plan.info["remat"]
    confirmed = {**info, "xla_temp": there.budget_bytes, "model_temp": info["xla_temp"],
                 "confirmed": there.hbm_mode or "compiled"}
    if info.get("plan") == "no remat" and "finished_temp" in info:
        confirmed["finished_temp"] = there.budget_bytes  # the finished step, compiled
    return plan.replace(info={**plan.info, "remat": confirmed})


def _said(graph: Graph, said: list) -> Graph:
    for w in said:  # what the search said, once it stands
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return graph


AUTO_MILP_FLOOR = 0.25  # seconds the MILP of planner="auto" may always take
CONFIRMS = 2  # plans made on the model and compiled, before every candidate is compiled


def _hand_arrangements(by_mode: dict) -> list[tuple[float, Plan, Graph]]:
    """(recompute flops, plan, graph) of each hand arrangement (`jgraph.planner.hand`), the
    least recompute first."""
    found = []
    for plan in hand.arrangements(by_mode):
        candidate = by_mode[plan.base].build(plan)
        flops = recompute_flops(candidate)
        found.append((flops, dataclasses.replace(plan, cost=flops), candidate))
    return sorted(found, key=lambda h: h[0])


def _temp(plan: Plan, candidate: Graph, tried: dict) -> int:
    key = plan.describe()
    if key not in tried:
        tried[key] = xla_temp(candidate)
    return tried[key]


def _first_fitting(hands, below: float, target: int, tried: dict):
    """(plan, graph, XLA temp) of the hand arrangement recomputing least, under `below` flops,
    whose compiled temp fits `target`; None if none does."""
    for flops, plan, candidate in hands:
        if flops >= below * (1 - 1e-9):
            return None
        temp = _temp(plan, candidate, tried)
        if temp <= target:
            return plan, candidate, temp
    return None


def _exactly(problem: Problem, plan: Plan, target: int, tried: dict, started: float,
             planner: str):
    """(what the MILP did, (plan, graph, estimate, XLA temp) or None): the MILP's plan within
    the model budget `plan` was found at, cheaper than `plan`, if it fits XLA's budget too."""
    if planner == "exact":
        seconds = max(TIME_LIMIT - (time.perf_counter() - started), 2.0)
    else:  # a refinement of the DP's plan: no longer than the compiles so far (planning's
        # time is weighed against one compile), at least `AUTO_MILP_FLOOR`, at most the limit
        seconds = min(max(AUTO_TIME_LIMIT - (time.perf_counter() - started), AUTO_MILP_FLOOR),
                      max(validate.seconds, AUTO_MILP_FLOOR))
    own = plan.cost - problem.base_cost  # what the MILP's objective counts
    exact = problem.planner.solve(plan.peak, bound=own * (1 - 1e-6), seconds=seconds)
    if exact is None:
        return f"no cheaper plan than the chain DP's within {seconds:.1f} s", None
    exact = dataclasses.replace(exact, base=plan.base, cost=exact.cost + problem.base_cost)
    candidate = problem.build(exact)
    estimate = peak(candidate)
    if exact.describe() not in tried:
        tried[exact.describe()] = xla_temp(candidate)
    if tried[exact.describe()] > target:
        return f"{exact.label}: its plan exceeds the budget on XLA", None
    return exact.label, (exact, candidate, estimate, tried[exact.describe()])


def _on_graph(problem: Problem, below: float, target: int, tried: dict, started: float):
    """(what it did, (plan, graph, estimate, XLA temp) or None): Checkmate's schedule of the
    coarsened graph (`jgraph.planner.on_graph`) within what is left of `TIME_LIMIT`, when its
    compiled step fits `target` recomputing less than `below` flops."""
    seconds = max(TIME_LIMIT - (time.perf_counter() - started), ON_GRAPH_SECONDS)
    found = on_graph.fitting(problem.graph, target, xla_temp, seconds, problem.finish)
    if found is None:
        return f"no schedule of the graph fits within {seconds:.0f} s", None
    graph, temp, schedule = found
    flops = recompute_flops(graph)
    label = (f"{ON_GRAPH}{schedule.recomputes} node recomputes ({schedule.solver} schedule, "
             f"{schedule.status})")
    plan = Plan(frozenset(), (), cost=flops, label=label, base=problem.base)
    tried[plan.describe()] = temp
    if flops >= below * (1 - 1e-9):
        return f"{label}: recomputes no less than the plan found", None
    return label, (plan, graph, peak(graph), temp)


def _used(planner: str, by_mode: dict) -> str:
    if planner != "auto":
        return planner
    return "exact" if all(small_enough(p) for p in by_mode.values()) else "fast"


def _fit_estimate(by_mode: dict, budgets: dict, planner: str):
    """(plan, its graph, its estimate) with the estimate within its mode's budget (or the last
    one tried), or None when no plan fits the model."""
    scale, last = dict.fromkeys(budgets, 1.0), None
    for _ in range(ESTIMATE_ROUNDS):
        plan = cheapest(by_mode, {m: b * scale[m] for m, b in budgets.items()}, planner)
        if plan is None:
            return last
        candidate = by_mode[plan.base].build(plan)
        estimate = peak(candidate)
        last = plan, candidate, estimate
        if estimate <= budgets[plan.base]:
            break
        # only this mode's stage model missed: a mode whose plans all miss (its loops hold
        # more than the stages say) must not shrink the others' budgets
        scale[plan.base] *= MARGIN * budgets[plan.base] / estimate
    return last


def _planner(used: str, problem: Problem, max_budget: float):
    if used == "exact":
        return ExactPlanner(problem, max_budget)
    return fast.FastPlanner(problem.stages, max(max_budget, 1.0))


def cheapest(by_mode: dict, budgets: dict, planner: str) -> Plan | None:
    """The cheapest plan of any loop mode within its mode's budget (bytes of the model)."""
    found = []
    for mode, problem in by_mode.items():
        if budgets[mode] > 0:
            found += [dataclasses.replace(p, base=mode, cost=p.cost + problem.base_cost)
                      for p in problem.planner.plans(budgets[mode])]
    order = list(by_mode)  # equal cost: the simpler loop mode (modes come simplest first)
    return min(found, key=lambda p: (p.cost, order.index(p.base), -len(p.keep)), default=None)


# Model budgets, as shares of a mode's estimate without remat, whose plans are measured when no
# plan fits on a target whose compiler the memory model is not (TPU, GPU): there the plan the
# model finds least is not the least XLA places (it stores values only products read in
# bfloat16, and schedules by its own rules).
SWEPT_SHARES = (0.2, 0.35, 0.5, 0.65, 0.8)


def _swept_plans(by_mode: dict, tried: dict):
    """(plan, graph, XLA's figure) of the cheapest plan of each mode at each of `SWEPT_SHARES`,
    on a target other than a CPU ([] on a CPU, whose compiler the model follows)."""
    if current().platform == "cpu":
        return []
    found = []
    for mode, problem in by_mode.items():
        top = peak(problem.finished())
        for share in SWEPT_SHARES:
            plan = cheapest({mode: problem}, {mode: share * top}, "fast")
            if plan is None:
                continue
            candidate = problem.build(plan)
            found.append((plan, candidate, _temp(plan, candidate, tried)))
    return found


def _smallest_plans(by_mode: dict, tried: dict):
    """(plan, graph, XLA temp) of the plan of each mode needing the least model memory, and of
    the plan recomputing each stage on its own (a checkpoint per layer), which XLA may place
    in less memory than the model's least."""
    found = []
    for mode, problem in by_mode.items():
        least = fast.FastPlanner(problem.stages, peak(problem.graph)).smallest()
        candidates = [] if least is None else [least[1]]
        if len(problem.stages) > 1:
            candidates.append(Plan(frozenset(), tuple(
                Segment(k, k + 1) for k in range(len(problem.stages))),
                cost=sum(problem.forward.cost), label="a segment per stage"))
        for plan in candidates:
            plan = dataclasses.replace(plan, base=mode, cost=plan.cost + problem.base_cost)
            candidate = problem.build(plan)
            if plan.describe() not in tried:
                tried[plan.describe()] = xla_temp(candidate)
            found.append((plan, candidate, tried[plan.describe()]))
    return found


def _unreachable(target: int, no_remat: int, tried: dict, unplanned: int | None = None,
                 smallest: tuple | None = None, done: Graph | None = None) -> TransformError:
    """The error for a budget no plan meets: the smallest temp a plan reaches, and how
    (`unplanned`: the temp of the graph as it runs without a plan, `done`, when it is finished;
    `smallest`: the least candidate `(plan, graph, figure)`, which `_compiled_least` compiles
    where the figures are the model's)."""
    unplanned = no_remat if unplanned is None else unplanned
    if not tried or min(tried.values()) >= unplanned:
        least, how = unplanned, f"{unplanned} bytes, without remat"
    else:
        key = min(tried, key=tried.get)
        least, how = tried[key], f"{tried[key]} bytes, with the plan: {key}"
    error = TransformError(
        f"remat(budget={target} bytes): no plan fits; the smallest compiled {current().word} a "
        f"plan reaches is {how} (no remat: {no_remat} bytes)")
    error.least_temp = least  # for a caller weighing several attempts (`jgraph.remat`)
    if least >= unplanned:  # the finished step without a plan (its figure the model's)
        smallest = None if done is None or unplanned == no_remat else (None, done, unplanned)
    error.least, error.figures = smallest, (target, no_remat, unplanned)
    return error


NEAR_MISS = 1.25  # the model's least plan this far over a byte budget: no plan is compiled


def _compiled_least(error: TransformError, fitted) -> TransformError | None:
    """The model's "no plan fits" (a byte budget), made the compiler's: its least plan compiled
    (one compile, where compiling every candidate took dozens: the scanned LM at vocab 32768,
    29 compiles, 63 s, for a least plan 3.7x over the budget) and named with that figure. None
    where it might fit after all (the model's least within `NEAR_MISS` of the budget, or
    compiled within it): every candidate is compiled then."""
    target, no_remat, unplanned = getattr(error, "figures", (None, None, None))
    least = getattr(error, "least", None)
    if target is None or error.least_temp <= NEAR_MISS * target:
        return None
    if least is None:  # no plan lowers the unplanned step, whose figure is compiled
        return error
    plan, graph, modelled = least
    compiled = compiled_figure(graph, modelled, target, fitted)
    if compiled <= target:
        return None
    if plan is None:  # the finished step without a plan
        return _unreachable(target, no_remat, {}, compiled)
    return _unreachable(target, no_remat, {plan.describe(): compiled}, unplanned)


def xla_temp(graph: Graph) -> int:
    """XLA's temp for `graph`, its compile time counted apart from the planning's."""
    started = time.perf_counter()
    try:
        return validate.xla_temp(graph)
    finally:
        validate.seconds += time.perf_counter() - started
