"""JAX's next remat and custom_vjp: the `jax_remat3` and `jax_custom_vjp3` config flags.

Off by default in JAX 0.10, these flags make `jax.checkpoint`, `checkpoint_name` and
`jax.custom_vjp` bind one primitive, `call_hi_primitive`, which carries an object describing the
call. The tracer rewrites each into the same IR as today's primitives give, so every transform and
every public API behaves the same under both flag settings:
- a remat (`jax.checkpoint`): a checkpoint region around its inlined body, with its policy;
- a checkpoint name: the `name` op;
- a custom_vjp (or any such primitive with a fwd and a bwd): fwd's eqns and a `custom_vjp_call`
  op whose VJP is the user's bwd (`jgraph.custom_derivatives.emit_custom_vjp`).
Any other kind is a `TraceError` naming it and the user's line.
"""

from __future__ import annotations

import jax

from jgraph import _jax_internals as internals
from jgraph.builder import Builder, handler
from jgraph.custom_derivatives import UserFwd, UserRule, emit_custom_vjp
from jgraph.errors import TraceError
from jgraph.ir import is_float


def _specs(inputs):
    return [jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype, weak_type=a.aval.weak_type)
            for a in inputs]


@handler("call_hi_primitive")
def _call_hi_primitive(b: Builder, eqn, inputs):
    kind, parts = internals.hi_primitive(eqn.params)
    if kind == "remat":
        jaxpr, policy = parts
        name = getattr(jaxpr.jaxpr.debug_info, "func_name", "") or ""
        saved = b.regions
        b.enter_region(policy, True, name)
        try:
            return b.inline(jaxpr.jaxpr, jaxpr.consts, inputs)
        finally:
            b.regions = saved
    if kind == "name":
        return b.bind("name", *inputs, name=parts)
    if kind == "vjp":
        return _custom_vjp(b, parts, inputs)
    raise TraceError(f"JAX's call_hi_primitive of kind {kind!r} is not supported by jgraph, at "
                     f"{b.source}")


def _custom_vjp(b: Builder, hi, inputs):
    specs = _specs(inputs)
    body = hi.body(specs)
    fwd = hi.fwd(specs, [is_float(a.aval) for a in inputs])
    n_res = hi.res_tree.num_leaves
    user_fwd = UserFwd(fwd.jaxpr, tuple(fwd.consts), (None,) * n_res, n_res, hi.name)
    # optimize_remat=True under any remat (whatever its policy): JAX's `OptRemat` computes the
    # primal outputs with the function itself, and fwd only the residuals.
    return emit_custom_vjp(b, inputs, 0, (body.jaxpr, body.consts), user_fwd,
                           UserRule(hi, "bwd", hi.name), False,
                           primal_from_body=hi.opt_remat and bool(b.remat_policies()))
