"""The rematerialization problem of a DAG of costed nodes: `Dag`, and `replay`, which checks and
measures a schedule (the solvers, `schedule`, are in `jgraph.planner.dag`).

The problem is Checkmate's (Jain et al., MLSys 2020), also solved by MOCCASIN (Bartan et al.,
ICML 2023). A node's output occupies `memory[node]` from its compute until it is freed; computing
a node costs `cost[node]` and needs the outputs of all its predecessors resident. A schedule is a
list of events `("compute", node)` and `("free", node)`:
- every node is computed at least once, and may be computed again (recomputation) once freed;
- the memory of a compute is what is resident while it runs: its inputs, everything else held,
  and its own output; `peak` is the largest such sum, `cost` the sum of the costs of all computes;
- the outputs (by default the last node of `order`, the loss or last gradient of a training
  graph, as in Checkmate) are resident at the end. Any other sink is freed once computed: it is
  counted at its compute, as Checkmate and MOCCASIN count a graph's other sinks.

`replay` checks a schedule against these rules and measures it; `schedule` returns a replayed
`Schedule` whose peak fits the budget. Its schedules lie in Checkmate's space: `order[t]` is
first computed in stage t, and each stage first recomputes a set of earlier nodes, each once, in
`order` (MOCCASIN's space is the same, with at most two computes per node; the fast solver may
order a stage's recomputes depth first instead). A schedule is then its stages: given them, the
least memory holds a value only from a compute to its last use before it is computed again
(`_stage_events`), so every choice of stages is a valid schedule.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from jgraph.errors import GraphError


@dataclass(frozen=True)
class _Index:
    """A DAG over positions 0..n-1 of `order` (every edge goes up)."""

    names: tuple  # the node at each position
    memory: tuple  # memory[i] of the node at position i
    cost: tuple  # cost[i]
    preds: tuple  # preds[i]: sorted positions of i's predecessors
    succs: tuple  # succs[i]: sorted positions of i's successors
    output: tuple  # output[i]: the node stays resident at the end

    @property
    def n(self) -> int:
        return len(self.names)


@dataclass(frozen=True, eq=False)
class Dag:
    """A DAG of costed nodes to schedule. `order` is a topological order: node `order[t]` is
    first computed in stage t (default: the nodes in `memory`'s order when that is topological,
    else Kahn's order). `outputs` stay resident at the end (default: the last node of `order`)."""

    memory: Mapping[Hashable, float]  # what a node's output occupies while resident
    cost: Mapping[Hashable, float]  # what computing the node once costs
    edges: Iterable[tuple[Hashable, Hashable]]  # (u, v): computing v reads u's output
    order: Iterable[Hashable] | None = None  # a topological order of all the nodes
    outputs: Iterable[Hashable] | None = None  # resident at the end
    _ix: _Index = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        memory, cost = dict(self.memory), dict(self.cost)
        for name, table in (("memory", memory), ("cost", cost)):
            for node, value in table.items():
                if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(
                        value, bool) or not math.isfinite(value) or value < 0:
                    raise GraphError(f"Dag: {name}[{node!r}] = {value!r}: a {name} is a finite "
                                     f"number >= 0")
        for node in memory:
            if node not in cost:
                raise GraphError(f"Dag: node {node!r} has a memory but no cost")
        for node in cost:
            if node not in memory:
                raise GraphError(f"Dag: node {node!r} has a cost but no memory")
        if not memory:
            raise GraphError("Dag: no nodes (memory is empty)")
        edges, seen = [], set()
        for edge in self.edges:
            if not isinstance(edge, (tuple, list)) or len(edge) != 2:
                raise GraphError(f"Dag: edge {edge!r} is not a pair (u, v)")
            u, v = edge
            for node in (u, v):
                if node not in memory:
                    raise GraphError(f"Dag: edge ({u!r}, {v!r}) names {node!r}, a node with no "
                                     f"memory or cost")
            if u == v:
                raise GraphError(f"Dag: edge ({u!r}, {v!r}) is a cycle (a node reading itself)")
            if (u, v) not in seen:
                seen.add((u, v))
                edges.append((u, v))
        order = _kahn(list(memory), edges) if self.order is None else list(self.order)
        if order is None:
            raise GraphError("Dag: the edges have a cycle")
        position = {}
        for t, node in enumerate(order):
            if node not in memory:
                raise GraphError(f"Dag: order names {node!r}, a node with no memory or cost")
            if node in position:
                raise GraphError(f"Dag: order names {node!r} twice")
            position[node] = t
        missing = [node for node in memory if node not in position]
        if missing:
            raise GraphError(f"Dag: order misses the nodes {missing[:5]!r}")
        for u, v in edges:
            if position[u] > position[v]:
                if _kahn(list(memory), edges) is None:
                    raise GraphError(f"Dag: the edges have a cycle (through {u!r} -> {v!r})")
                raise GraphError(f"Dag: order is not topological: {u!r} -> {v!r}, but {v!r} "
                                 f"comes first")
        outputs = [order[-1]] if self.outputs is None else list(self.outputs)
        for node in outputs:
            if node not in memory:
                raise GraphError(f"Dag: outputs names {node!r}, a node with no memory or cost")
        preds = [[] for _ in order]
        succs = [[] for _ in order]
        for u, v in edges:
            preds[position[v]].append(position[u])
            succs[position[u]].append(position[v])
        out = set(outputs)
        ix = _Index(tuple(order), tuple(memory[x] for x in order), tuple(cost[x] for x in order),
                    tuple(tuple(sorted(p)) for p in preds), tuple(tuple(sorted(s)) for s in succs),
                    tuple(x in out for x in order))
        for name, value in (("memory", memory), ("cost", cost), ("edges", tuple(edges)),
                            ("order", tuple(order)), ("outputs", tuple(outputs)), ("_ix", ix)):
            object.__setattr__(self, name, value)

    def topological_peak(self):
        """The peak of the topological schedule (each node once, in `order`)."""
        return replay(self, _stage_events(self._ix, [[t] for t in range(self._ix.n)])).peak

    def lower_bound(self):
        """No schedule peaks below this: the largest node plus all its inputs."""
        ix = self._ix
        return max(ix.memory[v] + sum(ix.memory[p] for p in ix.preds[v]) for v in range(ix.n))

    @property
    def total_cost(self):
        """The cost of computing every node once: the least a schedule can cost."""
        return sum(self._ix.cost)


def _kahn(nodes: list, edges: list) -> list | None:
    """A topological order (nodes in their given order when free), or None on a cycle."""
    rank = {x: i for i, x in enumerate(nodes)}
    if all(rank[u] < rank[v] for u, v in edges):
        return list(nodes)
    indegree = dict.fromkeys(nodes, 0)
    succs = {x: [] for x in nodes}
    for u, v in edges:
        indegree[v] += 1
        succs[u].append(v)
    ready = deque(x for x in nodes if indegree[x] == 0)
    order = []
    while ready:
        x = ready.popleft()
        order.append(x)
        for y in succs[x]:
            indegree[y] -= 1
            if indegree[y] == 0:
                ready.append(y)
    return order if len(order) == len(nodes) else None


@dataclass(frozen=True)
class Replayed:
    """What `replay` measured."""

    peak: float  # the largest resident memory over the computes
    cost: float  # the sum of the costs of all the computes
    recomputes: int  # computes beyond the first of each node


def replay(dag: Dag, events) -> Replayed:
    """Run a schedule on `dag` and measure it. Raises `GraphError` when an event computes a node
    whose input is not resident or that is resident already, frees a node that is not resident,
    or when the schedule leaves a node never computed or an output not resident at the end."""
    ix = dag._ix
    position = {x: i for i, x in enumerate(ix.names)}
    resident = [False] * ix.n
    computed = [False] * ix.n
    memory = peak = cost = 0
    recomputes = 0
    for step, event in enumerate(events):
        if not isinstance(event, (tuple, list)) or len(event) != 2 or event[0] not in (
                "compute", "free"):
            raise GraphError(f"replay: event {step} is {event!r}, not ('compute' | 'free', node)")
        kind, node = event
        if node not in position:
            raise GraphError(f"replay: event {step} {kind}s {node!r}, which is not a node")
        v = position[node]
        if kind == "free":
            if not resident[v]:
                raise GraphError(f"replay: event {step} frees {node!r}, which is not resident")
            resident[v] = False
            memory -= ix.memory[v]
            continue
        if resident[v]:
            raise GraphError(f"replay: event {step} computes {node!r}, which is resident already")
        for p in ix.preds[v]:
            if not resident[p]:
                raise GraphError(f"replay: event {step} computes {node!r}, but its input "
                                 f"{ix.names[p]!r} is not resident")
        resident[v] = True
        recomputes += computed[v]
        computed[v] = True
        memory += ix.memory[v]
        peak = max(peak, memory)
        cost += ix.cost[v]
    for v in range(ix.n):
        if not computed[v]:
            raise GraphError(f"replay: the schedule never computes {ix.names[v]!r}")
        if ix.output[v] and not resident[v]:
            raise GraphError(f"replay: the output {ix.names[v]!r} is not resident at the end")
    return Replayed(peak, cost, recomputes)


def _held_after(ix: _Index, stages) -> list:
    """held_after[t]: the positions resident at the end of stage t when each value is held only
    until its last use before its next compute (the outputs: to the end)."""
    held_after = [None] * ix.n
    need = {v for v in range(ix.n) if ix.output[v]}
    for t in range(ix.n - 1, -1, -1):
        held_after[t] = frozenset(need)
        stage = stages[t]
        need.difference_update(stage)
        computed = set(stage)
        for y in stage:
            need.update(p for p in ix.preds[y] if p not in computed)
    return held_after


def _walk(ix: _Index, stages):
    """Yield ("compute" | "free", position, stage) for the stages (stage t: positions in their
    compute order, each after its inputs, ending with t), holding each value only from its
    compute to its last use before its next compute."""
    held_after = _held_after(ix, stages)
    resident = set()
    for t in range(ix.n):
        stage, keep = stages[t], held_after[t]
        last_use = {}  # value -> index in the stage of its last reader
        for q, y in enumerate(stage):
            for p in ix.preds[y]:
                last_use[p] = q
        for x in sorted(resident - keep - last_use.keys()):
            resident.discard(x)
            yield "free", x, t
        for q, y in enumerate(stage):
            resident.add(y)
            yield "compute", y, t
            for x in (*ix.preds[y], y):
                if x in resident and x not in keep and last_use.get(x, -1) <= q:
                    resident.discard(x)
                    yield "free", x, t


def _stage_events(ix: _Index, stages) -> list:
    """The events of a schedule given by its stages (see `_walk`)."""
    return [(kind, ix.names[x]) for kind, x, _ in _walk(ix, stages)]


def _peak(ix: _Index, stages):
    """The peak of `_stage_events(ix, stages)`, without naming the events."""
    memory = peak = 0
    for kind, x, _ in _walk(ix, stages):
        if kind == "compute":
            memory += ix.memory[x]
            peak = max(peak, memory)
        else:
            memory -= ix.memory[x]
    return peak


def _stages_cost(ix: _Index, stages) -> float:
    return sum(ix.cost[y] for stage in stages for y in stage)
