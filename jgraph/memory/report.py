"""`memory(graph)`: the memory report of a graph, and the saved residuals with their provenance.

The peak is the estimate of XLA:CPU's temp bytes (`temp_size_in_bytes`) for the graph's donated
training step, the counterpart of `jg.compiled_memory(graph, *args).temp_bytes`: arguments and
results are not temps (the donated parameters hold their updates), activations are counted as XLA
materialises them (a chain of elementwise ops fused into its reader is no buffer; a reshape is a
bitcast), in the order XLA's scheduler runs them, and a temp XLA places in a donated parameter's
allocation is not counted (`hidden_bytes`). See `jgraph.memory.estimate`.

The report follows the step in XLA's order (`schedule`, `timeline`: bytes live at each step,
`step_roles`) and per eqn of the graph (`live_bytes`, `materialised`). It lists the saved
residuals: the values the backward (or a recompute) reads from the forward, with their
provenance, as `print_saved_residuals` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import jax

from jgraph import config
from jgraph.check import validate
from jgraph.errors import JGraphError
from jgraph.ir import Graph, Var, short_aval
from jgraph.memory.estimate import estimate
from jgraph.memory.model import calibration, unplanned_of
from jgraph.opkinds import nbytes
from jgraph.plot import plot_memory
from jgraph.target import resolve


@dataclass(frozen=True)
class Residual:
    var: Var  # the forward value read by the backward
    provenance: str  # "from the argument [0]['w']", "named 'z' from f.py:3", "output of tanh ..."

    def __str__(self):
        return f"{short_aval(self.var.aval)} {self.provenance}"


@dataclass(frozen=True)
class MemoryReport:
    peak_bytes: int  # estimated XLA temp bytes of the donated step: the peak along the schedule
    peak_eqn: int  # index of the eqn running at the peak (-1: no eqns)
    live_bytes: tuple[int, ...]  # per eqn of the graph: temp bytes live while it runs
    argument_bytes: int  # bytes of the graph's inputs
    output_bytes: int  # bytes of the graph's outputs that eqns produce
    residuals: tuple[Residual, ...]  # forward values read by the backward, in schedule order
    materialised: tuple[bool, ...] = ()  # per eqn: its result is a buffer (not fused, no bitcast)
    schedule: tuple[int, ...] = ()  # XLA's order: the eqn each step computes last (-1: a copy of
    # a parameter, or an update the step adds)
    timeline: tuple[int, ...] = ()  # per step of `schedule`: temp bytes live while it runs
    step_roles: tuple[str, ...] = ()  # per step: forward, backward, recompute, update, copy
    hidden_bytes: int = 0  # temps XLA places in donated arguments' allocations (not counted)
    breakdown: Mapping[str, int] = field(default_factory=dict)  # the peak by what is live
    model: str = "XLA:CPU simulated"  # what `peak_bytes` is (`jgraph.memory.model` with target=)

    @property
    def residual_bytes(self) -> int:
        return sum(nbytes(r.var.aval) for r in self.residuals)

    def plot(self, path, *others: MemoryReport, labels=None, compiled=None, title=None):
        """Draw live bytes along the schedule to `path` (PNG, SVG, ...): forward, backward and
        recompute steps shaded, the peak marked, `others` (other plans) overlaid, and XLA's
        compiled temp bytes as a line when given (`compiled`: bytes, a `CompiledMemory`, or one
        per report). Needs matplotlib (`pip install 'jgraph[demo]'`)."""
        for r in others:
            if not isinstance(r, MemoryReport):
                raise JGraphError(f"MemoryReport.plot overlays other MemoryReports (from "
                                  f"jg.memory), got {type(r).__name__}")
        return plot_memory(path, (self, *others), labels=labels, compiled=compiled, title=title)

    def __str__(self):
        mib = 2**20
        lines = [f"peak {self.peak_bytes / mib:.2f} MiB at eqn {self.peak_eqn}, "
                 f"arguments {self.argument_bytes / mib:.2f} MiB, "
                 f"outputs {self.output_bytes / mib:.2f} MiB, "
                 f"{len(self.residuals)} saved residuals ({self.residual_bytes / mib:.2f} MiB):"]
        lines += [f"  {r}" for r in self.residuals]
        if self.breakdown:
            parts = ", ".join(f"{k} {v / mib:.2f}" for k, v in self.breakdown.items() if v)
            lines.append(f"at the peak (MiB): {parts or 'nothing'}; in donated buffers "
                         f"{self.hidden_bytes / mib:.2f} MiB")
        return "\n".join(lines)


BREAKDOWN = {"forward": "activations", "backward": "backward", "recompute": "recomputed",
             "copy": "parameter copies", "update": "updates"}


def peak_bytes(graph: Graph) -> int:
    """`memory(graph).peak_bytes`, without the report, and without checking the graph unless
    `jgraph.config.check_graphs` is on: for a planner measuring the many graphs it builds."""
    if config.check_graphs:
        validate(graph, "jg.memory")
    return estimate(graph).placement.peak


def memory(graph: Graph, *, target=None, unplanned: Graph | None = None) -> MemoryReport:
    """The memory report of `graph`: XLA:CPU's temp bytes for its donated step, simulated.

    Nothing is compiled (without `target=`): the simulator replays XLA:CPU's fusion, schedule and
    buffer assignment on the graph (`jgraph.memory`).

    Args:
        graph: a joint graph, a plan of one, or a training step.
        target: `jgraph.target` (CPU or TPU): `peak_bytes` is then the model's prediction of the
            target's fit figure (`jg.compiled_memory(graph, target=...).budget_bytes`),
            calibrated by one compile of the graph it is a plan of.
        unplanned: the graph that calibration compiles: by default the one `jg.remat` recorded,
            else `graph` itself (`jgraph.memory.model`).

    Returns:
        A `MemoryReport`: `peak_bytes`, `peak_eqn`, `timeline` and `step_roles` along XLA's
        schedule, `materialised` per eqn, `breakdown` of the peak, `residuals`, `model`;
        `.plot(path, *others)` draws it. The schedule, timeline and residuals are the
        simulator's either way."""
    validate(graph, "jg.memory")
    predicted = model = None
    if target is not None:
        fitted = calibration(unplanned_of(graph, unplanned), resolve(target))
        est = fitted.simulate(graph)
        predicted, model = fitted.predict(graph, est.placement.peak), fitted.describe
    else:
        est = estimate(graph)
    order, place, origin = est.order, est.placement, est.program.origin
    index = {e: i for i, e in enumerate(graph.eqns)}

    def graph_index(eqn) -> int:
        return index.get(origin.get(eqn, eqn), -1) if eqn is not None else -1

    n = len(graph.eqns)
    live: list[int | None] = [None] * n
    materialised = [False] * n
    schedule = []
    for step, k in enumerate(order):
        schedule.append(graph_index(k.root))
        if schedule[-1] >= 0:
            materialised[schedule[-1]] = True
        for e in k.eqns:
            i = graph_index(e)
            if i >= 0 and live[i] is None:
                live[i] = place.live[step]
    previous = 0
    for i in range(n):  # bitcasts and dead eqns: as the eqn before them
        live[i] = previous = previous if live[i] is None else live[i]
    breakdown = dict.fromkeys(BREAKDOWN.values(), 0)
    for v in place.at_peak:
        breakdown[BREAKDOWN[v.kernel.role]] += v.heap_size
    if place.peak_step >= 0:
        breakdown["workspace"] = order[place.peak_step].workspace
    outputs = {a for a in graph.outputs if isinstance(a, Var)}
    return MemoryReport(
        peak_bytes=place.peak if predicted is None else predicted,
        peak_eqn=_peak_eqn(schedule, place.peak_step),
        live_bytes=tuple(live),
        argument_bytes=sum(nbytes(v.aval) for v in graph.inputs),
        output_bytes=sum(nbytes(v.aval) for v in outputs - set(graph.inputs)),
        residuals=tuple(saved_residuals(graph)),
        materialised=tuple(materialised),
        schedule=tuple(schedule),
        timeline=tuple(place.live),
        step_roles=tuple(k.role for k in order),
        hidden_bytes=sum(v.size for v in place.hidden),
        breakdown=breakdown,
        **({} if model is None else {"model": model}),
    )


