"""Every error jgraph raises is a `JGraphError`; subclasses say which stage found the problem.

`while_processing` names the eqn being processed on any error escaping a rule or a lowering (as
torch.fx's interpreter says "While executing ..."): a jgraph error gets a note quoting the eqn as
`str(graph)` prints it and the user's source line; any other exception becomes a `TransformError`
(or `JGraphError` outside transforms) saying the same, so no raw error escapes from internals.
"""

import contextlib


class JGraphError(Exception):
    """Base class of jgraph's errors."""


class GraphError(JGraphError):
    """A graph breaks an invariant of the IR (raised by `check`, naming the eqn)."""


class TraceError(JGraphError):
    """A function cannot be traced into the IR (names the primitive and the user's source line)."""


class TransformError(JGraphError):
    """A transform cannot be applied (a missing rule, a bad loss, no params, ...)."""


class BudgetWarning(UserWarning):
    """`jg.remat(budget="NN%")`: no plan reaches that share of no remat's temp; the plan that
    needs the least memory is returned instead (the warning names both figures)."""


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
    from jgraph.printing import format_eqn

    text = format_eqn(eqn, graph)
    return f"while {what} eqn `{text}`" + (f" ({eqn.source})" if eqn.source else "")
