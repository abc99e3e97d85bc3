"""Naming a graph's values and eqns in error messages, as `str(graph)` prints them.

`while_processing` (as torch.fx's interpreter says "While executing ..."): a jgraph error gets a
note quoting the eqn as `str(graph)` prints it and the user's source line; any other exception
becomes a `TransformError` (or `JGraphError` outside transforms) saying the same, so no raw error
escapes from internals.
"""

from __future__ import annotations

import contextlib

from jgraph.errors import JGraphError, TransformError
from jgraph.ir import Graph, Namer, Var, eqn_lines, format_literal, format_params, short_aval


def var_name(graph: Graph, v: Var) -> str:
    """The name `str(graph)` gives `v` (for error messages)."""
    name = Namer()
    eqn_lines(graph, name)
    return name(v)


def format_eqn(eqn, graph: Graph | None = None) -> str:
    """One eqn as text, named as in `str(graph)` when the graph is given (for error messages)."""
    if graph is not None:
        index = next((i for i, e in enumerate(graph.eqns) if e is eqn), -1)
        if index >= 0:
            return eqn_lines(graph)[1][index]
    name = Namer()
    outs = " ".join(f"{name(v)}:{short_aval(v.aval)}" for v in eqn.outputs) or "_"
    ins = " ".join(name(a) if isinstance(a, Var) else format_literal(a) for a in eqn.inputs)
    return f"{outs} = {eqn.op}{format_params(eqn)} {ins}".rstrip()


@contextlib.contextmanager
def while_processing(what: str, eqn, graph=None, error=None):
    """Context naming `eqn` (and the user's line) in any error raised inside it."""
    try:
        yield
    except JGraphError as e:
        if not getattr(e, "_jgraph_noted", False):
            e.add_note(_where(what, eqn, graph))
            e._jgraph_noted = True
        raise
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except Exception as e:
        cls = error or (TransformError if what == "differentiating" else JGraphError)
        new = cls(f"{type(e).__name__} {_where(what, eqn, graph)}: {e}")
        new._jgraph_noted = True
        raise new from e


def _where(what: str, eqn, graph) -> str:
    text = format_eqn(eqn, graph)
    return f"while {what} eqn `{text}`" + (f" ({eqn.source})" if eqn.source else "")