def _peak_eqn(schedule, step) -> int:
    """The graph eqn of the peak step, or of the nearest step with one (a copy or an update)."""
    if step < 0:
        return -1
    for i in sorted(range(len(schedule)), key=lambda i: (abs(i - step), i)):
        if schedule[i] >= 0:
            return schedule[i]
    return -1


def saved_residuals(graph: Graph) -> list[Residual]:
    """Forward values (and inputs) read by backward or recompute eqns, with provenance."""
    producer = {v: e for e in graph.eqns if not ({"backward", "recompute"} & e.tags)
                for v in e.outputs}
    arg_names = _argument_names(graph)
    found, out = set(), []
    for eqn in graph.eqns:
        if not ({"backward", "recompute"} & eqn.tags):
            continue
        for a in eqn.inputs:
            if not isinstance(a, Var) or a in found or not (a in producer or a in arg_names):
                continue
            found.add(a)
            out.append(Residual(a, _provenance(a, producer.get(a), arg_names)))
    return out


def _argument_names(graph: Graph) -> dict[Var, str]:
    if graph.in_tree is None:
        return {v: f"[{k}]" for k, v in enumerate(graph.inputs)}
    tree = jax.tree.unflatten(graph.in_tree, list(range(len(graph.inputs))))
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {graph.inputs[k]: jax.tree_util.keystr(path) for path, k in paths}


def _provenance(v: Var, eqn, arg_names) -> str:
    if eqn is None:
        return f"from the argument {arg_names[v]}"
    where = f" from {eqn.source}" if eqn.source else ""
    if eqn.op == "name":
        return f"named {eqn.params.get('name')!r}{where}"
    return f"output of {eqn.op}{where}"
