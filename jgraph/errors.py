"""Every error jgraph raises is a `JGraphError`; subclasses say which stage found the problem.

The bottom layer: it imports nothing of jgraph. (`jgraph.naming.while_processing` names the eqn
being processed in any error escaping a rule or a lowering.)
"""


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
