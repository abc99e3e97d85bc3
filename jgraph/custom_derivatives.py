"""`jax.custom_jvp` and `jax.custom_vjp` in user code: tracer handlers and the ops they emit.

custom_jvp. The tracer inlines the primal body (so the forward is unchanged, bit for bit), followed
by one `custom_jvp_call` op that takes the call's closed-over values, its primal inputs and the
body's outputs, and returns those outputs unchanged. The backward pass reaches the body's values
only through that op, whose VJP is the user's JVP rule linearized and transposed
(`jgraph.vjp_rules.custom`): `jax.nn.relu'(0)` is 0 and `softplus'(0)` is 1/2, as in JAX.

custom_vjp. The tracer emits, as JAX does under differentiation, the eqns of the user's fwd (primal
outputs and residuals), followed by one `custom_vjp_call` op that takes the primal inputs, the
residuals, fwd's primal outputs and the closed-over values, and returns the primal outputs
unchanged. Its VJP calls the user's bwd on (residuals, output cotangents), so no gradient flows back
through fwd's own eqns (they only feed the op residuals).

Closed-over values (`num_consts`) get no cotangent from the user's rules: one that needs a gradient
is an error, as in JAX, never a silent zero (`jgraph.backward.undifferentiable_inputs`). So are
those that vmap passes a custom_vjp it binds again as leading primal inputs (`UserFwd.n_lifted`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jax.extend import core as jex_core

from jgraph import _jax_internals as internals
from jgraph import ops
from jgraph.builder import Builder, handler
from jgraph.custom_lowering import (
    lower_custom_jvp_call,
    lower_custom_vjp_call,
    lower_custom_vjp_call_lazy,
    lower_expanded_custom_jvp_call,
    lower_expanded_custom_vjp_call,
)
from jgraph.ir import is_float


@dataclass(frozen=True, eq=False)
class UserRule:
    """A user's JVP rule or bwd as JAX stages it, printed by name (`jvp(relu)`, `bwd(f)`)."""

    fn: Any  # custom_jvp: the jvp thunk; custom_vjp: the flattened bwd
    kind: str  # "jvp" or "bwd"
    name: str  # the custom function's name
    n_lifted: int = 0  # bwd's leading cotangents, of closed-over values (zeros), dropped

    def __repr__(self):
        return f"{self.kind}({self.name})"

    __str__ = __repr__


def _name(closed_jaxpr, default: str) -> str:
    return getattr(closed_jaxpr.jaxpr.debug_info, "func_name", "") or default


# -- custom_jvp_call: inputs (consts, primals, body outputs) -> body outputs ----------------------
def _jvp_outputs(*values, n_consts, n_primals, **_):
    return list(values[n_consts + n_primals:])


ops.defop("custom_jvp_call", _jvp_outputs, lower_custom_jvp_call)
ops.expanded_lowerings["custom_jvp_call"] = lower_expanded_custom_jvp_call


@handler("custom_jvp_call")
def _custom_jvp_call(b: Builder, eqn, inputs):
    body, jvp, n_consts, symbolic_zeros = internals.custom_jvp_params(eqn.params)
    outs = b.inline(body.jaxpr, body.consts, inputs)
    return b.bind("custom_jvp_call", *inputs, *outs, n_consts=n_consts,
                  n_primals=len(inputs) - n_consts,
                  jvp=UserRule(jvp, "jvp", _name(body, "custom_jvp")),
                  symbolic_zeros=symbolic_zeros)


# -- custom_vjp_call: inputs (primals, residuals, primal outs, consts) -> primal outs -------------
def _vjp_outputs(*values, n_primals, n_res, n_consts=0, **_):
    return list(values[n_primals + n_res:len(values) - n_consts])


ops.defop("custom_vjp_call", _vjp_outputs, lower_custom_vjp_call)
ops.expanded_lowerings["custom_vjp_call"] = lower_expanded_custom_vjp_call


@handler("custom_vjp_call")
def _custom_vjp_call(b: Builder, eqn, inputs):
    body, fwd, bwd, residuals, n_consts, symbolic_zeros = internals.custom_vjp_params(eqn.params)
    name = str(eqn.params.get("name") or _name(body, "custom_vjp"))
    user_fwd = UserFwd.trace(fwd, residuals, n_consts, inputs[n_consts:], name)
    # Closed-over values that vmap made leading primal inputs are closed-over values again.
    n_lifted = user_fwd.n_lifted
    return emit_custom_vjp(b, inputs, n_consts + n_lifted, (body.jaxpr, body.consts), user_fwd,
                           UserRule(bwd, "bwd", name, n_lifted), symbolic_zeros)


