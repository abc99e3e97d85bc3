"""Jaxpr-like text for graphs. Printing is API: tests compare it to golden strings.

    { lambda a:f32[3,4]@param b:f32[2,3]@data .
      let c:f32[2,4] = dot_general[dimension_numbers=(([1], [0]), ([], []))] b a
          d:f32[2,4] = tanh c                                  # region 0
      in ( e@loss ) }

Variables are named a, b, ..., z, ba, bb, ... in order of appearance. Params whose value is None
are left out; sub-jaxprs print as <jaxpr>. Tags and checkpoint regions follow as a comment.
"""

from __future__ import annotations

import itertools
import string

import numpy as np

from jgraph.ir import Graph, Literal, Var, short_aval


def _names():
    letters = string.ascii_lowercase
    for n in itertools.count(1):
        for chars in itertools.product(letters, repeat=n):
            name = "".join(chars)
            if n == 1 or name[0] != "a":  # jaxpr's scheme: a..z, ba..zz, baa...
                yield name


class _Namer:
    def __init__(self):
        self.names: dict[int, str] = {}
        self.fresh = _names()

    def __call__(self, v: Var) -> str:
        if id(v) not in self.names:
            self.names[id(v)] = next(self.fresh)
        return self.names[id(v)]


def format_literal(lit: Literal) -> str:
    if np.ndim(lit.value) == 0:
        value = lit.value.item() if hasattr(lit.value, "item") else lit.value
        return f"{value}:{short_aval(lit.aval)}"
    return f"const:{short_aval(lit.aval)}"


def format_param(value) -> str:
    if type(value).__name__ in ("ClosedJaxpr", "Jaxpr"):
        return "<jaxpr>"
    if isinstance(value, (tuple, list)) and any(type(v).__name__ in ("ClosedJaxpr", "Jaxpr")
                                                for v in value):
        return "(<jaxpr>, ...)"
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    if isinstance(value, np.dtype) or type(value).__name__ == "dtype":
        return str(value)
    return str(value)


def format_graph(graph: Graph) -> str:
    name = _Namer()

    def atom(a):
        return name(a) if isinstance(a, Var) else format_literal(a)

    head = " ".join(
        f"{name(v)}:{short_aval(v.aval)}@{role}" for v, role in zip(graph.inputs, graph.input_roles)
    )
    lines = [f"{{ lambda {head} ."]
    body = []
    for eqn in graph.eqns:
        outs = " ".join(f"{name(v)}:{short_aval(v.aval)}" for v in eqn.outputs) or "_"
        params = [f"{k}={format_param(v)}" for k, v in eqn.params.items() if v is not None]
        op = eqn.op + (f"[{' '.join(params)}]" if params else "")
        text = f"{outs} = {op} {' '.join(atom(a) for a in eqn.inputs)}".rstrip()
        notes = sorted(eqn.tags) + [f"region {'/'.join(map(str, eqn.regions))}"] * bool(eqn.regions)
        body.append((text, ", ".join(notes)))
    width = max((len(t) for t, n in body if n), default=0)
    for i, (text, notes) in enumerate(body):
        prefix = "  let " if i == 0 else "      "
        lines.append(prefix + (f"{text:<{width}}  # {notes}" if notes else text))
    outs = " ".join(f"{atom(a)}@{role}" for a, role in zip(graph.outputs, graph.output_roles))
    lines.append(f"  in ( {outs} ) }}")
    return "\n".join(lines)


def format_eqn(eqn, graph: Graph | None = None) -> str:
    """One eqn as text, with names as in `str(graph)` when the graph is given (for error messages)."""
    if graph is not None:
        text = str(graph)
        index = graph.eqns.index(eqn) if eqn in graph.eqns else -1
        if index >= 0:
            lines = text.splitlines()[1:-1]
            return lines[index].strip().removeprefix("let ").strip()
    name = _Namer()
    outs = " ".join(f"{name(v)}:{short_aval(v.aval)}" for v in eqn.outputs)
    ins = " ".join(name(a) if isinstance(a, Var) else format_literal(a) for a in eqn.inputs)
    return f"{outs} = {eqn.op} {ins}"
