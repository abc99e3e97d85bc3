"""`jax.custom_vjp` in user code: an op whose VJP is the user's bwd, traced into IR.

The tracer meets `custom_vjp_call` and emits, as JAX does under differentiation, the eqns of the
user's fwd (primal outputs and residuals), followed by one `custom_vjp_call` op that takes the
primal inputs, the residuals and fwd's primal outputs, and returns the primal outputs unchanged.
Its VJP calls the user's bwd on (residuals, output cotangents); the result is the cotangent of the
primal inputs, so no gradient flows back through fwd's own eqns (they only feed the op residuals).

Closed-over values (`num_consts`) are inputs of the op too, after the others. The user's bwd gives
them no cotangent, so a closed-over value that needs a gradient (a param, or a value computed from
one) is an error, as in JAX, never a silent zero: use `jax.closure_convert` or pass it as an
argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jax._src import ad_util

from jgraph import builder, ops
from jgraph.ir import is_float
from jgraph.vjp import defvjp, undifferentiable_inputs


@dataclass(frozen=True, eq=False)
class UserBwd:
    """The user's bwd (a flattened `lu.WrappedFun`), printed by name."""

    fn: Any  # called as fn(*residuals, *output_cotangents) -> one cotangent (or Zero) per input
    name: str  # the custom_vjp function's name

    def __repr__(self):
        return f"bwd({self.name})"

    __str__ = __repr__


def _shape_rule(*avals, n_primals, n_res, n_consts=0, **_):
    return list(avals[n_primals + n_res:len(avals) - n_consts])


def _lowering(*values, n_primals, n_res, n_consts=0, **_):
    return list(values[n_primals + n_res:len(values) - n_consts])


ops.defop("custom_vjp_call", _shape_rule, _lowering)


def _custom_vjp_call(b: builder.Builder, eqn, inputs):
    p = eqn.params
    if getattr(b, "in_custom_fwd", False):  # fwd's own values get no gradient: its primal will do
        return b.inline(p["call_jaxpr"].jaxpr, p["call_jaxpr"].consts, inputs)
    n_consts = p["num_consts"]
    primals = inputs[n_consts:]
    fwd_jaxpr, fwd_consts = p["fwd_jaxpr_thunk"].call_wrapped(
        *(is_float(a.aval) for a in primals))
    _, res_tree, input_fwds = p["out_trees"]()
    n_res_out = res_tree.num_leaves - sum(f is not None for f in input_fwds)
    # fwd closes over the same values as the call (its consts are the outer trace's): use the
    # call's const inputs for them.
    consts = inputs[:n_consts] if len(fwd_consts) == n_consts else fwd_consts
    b.in_custom_fwd = True  # a custom_vjp called by fwd (fwd calling f, typically) is inlined
    try:
        outs = b.inline(fwd_jaxpr, consts, primals)
    finally:
        b.in_custom_fwd = False
    res_out, primal_outs = iter(outs[:n_res_out]), outs[n_res_out:]
    # input_fwds index the call's inputs (closed-over consts first, then primals).
    res = [next(res_out) if f is None else inputs[f] for f in input_fwds]
    name = p.get("name") or getattr(p["call_jaxpr"].jaxpr.debug_info, "func_name", "custom_vjp")
    return b.bind("custom_vjp_call", *primals, *res, *primal_outs, *inputs[:n_consts],
                  n_primals=len(primals), n_res=len(res), n_consts=n_consts,
                  bwd=UserBwd(p["bwd"], str(name)),
                  symbolic_zeros=p["symbolic_zeros"])


builder._HANDLERS["custom_vjp_call"] = _custom_vjp_call


def _custom_vjp_call_vjp(cts, ins, outs, *, n_primals, n_res, bwd, symbolic_zeros, n_consts=0):
    res = ins[n_primals:n_primals + n_res]
    cts_in = bwd.fn.call_wrapped(*res, *cts)
    cts_in = [None if isinstance(ct, ad_util.Zero) or ct is None else ct for ct in cts_in]
    return cts_in + [None] * (len(ins) - n_primals)


defvjp("custom_vjp_call", _custom_vjp_call_vjp)
# Closed-over values get no cotangent from the user's bwd: needing one is an error.
undifferentiable_inputs["custom_vjp_call"] = lambda n_in, p: range(n_in - p.get("n_consts", 0),
                                                                   n_in)
