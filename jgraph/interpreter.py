"""The one interpreter loop, and `evaluate`, the reference interpreter.

`Interpreter.run` walks the schedule with an environment from variables to values, freeing each
value after its last use. Subclasses change what one eqn does (`eval_eqn`): evaluation binds the
op's lowering eagerly, `jgraph.lower` runs the same loop under `jax.jit`.
"""

from __future__ import annotations

import jax

from jgraph import ops
from jgraph.errors import JGraphError
from jgraph.ir import Graph, Literal, Var


def last_uses(graph: Graph) -> dict[Var, int]:
    """For each variable, the index of the last eqn reading it (len(eqns) if it is an output)."""
    last: dict[Var, int] = {}
    for i, eqn in enumerate(graph.eqns):
        for a in eqn.inputs:
            if isinstance(a, Var):
                last[a] = i
    for a in graph.outputs:
        if isinstance(a, Var):
            last[a] = len(graph.eqns)
    return last


class Interpreter:
    """Runs a graph on flat arguments. Subclass and override `eval_eqn` to change one step."""

    def run(self, graph: Graph, *args):
        if len(args) != len(graph.inputs):
            raise JGraphError(f"graph takes {len(graph.inputs)} flat inputs, got {len(args)}")
        env: dict[Var, object] = {}

        def read(a):
            return a.value if isinstance(a, Literal) else env[a]

        def write(v, value):
            env[v] = value

        last = last_uses(graph)
        for v, x in zip(graph.inputs, args):
            write(v, x)
        for i, eqn in enumerate(graph.eqns):
            outs = self.eval_eqn(eqn, [read(a) for a in eqn.inputs])
            for v, x in zip(eqn.outputs, outs):
                write(v, x)
            for a in eqn.inputs:  # free values after their last use
                if isinstance(a, Var) and last.get(a) == i:
                    env.pop(a, None)
        return [read(a) for a in graph.outputs]

    def eval_eqn(self, eqn, values):
        try:
            lowering = ops.lowerings[eqn.op]
        except KeyError:
            raise JGraphError(f"no lowering for op {eqn.op!r} ({eqn.source})") from None
        return lowering(*values, **eqn.params)


def flatten_args(graph: Graph, args) -> list:
    """Flatten call arguments against the graph's input structure, with a clear error."""
    leaves, tree = jax.tree.flatten(tuple(args))
    if graph.in_tree is not None and tree != graph.in_tree:
        raise JGraphError(
            f"arguments do not match the traced signature:\n  expected {graph.in_tree}\n"
            f"  got      {tree}"
        )
    if len(leaves) != len(graph.inputs):
        raise JGraphError(f"graph takes {len(graph.inputs)} flat inputs, got {len(leaves)}")
    return leaves


def unflatten_outputs(graph: Graph, flat):
    if graph.out_tree is None:
        return tuple(flat)
    return jax.tree.unflatten(graph.out_tree, flat)


def evaluate(graph: Graph, *args):
    """Run `graph` op by op without `jax.jit` (the reference interpreter)."""
    flat = flatten_args(graph, args)
    return unflatten_outputs(graph, Interpreter().run(graph, *flat))
