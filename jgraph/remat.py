"""`jg.remat`: rematerialize a joint forward + backward graph (DESIGN §4.2).

`remat(gb)` applies the checkpoint regions recorded while tracing (`jax.checkpoint`,
`jgraph.checkpoint`); `remat(gb, policy=...)` puts the whole forward in one more region, with the
policy seen through loops (the graph is derived again by `jgraph.backward` with the policy inside
its loop bodies); `remat(gb, budget=...)` plans its own regions (`jgraph.planner`). The engine
that rematerializes regions is `jgraph.regions` (how a value is kept or recomputed is described
there); this module sits above it, the planner and the backward pass it drives, as JAX's public
`checkpoint` (`ad_checkpoint.py`) sits above the machinery it drives.
"""

from __future__ import annotations

from jgraph.backward import rederived
from jgraph.check import validate
from jgraph.errors import TransformError
from jgraph.ir import Eqn, Graph
from jgraph.planner import remat_under_budget
from jgraph.regions import LOOPS, apply_regions, is_forward


def remat(graph: Graph, policy=None, *, budget=None, planner: str = "auto") -> Graph:
    """Apply the graph's checkpoint regions; `policy=` puts the whole forward in one more region;
    `budget=` (bytes of the compiled donated step's temp, or a percentage string such as "50%"
    of no remat's) plans regions itself instead, with `planner` "auto", "exact" or "fast"
    (`jgraph.planner`)."""
    validate(graph, "jg.remat")
    if "grad" not in graph.output_roles and not any("backward" in e.tags for e in graph.eqns):
        raise TransformError("remat needs a joint forward + backward graph: apply jg.backward "
                             "first (this graph has no grad output and no eqn tagged 'backward')")
    if budget is not None:
        if policy is not None:
            raise TransformError("remat: give either policy= or budget=, not both")
        return remat_under_budget(graph, budget, planner)
    if planner != "auto":
        raise TransformError(f"remat(planner={planner!r}) chooses how a budget is planned: give "
                             "budget= too")
    if policy is not None and _loops(graph):
        graph = _with_policy_in_loops(graph, policy)
    return apply_regions(graph, policy)


def _loops(graph: Graph) -> list[Eqn]:
    """Forward loops and conds on the gradient path (their backward is a loop or a cond too)."""
    bwd = {e.op for e in graph.eqns if "backward" in e.tags}
    return [e for e in graph.eqns if is_forward(e) and e.op in LOOPS and e.op in bwd]


def _with_policy_in_loops(graph: Graph, policy) -> Graph:
    """`graph` derived again by `jg.backward` with `policy` inside its loop bodies (a policy sees
    through loops, as `jax.checkpoint`'s does through `lax.scan`)."""
    again = rederived(graph, policy)
    if again is None:
        raise TransformError(
            "remat(policy=...) of a graph with loops needs the graph jg.backward returned (the "
            "policy applies inside loop bodies, which backward builds): apply remat right after "
            "backward, before other transforms")
    return again
