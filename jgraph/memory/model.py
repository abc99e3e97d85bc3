"""The model: a target's fit figure (`jgraph.target`) of any plan of a graph, from one compile.

A `Calibration` is made once per graph and target, from the *unplanned* step (the joint graph
without its checkpoint regions, the graph a plan is made from): its fit figure, compiled
(`compiled.read_figures`), beside the model's own figure of it. A plan of that graph is then
predicted without a full compile:
- CPU: jgraph's simulator of XLA:CPU (`estimate`: fusion, schedule and buffer assignment
  replayed on the graph), following the fusion decisions the compile showed for each value the
  plan shares with the unplanned step (`jgraph.memory.fusions`: which values XLA wrote to a
  buffer, which it fused into their readers), and scaled by the unplanned step's compiled temp
  over its simulated one: what XLA:CPU allocates beyond the simulator on a graph (layout
  copies, buffers it does not share) grows with what the graph keeps.
- TPU: the compiler's own buffer assignment, run only to its first HBM check: a compile at an
  HBM size of 1 MiB fails there, in 0.1-0.8 s where a full compile takes 5-25 s, naming the
  bytes of the HBM buffers (arguments, outputs, temps; `hbm.at_size`), and a second at 3/4 of
  that, where the compiler lays them out as near the fit size (`_tpu_buffers`); plus the code,
  as the unplanned step showed it (its exact figure less its buffers). Code is what it cannot
  see: it shrinks under a tight HBM size and differs a little between plans.
- GPU: not modelled yet (a clear error).

`python -m benchmarks.bench_memory --target cpu|tpu` prints its error per model and plan.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

from jgraph.errors import JGraphError
from jgraph.ir import Graph
from jgraph.memory.compiled import lowered_step, read_figures
from jgraph.memory.estimate import Estimate, estimate
from jgraph.memory.fusions import Fusions
from jgraph.memory.hbm import MIB
from jgraph.target import Target, TargetError

PROBE = MIB  # the HBM size a TPU's buffer assignment is run at: always too small, so it stops
NEAR = 0.75  # then again at this share of what it reported there (`_tpu_buffers`)


@dataclass(frozen=True)
class Calibration:
    """What one compile of the unplanned step taught the model on one target."""

    target: Target
    figure: int  # the unplanned step's fit figure, compiled (exact on TPU)
    modelled: int  # the model's own figure of the unplanned step (before calibration)
    fusions: Fusions | None = None  # XLA:CPU's fusion decisions on the unplanned step

    def simulate(self, graph: Graph) -> Estimate:
        """The simulator's run of `graph`, following the fusions the compile showed (CPU)."""
        return estimate(graph, self.fusions.on(graph) if self.fusions else None)

    def predict(self, graph: Graph, simulated: int | None = None) -> int:
        """The fit figure of `graph` (a plan of the unplanned graph) on the target;
        `simulated`: `simulate(graph)`'s figure, when the caller has it (CPU)."""
        if self.target.platform == "tpu":
            return _tpu_buffers(graph, self.target) + (self.figure - self.modelled)
        if simulated is None:
            simulated = self.simulate(graph).placement.peak
        return round(simulated * self.figure / self.modelled) if self.modelled else simulated

    def fit_of(self, compiled) -> int:
        """The fit figure a compile (`CompiledMemory`) says, as near as it says it: on TPU a
        compile failing at buffer assignment (`code_counted` False: an HBM size far under the
        need) names its buffers alone, and the code is added as the unplanned step showed it."""
        if compiled.code_counted:
            return compiled.budget_bytes
        return compiled.budget_bytes + max(self.figure - self.modelled, 0)

    def corrected(self, predicted: int, compiled: int) -> Calibration:
        """The model corrected by one compile of a plan it predicted at `predicted`: on TPU by
        the code (an offset), on CPU by the scale, so that plan is then predicted exactly."""
        if self.target.platform == "tpu":
            return dataclasses.replace(self, figure=self.figure + compiled - predicted)
        return dataclasses.replace(self, figure=round(self.figure * compiled / max(predicted, 1)))

    @property
    def describe(self) -> str:
        if self.target.platform == "tpu":
            return (f"TPU's buffer assignment + {(self.figure - self.modelled) / MIB:.2f} MiB of "
                    "code, calibrated by one compile")
        scale = self.figure / self.modelled if self.modelled else 1.0
        return f"XLA:CPU simulated, x{scale:.3f} as one compile showed"


_CALIBRATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def calibration(unplanned: Graph, target: Target) -> Calibration:
    """The calibration of the model on `unplanned` (the graph its plans are made from), compiled
    once per graph and kind of target."""
    if target.platform not in ("cpu", "tpu"):
        raise TargetError(
            f"jg.memory(target={target.describe()}): the memory model covers CPU and TPU; "
            f"{target.platform.upper()}'s figures come from jg.compiled_memory(graph, "
            "*args_or_avals, target=...)")
    known = _CALIBRATIONS.setdefault(unplanned, {})
    if target.key not in known:
        compiled = read_figures(lowered_step(unplanned, target))
        if target.platform == "tpu":
            known[target.key] = Calibration(target, compiled.budget_bytes,
                                            _tpu_buffers(unplanned, target))
        else:
            fitted = Calibration(target, compiled.budget_bytes, 0, Fusions.of(
                unplanned, compiled.materialised, compiled.fused, compiled.written))
            known[target.key] = dataclasses.replace(
                fitted, modelled=fitted.simulate(unplanned).placement.peak)
    return known[target.key]


def _tpu_buffers(graph: Graph, target: Target) -> int:
    """The HBM buffers of `graph`'s step as the compiler lays them out near its fit size. At an
    HBM size of 1 MiB the compiler schedules for the least memory it can reach, which can be
    well under what it lays out near the fit size, which is what counts (the scanned LM's
    `scan(checkpoint(body, dots_saveable))`: 78.7 MiB at 1 MiB; 86.2 at any size from 60 MiB up
    to its need, as in its compile at the fit size); so a second probe at `NEAR` of the first's
    figure, still under the need (a fast failure), reads them there."""
    lowered = lowered_step(graph, target)
    first = read_figures(lowered, hbm_limit=PROBE).hbm_bytes
    again = read_figures(lowered, hbm_limit=max(PROBE, int(NEAR * first)))
    return first if again.fits else again.hbm_bytes


def unplanned_of(graph: Graph, unplanned: Graph | None) -> Graph:
    """The graph `graph` is a plan of: `unplanned` if given, else the one `jg.remat` recorded
    (`info["unplanned"]`) when it takes the same inputs, else `graph` itself (its calibration
    is then its own compiled figure)."""
    if unplanned is None:
        unplanned = graph.info.get("unplanned")
        if unplanned is not None and not _same_inputs(graph, unplanned):
            unplanned = None
    elif not _same_inputs(graph, unplanned):
        raise JGraphError("jg.memory(unplanned=...): the unplanned graph takes other inputs "
                          "than the graph (give the joint graph its plans were made from)")
    return graph if unplanned is None else unplanned


def _same_inputs(a: Graph, b: Graph) -> bool:
    return (a.input_roles == b.input_roles
            and [v.aval for v in a.inputs] == [v.aval for v in b.inputs])
