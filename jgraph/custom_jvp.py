"""`jax.custom_jvp` in user code: the primal body as IR, differentiated by the user's JVP rule.

The tracer meets `custom_jvp_call` and inlines its primal body (so the forward is unchanged, bit
for bit), followed by one `custom_jvp_call` op that takes the call's closed-over values, its primal
inputs and the body's outputs, and returns those outputs unchanged. The backward pass reaches the
body's values only through that op: its VJP is the user's JVP rule linearized in the tangents and
transposed (by `jax.vjp` of the tangent map, as JAX differentiates a custom_jvp function in reverse
mode), so `jax.nn.relu'(0)` is 0 and `softplus'(0)` is 1/2, as in JAX, not what the primal body's
own ops would give.

Closed-over values (`num_consts`) get no tangent from the user's rule: one that needs a gradient
is an error, as in JAX (pass it as an argument instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from jgraph import builder, ops
from jgraph.ir import is_float
from jgraph.vjp import defvjp, undifferentiable_inputs


@dataclass(frozen=True, eq=False)
class UserJvp:
    """The user's JVP rule as JAX stages it: `thunk(*zero_flags) -> (jaxpr, consts, out_zeros)`,
    where the jaxpr maps (primals, non-zero tangents) to (primal outs, non-zero tangent outs)."""

    thunk: Any
    name: str  # the custom_jvp function's name, for printing

    def __repr__(self):
        return f"jvp({self.name})"

    __str__ = __repr__


def _outputs(values, n_consts, n_primals):
    return list(values[n_consts + n_primals:])


def _shape_rule(*avals, n_consts, n_primals, **_):
    return _outputs(avals, n_consts, n_primals)


def _lowering(*values, n_consts, n_primals, **_):
    return _outputs(values, n_consts, n_primals)


ops.defop("custom_jvp_call", _shape_rule, _lowering)


def _custom_jvp_call(b: builder.Builder, eqn, inputs):
    p = eqn.params
    body = p["call_jaxpr"]
    outs = b.inline(body.jaxpr, body.consts, inputs)
    name = getattr(body.jaxpr.debug_info, "func_name", "") or "custom_jvp"
    return b.bind("custom_jvp_call", *inputs, *outs, n_consts=p["num_consts"],
                  n_primals=len(inputs) - p["num_consts"], jvp=UserJvp(p["jvp_jaxpr_fun"], name),
                  symbolic_zeros=p["symbolic_zeros"])


builder._HANDLERS["custom_jvp_call"] = _custom_jvp_call


def _custom_jvp_call_vjp(cts, ins, outs, *, n_consts, n_primals, jvp, symbolic_zeros):
    primals = ins[n_consts:n_consts + n_primals]
    zero_in = [not is_float(jax.typeof(x)) for x in primals]  # integer inputs: no tangent
    jaxpr, consts, zero_out = jvp.thunk.call_wrapped(*zero_in)
    tangent_map = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, consts))
    n_out = len(zero_out)

    def tangents_out(*tangents):
        return tangent_map(*primals, *tangents)[n_out:]

    tangents = [np.zeros(x.shape, x.dtype) for x, z in zip(primals, zero_in, strict=True) if not z]
    _, transpose = jax.vjp(tangents_out, *tangents)
    nonzero_cts = [ct for ct, z in zip(cts, zero_out, strict=True) if not z]
    cts_in = iter(transpose(nonzero_cts))
    return [None] * n_consts + [None if z else next(cts_in) for z in zero_in]


defvjp("custom_jvp_call", _custom_jvp_call_vjp)
# The user's rule gives closed-over values no tangent: needing one is an error.
undifferentiable_inputs["custom_jvp_call"] = lambda n_in, p: range(p["n_consts"])
