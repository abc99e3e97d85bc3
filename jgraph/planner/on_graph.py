"""Checkmate on the joint graph itself (Jain et al., MLSys 2020): the graph coarsened into a `Dag`
of eqn groups, scheduled by `jgraph.planner.dag.schedule` (its MILP, bounded by the fast
schedule), and the schedule read back as an ordinary graph with recompute eqns.

The chain model (`chain`) plans nested segments over a chain of stages and counts a value that
crosses several cuts (a long skip) once per cut held; the hand arrangements (`hand`) are what a
user writes. Here a value counts once wherever its readers are, and any schedule of the DAG is a
plan, nested or not:
- *nodes*: the forward cut before and after each contraction or loop (`chain.expensive`) and
  at the best cut of each valley of cheap eqns between them (`chain.valley_cuts`), so that
  keeping a contraction's output and recomputing the cheap eqns after it (`dots_saveable`) is a
  schedule; at most `MAX_FORWARD_NODES` (thinned evenly by cost). The rest of the graph (the
  backward, and a tail such as an optimizer update) is cut, in its own order, where it first
  reads each forward node. A node's memory is the bytes of its values
  other nodes read (the graph's inputs and outputs are no temp, and the forward's constants are
  kept); its cost, its eqns' recompute flops (`cost.eqn_cost`). A node that must not run twice
  (the backward's: it accumulates; a stateful RNG; an effect) costs `NEVER` times the forward,
  so a schedule runs it again only when nothing else fits, and such a schedule is refused.
- *read back* (`Coarse.graph_of`): the computes in the schedule's order. A node's first compute
  emits its own eqns, a later one a copy of them tagged `recompute` and `no_cse`, as
  `jgraph.regions` emits a region's recompute (`jgraph.lower` keeps XLA from merging the copy
  into the original or running it early); every eqn reads the latest copy of each value. The
  frees are implicit: a copy lives until its last reader, as `replay` holds it.
- *checked on XLA* (`fitting`): the Dag's budget is the byte budget less what XLA allocates
  beyond the Dag's topological peak (the graph as it runs without a plan: cotangents inside a
  node, layout copies), or scaled by their ratio when the Dag counts more than XLA allocates
  (a node's values are held together; XLA frees each after its last reader): the smaller. When
  the compiled plan misses the byte budget, the Dag's budget shrinks by the ratio missed and the
  DAG is scheduled again (`ROUNDS`).
"""

from __future__ import annotations

import dataclasses
import time

from jgraph import ops
from jgraph.errors import TransformError
from jgraph.ir import Eqn, Graph, Var
from jgraph.opkinds import nbytes
from jgraph.passes import dce
from jgraph.planner.chain import Forward, expensive, thinned, valley_cuts
from jgraph.planner.cost import eqn_cost
from jgraph.planner.dag import scheduled
from jgraph.planner.dag_model import Dag
from jgraph.regions import NEVER_RECOMPUTED, prune_recomputed_loops

MAX_FORWARD_NODES = 64  # the MILP grows as the square of the nodes
NEVER = 1000.0  # a node that must not run twice costs this many times the whole forward
ROUNDS = 3  # schedules solved and compiled, each at a tighter Dag budget than the last missed
MARGIN = 0.98  # each tightening aims this much below what was missed
RECOMPUTE_TAGS = frozenset({"recompute", "no_cse"})


@dataclasses.dataclass(eq=False)
class Coarse:
    """A joint graph as a Dag: node i runs the eqns `nodes[i]`."""

    graph: Graph
    nodes: list[tuple[Eqn, ...]]
    repeatable: list[bool]  # node i may run again (a forward node without effects)
    dag: Dag

    def graph_of(self, events) -> Graph | None:
        """The graph running the computes of `events` (a schedule of `dag`) in their order, or
        None when it runs a node again that must not run twice."""
        latest: dict[Var, Var] = {}  # a value -> its latest copy

        def read(atoms):
            return tuple(latest.get(a, a) if isinstance(a, Var) else a for a in atoms)

        computed, eqns = set(), []
        for kind, i in events:
            if kind != "compute":
                continue
            again = i in computed
            if again and not self.repeatable[i]:
                return None
            computed.add(i)
            for eqn in self.nodes[i]:
                inputs = read(eqn.inputs)
                if not again:
                    same = all(x is a for x, a in zip(inputs, eqn.inputs, strict=True))
                    eqns.append(eqn if same else dataclasses.replace(eqn, inputs=inputs))
                    continue
                outputs = tuple(Var(v.aval) for v in eqn.outputs)
                latest.update(zip(eqn.outputs, outputs, strict=True))
                eqns.append(dataclasses.replace(eqn, inputs=inputs, outputs=outputs,
                                                tags=RECOMPUTE_TAGS, regions=()))
        graph = self.graph.replace(eqns=tuple(eqns), outputs=read(self.graph.outputs))
        return prune_recomputed_loops(dce(graph))