def emit_custom_vjp(b: Builder, inputs, n_consts, body, user_fwd, bwd, symbolic_zeros,
                    primal_from_body=False) -> list:
    """The eqns of a custom_vjp call on `inputs` (closed-over consts, then primals): fwd's eqns and
    a `custom_vjp_call` op; called by another's fwd, the body and a `custom_vjp_call_lazy` op.
    With `primal_from_body`, the op's primal outputs are the body's (fwd gives the residuals)."""
    primals = inputs[n_consts:]
    if b.in_custom_fwd:  # called by a fwd: its own fwd is traced only if differentiated
        outs = b.inline(*body, inputs)
        return b.bind("custom_vjp_call_lazy", *inputs, *outs, n_consts=n_consts,
                      n_primals=len(primals), fwd=user_fwd, bwd=bwd,
                      symbolic_zeros=symbolic_zeros)
    consts = inputs[:n_consts] if user_fwd.consts is None else user_fwd.consts
    b.in_custom_fwd = True
    try:
        outs = b.inline(user_fwd.jaxpr, consts, inputs[n_consts - user_fwd.n_lifted:])
        primal_outs = b.inline(*body, inputs) if primal_from_body else outs[user_fwd.n_res_out:]
    finally:
        b.in_custom_fwd = False
    res_out = iter(outs[:user_fwd.n_res_out])
    # input_fwds index the call's inputs (closed-over consts first, then primals).
    res = [next(res_out) if f is None else inputs[f] for f in user_fwd.input_fwds]
    return b.bind("custom_vjp_call", *primals, *res, *primal_outs, *inputs[:n_consts],
                  n_primals=len(primals), n_res=len(res), n_consts=n_consts, bwd=bwd,
                  symbolic_zeros=symbolic_zeros)


@handler("remat_opt")
def _remat_opt(b: Builder, eqn, inputs):
    """`jax.custom_vjp(..., optimize_remat=True)` wraps fwd in `remat_opt`: outside a remat, or
    under one whose (outermost) policy saves it, fwd's eqns, inlined. Under any other remat, as in
    JAX, the primal outputs come from the custom function itself and only the residuals from fwd
    (JAX's gh21303: a fwd whose primal output is not the function's), and the remat recomputes
    those for the backward. (Also fwd's, for a function closing over traced values.)"""
    policies = b.remat_policies()
    split = None
    if policies and not internals.remat_opt_saved(policies[0], eqn):
        split = internals.remat_opt_split(eqn.params)
    if split is None:
        fwd = internals.remat_opt_fwd(eqn.params)
        return b.inline(fwd.jaxpr, fwd.consts, inputs)
    (res_jaxpr, res_consts), (fun_jaxpr, fun_consts) = split
    residuals = b.inline(res_jaxpr, res_consts, inputs)
    return residuals + b.inline(fun_jaxpr, fun_consts, inputs[len(inputs) - len(fun_jaxpr.invars):])


# -- custom_vjp_call_lazy: inputs (consts, primals, body outputs) -> body outputs -----------------
# A custom_vjp called by another custom_vjp's fwd. jgraph's backward never reaches it (fwd's
# values get no gradient), but a compiled step differentiated again does: it lowers with the
# user's fwd and bwd (`jgraph.custom_lowering`), so the next order uses the rule, as JAX does.
ops.defop("custom_vjp_call_lazy", _jvp_outputs, lower_custom_vjp_call_lazy)


@dataclass(frozen=True, eq=False)
class UserFwd:
    """A custom_vjp's fwd as traced by JAX, printed by name; `run` evaluates it."""

    jaxpr: Any  # (lifted consts, primals) -> (residuals not forwarded from the inputs, primal outs)
    consts: Any  # its constants, or None: the call's own const inputs
    input_fwds: tuple  # per residual: the index of the call input it is, or None
    n_res_out: int  # residuals the jaxpr computes
    name: str  # the custom function's name
    n_lifted: int = 0  # the call's last consts, which vmap passes to the jaxpr as inputs

    @classmethod
    def trace(cls, fwd, residuals, n_consts, primals, name) -> UserFwd:
        jaxpr, consts, n_lifted = internals.trace_custom_vjp_fwd(
            fwd, [is_float(a.aval) for a in primals])
        res_tree, input_fwds = residuals()
        n_res_out = res_tree.num_leaves - sum(f is not None for f in input_fwds)
        # fwd closes over the same values as the call (its consts are the outer trace's): use
        # the call's const inputs for them.
        own = None if len(consts) == n_consts + n_lifted else tuple(consts)
        return cls(jaxpr, own, tuple(input_fwds), n_res_out, name, n_lifted)

    def run(self, consts, primals):
        """(primal outputs, residuals) of fwd on JAX values."""
        closed = jex_core.ClosedJaxpr(self.jaxpr, list(consts if self.consts is None
                                                       else self.consts))
        outs = jex_core.jaxpr_as_fun(closed)(*consts[len(consts) - self.n_lifted:], *primals)
        res_out, inputs = iter(outs[:self.n_res_out]), (*consts, *primals)
        res = [next(res_out) if f is None else inputs[f] for f in self.input_fwds]
        return list(outs[self.n_res_out:]), res

    def __repr__(self):
        return f"fwd({self.name})"

    __str__ = __repr__
