"""What one compile shows of XLA's fusion: which of a graph's values it gave a buffer of their own.

The measured step is lowered with each of the graph's eqns under the name scope `e<index>`
(`jgraph.lower.Lowering(scoped=True)`), so every instruction of the compiled HLO names, in its
`op_name` metadata, the eqn it comes from. An instruction of the entry computation writes a
buffer (a fusion writes its root's value); an instruction inside a fused computation does not:
`read(hlo)` gives the eqns of each kind.

A plan of a graph computes the same values wired differently (recomputed copies, values kept or
not), so what XLA decided is carried to it by *value*, not by eqn: `numbers(graph)` names each
value by what it computes (its op, params and the numbers of its operands, back to the graph's
inputs by position), the same in the unplanned graph, in a plan made of it by `jg.remat`, in a
plan traced with `jax.checkpoint` regions, and in a recomputed copy. `Fusions` holds the
decisions by number; the simulator (`jgraph.memory.program.kernels`) follows them where it meets
the same value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from jgraph.ir import Graph, Literal, Var
from jgraph.memory.flatten import literal_key

_SCOPE = re.compile(r'op_name="[^"]*?/e(\d+)/')


def read(hlo: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]]:
    """(eqns whose value an instruction of the entry computation writes, eqns computed only
    inside fusions, and (eqn, elements) of each array the entry's instructions write), by index
    in the graph, from compiled HLO text. A fusion writes its fused computation's root, whose
    eqn its own name need not be (XLA:CPU names a YNNPACK fusion of `exp(s - max(s))` after
    the `reduce_max`)."""
    roots = _roots(hlo)
    entry, inside, written = set(), set(), set()
    computation = None
    for line in hlo.splitlines():
        if line and not line[0].isspace():  # a computation's header (or its closing brace)
            computation = "entry" if line.startswith("ENTRY") else "other"
            continue
        found = _SCOPE.search(line)
        if found is None:
            continue
        index = int(found.group(1))
        if computation != "entry":
            inside.add(index)
            continue
        called = _CALLS.search(line)
        index = roots.get(called.group(1), index) if called else index
        entry.add(index)
        shape = _ARRAY.match(line)
        if shape is not None:
            written.add((index, int(np.prod([int(d) for d in shape.group(1).split(",") if d]))))
    return tuple(sorted(entry)), tuple(sorted(inside - entry)), tuple(sorted(written))


def _roots(hlo: str) -> dict[str, int]:
    """The eqn each fused computation's root computes, by the computation's name."""
    roots, name = {}, None
    for line in hlo.splitlines():
        if line and not line[0].isspace():
            name = line.split(" ", 1)[0].lstrip("%")
        elif line.lstrip().startswith("ROOT ") and name is not None:
            found = _SCOPE.search(line)
            if found is not None:
                roots[name] = int(found.group(1))
    return roots


_CALLS = re.compile(r" fusion\(.*calls=%([\w.\-]+)")
_ARRAY = re.compile(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]")  # an array result (not a tuple)


def numbers(graph: Graph) -> dict[Var, object]:
    """Each value of `graph` (its eqns' outputs) named by what it computes."""
    named: dict[Var, object] = {v: ("input", k) for k, v in enumerate(graph.inputs)}

    def number(a):
        if isinstance(a, Literal):
            return literal_key(a)
        return named.get(a, ("free", id(a)))

    for eqn in graph.eqns:
        key = hash((eqn.op, _params(eqn.params), tuple(number(a) for a in eqn.inputs)))
        for k, v in enumerate(eqn.outputs):
            named[v] = (key, k, v.aval.shape, str(v.aval.dtype))
    return named


def _params(params) -> tuple:
    items = []
    for name, value in sorted(params.items()):
        try:
            hash(value)
        except TypeError:
            value = repr(value)
        if isinstance(value, Graph):  # a loop's body: by what it computes, not by identity
            value = ("graph", tuple(e.op for e in value.eqns),
                     tuple(str(v.aval) for v in value.inputs))
        items.append((name, value))
    return tuple(items)


def contexts(graph: Graph) -> dict[Var, tuple]:
    """Each value of `graph` with what reads it: its number and the numbers of its readers'
    results. XLA fuses a value by who reads it (a library dot takes an elementwise operand
    nothing else reads), so a decision carries over only to a value read by the same
    computations: in a plan, a forward value the backward no longer reads, or a recomputed copy
    read by the backward alone, is left to the rules."""
    named = numbers(graph)
    readers: dict[Var, set] = {}
    for eqn in graph.eqns:
        for a in eqn.inputs:
            if isinstance(a, Var):
                readers.setdefault(a, set()).update(eqn.outputs)
    near = {v: frozenset(named[r] for r in readers.get(v, ())) for v in named}
    return {v: (n, frozenset((named[r], near[r]) for r in readers.get(v, ())))
            for v, n in named.items()}


@dataclass(frozen=True)
class Fusions:
    """XLA's decisions on one graph, by value and readers (`contexts`): `True` where it wrote
    the value to a buffer, `False` where it computed it only inside the fusions reading it."""

    decided: dict

    @staticmethod
    def of(graph: Graph, materialised, fused, written=()) -> Fusions:
        """`written`: (eqn, elements) of the arrays the entry's instructions write. An array
        eqn whose entry instructions all write scalars is not taken as written: its name is on
        a scalar XLA derived from it (`x / c` is `x * (1 / c)` to XLA's simplifier, the scalar
        `1 / c` an instruction of its own named after the divide)."""
        named = contexts(graph)
        sizes: dict[int, set] = {}
        for i, n in written:
            sizes.setdefault(i, set()).add(n)
        decided = {}
        for indices, verdict in ((fused, False), (materialised, True)):
            for i in indices:
                if i >= len(graph.eqns) or len(graph.eqns[i].outputs) != 1:
                    continue
                out = graph.eqns[i].outputs[0]
                if verdict and sizes.get(i) == {1} and out.aval.size > 1:
                    continue
                decided[named[out]] = verdict
        return Fusions(decided)

    def on(self, graph: Graph) -> dict[Var, bool]:
        """The decisions for `graph`'s own values (a plan of the graph they were read on)."""
        return {v: self.decided[n] for v, n in contexts(graph).items() if n in self.decided}
