"""Side effects jgraph keeps: `jax.debug.print`, ordered or not, anywhere (loop bodies included).

Each is an op with no outputs (`debug_print`), emitted where the user's program has it. No pass
removes, merges, copies or reorders it (`ops.EFFECTFUL`): DCE keeps it, CSE never merges two,
remat recomputes only values (so a remat never replays a print), and a loop's VJP keeps it in the
forward loop. It has no derivative: a print runs in the forward pass only, once per step, as
under `jax.grad`. It lowers by binding JAX's primitive, so JAX orders ordered prints (threading a
token through `lax.scan`, `while_loop` and `cond`) and runs unordered ones as it does.
Other effects (callbacks, state) stay refused by the tracer (`jgraph.builder`).
"""

from __future__ import annotations

import jax

from jgraph import ops
from jgraph.builder import Builder, handler


def _debug_print_primitive():
    """JAX's print primitive, which `jax.extend` does not list: taken from a jaxpr."""
    jaxpr = jax.make_jaxpr(lambda x: jax.debug.print("{}", x))(jax.ShapeDtypeStruct((), "float32"))
    return jaxpr.jaxpr.eqns[0].primitive


ops.defprim(_debug_print_primitive())  # the op binds JAX's primitive


@handler("debug_print")
def _debug_print(b: Builder, eqn, inputs):
    return b.emit("debug_print", inputs, eqn.params, [v.aval for v in eqn.outvars])
