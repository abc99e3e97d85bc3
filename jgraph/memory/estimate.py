"""The memory model's driver: a graph -> XLA:CPU's temp bytes for its donated step, step by step.

    program  = step_program(graph)        kernels and buffers, as XLA fuses and sizes them
    order    = bfs_order(program)         the order XLA's scheduler runs them in
    placement = place(order, ...)         where XLA's buffer assignment puts each buffer

A loop's kernel holds, while it runs, its body's own peak (the same three steps on the body, its
carries being the loop's state) and the loop's small buffers; a cond the largest of its branches.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import dataclass

from jgraph import opkinds
from jgraph.ir import Eqn, Graph
from jgraph.memory.buffers import Placement, place
from jgraph.memory.program import Kernel
from jgraph.memory.schedule import bfs_order
from jgraph.memory.step import Program, body_program, step_program


@dataclass
class Estimate:
    program: Program
    order: list[Kernel]  # XLA's order of the kernels
    placement: Placement


def estimate(graph: Graph, decided: dict | None = None) -> Estimate:
    """`decided`: XLA's fusion decisions on the graph's values (`jgraph.memory.fusions`)."""
    # Kernels and values refer to each other: a large graph's estimate keeps tens of thousands
    # of objects alive while it runs (68k for a 10k-eqn graph), and each full collection they
    # trigger would sweep the whole heap again (1.7x the time). The heap as it stands is set
    # aside for the estimate (`gc.freeze`): collections still run, in every thread, over
    # everything allocated meanwhile, and what was set aside returns to the oldest generation.
    with _heap_set_aside():
        return _run(step_program(graph, _Workspace(), decided))


@contextlib.contextmanager
def _heap_set_aside():
    """`gc.freeze()` for the block, unless the program froze objects itself (its frozen heap is
    not swept anyway, and `gc.unfreeze` would undo its freeze) or turned the collector off."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _run(program: Program) -> Estimate:
    arguments = [v for v in program.values if v.kernel is None]
    order = bfs_order(program.kernels, arguments, program.results)
    placement = place(order, program.values, program.aliased, program.results)
    return Estimate(program, order, placement)


# A loop body's peak, by body (graphs are immutable) and (consts, carries, scan): the graphs a
# planner measures share their loops' bodies, which need measuring once.
_BODIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Workspace:
    """`workspace(eqn)`: the temp bytes an op holds while it runs; loops by their bodies."""

    def __init__(self):
        self.cache: dict[int, int] = {}

    def __call__(self, eqn: Eqn) -> int:
        if eqn.op not in opkinds.LOOPS:
            return opkinds.workspace(eqn)
        key = id(eqn)
        if key not in self.cache:
            self.cache[key] = self._loop(eqn)
        return self.cache[key]

    def _body(self, body: Graph, n_consts: int, n_carry: int, scan: bool) -> int:
        known = _BODIES.setdefault(body, {})
        if (n_consts, n_carry, scan) not in known:
            program = body_program(body, n_consts, n_carry, scan, self)
            known[n_consts, n_carry, scan] = _run(program).placement.peak + program.overhead
        return known[n_consts, n_carry, scan]

    def _loop(self, eqn: Eqn) -> int:
        p = eqn.params
        if eqn.op == "scan":
            return self._body(p["body"], p["num_consts"], p["num_carry"], True)
        if eqn.op == "cond":
            return max(self._body(b, len(b.inputs), 0, False) for b in p["branches"])
        body = self._body(p["body"], p["body_nconsts"], len(eqn.outputs), False)
        cond = self._body(p["cond_graph"], len(p["cond_graph"].inputs), 0, False)
        return max(body, cond)
