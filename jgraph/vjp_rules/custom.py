"""VJP rules of the user-defined derivatives (`jgraph.custom_derivatives`).

`custom_jvp_call`: the user's JVP rule, linearized in the tangents and transposed by `jax.vjp` of
the tangent map, as JAX differentiates a custom_jvp function in reverse mode. `custom_vjp_call`:
the user's bwd on (residuals, output cotangents), each cotangent cast to its input's dtype (a bwd
may return f32 for a bf16 input). Neither gives closed-over values a cotangent.
`custom_vjp_call_lazy` has no rule: jgraph's backward never meets it (see below).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core as jex_core

from jgraph.backward import NO_VJP_RULE, defvjp, undifferentiable_inputs
from jgraph.custom_lowering import user_cotangents
from jgraph.ir import is_float


def _custom_jvp_call_vjp(cts, ins, outs, *, n_consts, n_primals, jvp, symbolic_zeros,
                         needed=None):
    primals = ins[n_consts:n_consts + n_primals]
    used = (True,) * n_primals if needed is None else needed[n_consts:n_consts + n_primals]
    # Integer inputs have zero tangents; so do those whose cotangent nobody needs, for a rule
    # that takes symbolic zeros (jgraph's own lowering's, which refuses closed-over tangents).
    zero_in = [not is_float(jax.typeof(x)) or (symbolic_zeros and not use)
               for x, use in zip(primals, used, strict=True)]
    jaxpr, consts, zero_out = jvp.fn.call_wrapped(*zero_in)
    tangent_map = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, consts))
    n_out = len(zero_out)

    def tangents_out(*tangents):
        return tangent_map(*primals, *tangents)[n_out:]

    tangents = [np.zeros(x.shape, x.dtype) for x, z in zip(primals, zero_in, strict=True) if not z]
    _, transpose = jax.vjp(tangents_out, *tangents)
    cts_in = iter(transpose([ct for ct, z in zip(cts, zero_out, strict=True) if not z]))
    return [None] * n_consts + [None if z else next(cts_in) for z in zero_in]


_custom_jvp_call_vjp.wants_needed = True
# The rule recomputes the forward's values (its primal: a custom body it calls), whose prints ran
# in the forward. (A print in the rule itself is dropped too: JAX runs it once, in the forward,
# where jgraph does not run the rule.)
_custom_jvp_call_vjp.replays_forward = True
defvjp("custom_jvp_call", _custom_jvp_call_vjp)
undifferentiable_inputs["custom_jvp_call"] = lambda n_in, p: range(p["n_consts"])


def _custom_vjp_call_vjp(cts, ins, outs, *, n_primals, n_res, bwd, symbolic_zeros, n_consts=0):
    res = ins[n_primals:n_primals + n_res]
    cts_in = user_cotangents(bwd, res, cts, [jax.typeof(x) for x in ins[:n_primals]])
    return cts_in + [None] * (len(ins) - n_primals)


defvjp("custom_vjp_call", _custom_vjp_call_vjp)
undifferentiable_inputs["custom_vjp_call"] = lambda n_in, p: range(n_in - p.get("n_consts", 0),
                                                                   n_in)


# A custom_vjp called by another's fwd: fwd's values get no gradient in jgraph's backward, so it
# never meets this op; JAX differentiates its lowering, which carries the user's fwd and bwd.
NO_VJP_RULE["custom_vjp_call_lazy"] = (
    "a custom_vjp called by another custom_vjp's fwd, whose values get no gradient; JAX "
    "differentiates its lowering (the user's fwd and bwd)")
