"""Running a graph where the user called a drop-in transform: in the caller's trace, or eagerly.

Inside an enclosing transform (the user's `jax.jit`, `vmap`, `lax.scan` body, `shard_map`, `grad`,
another jgraph transform), some input is a tracer: the graph's eqns are bound one by one on those
tracers (`jgraph.lower.Lowering`), so they become part of the caller's own program: no nested
executable, and the enclosing transform (batching, differentiation, sharding) applies to each op.

Called eagerly (no tracer among the inputs), the first call runs op by op, as JAX's own eager
transforms do (a function made afresh for every call costs no compilation), and later calls of the
same signature run one `jax.jit` of the graph, compiled once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jgraph.ir import Graph
from jgraph.lower import Lowering


def _bindable(x):
    """A value primitives can be bound on: tracers and JAX arrays as they are, numpy values and
    Python scalars as JAX arrays (weak types kept, dtypes canonicalized as `jax.typeof` says)."""
    return x if isinstance(x, (jax.core.Tracer, jax.Array)) else jnp.asarray(x)


class GraphRunner:
    """`graph` (flat inputs -> flat outputs), with the values it closes over appended to every
    call's inputs (tracers of an enclosing trace, see `jgraph.trace.trace_closure`)."""

    def __init__(self, graph: Graph, closed_over=()):
        self.graph = graph
        self.closed_over = list(closed_over)
        self.eager_calls = 0
        self._jitted = None

    def __call__(self, flat) -> list:
        inputs = [*flat, *self.closed_over]
        if any(isinstance(x, jax.core.Tracer) for x in inputs):
            return Lowering().run(self.graph, *map(_bindable, inputs))
        self.eager_calls += 1
        if self.eager_calls == 1:
            return Lowering().run(self.graph, *map(_bindable, inputs))
        if self._jitted is None:
            graph = self.graph
            self._jitted = jax.jit(lambda *xs: Lowering().run(graph, *xs))
        return self._jitted(*inputs)
