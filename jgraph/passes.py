"""Pure graph -> graph clean-up passes: dead-code elimination (and CSE, respecting `no_cse`)."""

from __future__ import annotations

from jgraph.ir import Graph, Var


def dce(graph: Graph) -> Graph:
    """Drop eqns none of whose outputs reaches a graph output. Inputs are kept (the signature)."""
    live = {a for a in graph.outputs if isinstance(a, Var)}
    kept = []
    for eqn in reversed(graph.eqns):
        if any(v in live for v in eqn.outputs):
            kept.append(eqn)
            live.update(a for a in eqn.inputs if isinstance(a, Var))
    if len(kept) == len(graph.eqns):
        return graph
    return graph.replace(eqns=tuple(reversed(kept)))
