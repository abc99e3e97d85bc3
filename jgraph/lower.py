"""Lowering: a graph -> a `jax.jit` callable with the traced function's pytree signature.

The lowered function is the interpreter loop run on JAX tracers: each eqn binds its op's lowering.
The result composes with the user's own `jax.jit`, `vmap` and donated steps like any JAX function.
"""

from __future__ import annotations

import jax

from jgraph.interpreter import Interpreter, flatten_args, unflatten_outputs
from jgraph.ir import Graph


class Lowering(Interpreter):
    """The interpreter used for lowering (transforms that need special lowering hook in here)."""


def as_function(graph: Graph):
    """A plain (un-jitted) JAX function running `graph`, with its pytree signature."""
    lowering = Lowering()

    def fn(*args):
        return unflatten_outputs(graph, lowering.run(graph, *flatten_args(graph, args)))

    fn.__name__ = "jgraph_graph"
    return fn


def compile(graph: Graph, *, donate_argnums=()):  # noqa: A001 - the public name is fixed
    """`jax.jit` of the graph; arguments and results are pytrees as in the traced function."""
    return jax.jit(as_function(graph), donate_argnums=donate_argnums)