def coarsen(graph: Graph, max_forward: int = MAX_FORWARD_NODES) -> Coarse | None:
    """`graph` (a joint graph without regions) as a `Coarse` DAG (the module docstring), or None
    when it has no forward or nothing after it."""
    forward = Forward(graph)
    n = len(forward.eqns)
    rest = graph.eqns[n:]
    if n == 0 or not rest:
        return None
    contractions = {k + 1 for k, e in enumerate(forward.eqns[:-1]) if expensive(e)}
    cuts = sorted(contractions.union(k + 1 for k in valley_cuts(forward)))
    if len(cuts) + 1 > max_forward:
        cuts = thinned(forward, cuts, max_forward - 1)
    bounds = [0, *cuts, n]
    nodes = [tuple(forward.eqns[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    node_of = {v: i for i, eqns in enumerate(nodes) for e in eqns for v in e.outputs}
    starts, seen = {0}, set()
    for p, eqn in enumerate(rest):
        for a in eqn.inputs:
            if isinstance(a, Var) and node_of.get(a, -1) not in seen | {-1}:
                seen.add(node_of[a])
                starts.add(p)
    starts = sorted(starts)
    nodes += [tuple(rest[a:b]) for a, b in zip(starts, [*starts[1:], len(rest)], strict=True)]
    forward_nodes = len(bounds) - 1
    repeatable = [i < forward_nodes and not any(
        e.op in NEVER_RECOMPUTED or ops.has_effects(e) for e in eqns)
        for i, eqns in enumerate(nodes)]
    owner = {v: i for i, eqns in enumerate(nodes) for e in eqns for v in e.outputs}
    edges, shared = set(), set()
    for i, eqns in enumerate(nodes):
        for eqn in eqns:
            for a in eqn.inputs:
                if isinstance(a, Var) and owner.get(a, i) != i:
                    edges.add((owner[a], i))
                    shared.add(a)
    memory = [sum(nbytes(v.aval) for e in eqns for v in e.outputs
                  if v in shared and v not in forward.constants) for eqns in nodes]
    never = NEVER * (sum(forward.cost) + 1.0)
    cost = [sum(eqn_cost(e) for e in eqns) + (0.0 if ok else never)
            for eqns, ok in zip(nodes, repeatable, strict=True)]
    order = list(range(len(nodes)))
    dag = Dag(dict(zip(order, memory, strict=True)), dict(zip(order, cost, strict=True)),
              sorted(edges), order=order, outputs=())
    return Coarse(graph, nodes, repeatable, dag)


def fitting(graph: Graph, target: int, measure, seconds: float, finish=None):
    """(the planned graph, its XLA temp, the schedule) of the cheapest schedule found on the
    coarsened `graph` whose compiled step (`measure`: Graph -> temp bytes, of the graph with
    `finish` applied) fits `target` bytes; None when none is found within `seconds`."""
    deadline = time.monotonic() + seconds
    coarse = coarsen(graph)
    if coarse is None:
        return None
    unplanned = graph if finish is None else finish(graph)
    temp, peak = measure(unplanned), coarse.dag.topological_peak()
    budget = min(target - (temp - peak), target * peak / temp)
    for round_ in range(ROUNDS):
        left = deadline - time.monotonic()
        if budget <= 0 or left <= 0:
            return None
        try:
            found = scheduled(coarse.dag, budget, time_limit=left / (ROUNDS - round_),
                              explain=False)
        except TransformError:  # nothing fits the Dag's budget
            return None
        planned = coarse.graph_of(found.events)
        if planned is None:
            return None
        planned = planned if finish is None else finish(planned)
        temp = measure(planned)
        if temp <= target:
            return planned, temp, found
        budget = found.peak * MARGIN * target / temp
    return None
