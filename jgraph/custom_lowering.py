"""How the custom-derivative ops lower, so that JAX keeps the user's rule at every order.

The tracer inlines a custom function's primal body (custom_vjp: the user's fwd) and follows it with
an op that returns those values (`jgraph.custom_derivatives`). Lowered as the identity, that op
would let the next differentiation (JAX's, or jgraph's tracing a compiled step) go through the
inlined body: the user's rule would be lost past the first derivative. So each op lowers as a
`jax.custom_jvp` / `jax.custom_vjp` function of its inputs that returns the inlined values
unchanged (XLA sees only the primal computation: a compiled step does no extra work) and whose
derivative is the user's rule on the primal inputs, with none through the inlined values.

The reference is JAX at every order: a compiled forward graph is `fn`, a compiled joint graph is
`jax.value_and_grad(fn)`. In the latter, JAX has already expanded each custom function on the
params' path (its jvp rule or its fwd runs as ordinary code), and so has jgraph's backward: such
an eqn ("expanded", `expanded_custom_eqns`) is differentiated as that code:
- custom_jvp_call: as the rule's primal outputs (a rule returning `f(x)` keeps `f`'s rule for the
  next order; one returning `jnp.sin(x)` does not, as in JAX), its values still the body's;
- custom_vjp_call: as fwd's outputs, i.e. it lowers as the identity on the inlined fwd.
Every other custom eqn (a forward graph's, one off the params' path, one in the backward or the
optimizer update) keeps its rule: custom_jvp_call the user's JVP, custom_vjp_call the user's bwd
(fwd's values are the inlined ones), and `custom_vjp_call_lazy` (a custom_vjp called by another's
fwd) the user's fwd and bwd. Forward mode through a custom_vjp is JAX's error, as in JAX.

A closed-over value (an op's `n_consts` inputs) has no derivative in the user's rule: JAX
differentiating through one is an error naming the function (JAX refuses it too), never a zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jex_core

from jgraph import _jax_internals as internals
from jgraph.errors import TransformError
from jgraph.ir import Graph, Var, is_float
from jgraph.ops import CUTS_GRADIENT, NON_DIFFERENTIABLE


def _zero(aval):
    """An array of zeros of `aval` (float0 for the tangent of an integer)."""
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, aval.dtype)
    return jnp.zeros(aval.shape, aval.dtype)


def _tangent(t, x):
    """Tangent `t` of primal `x` as an array (a symbolic zero instantiated)."""
    return _zero(jax.typeof(x).to_tangent_aval()) if type(t) is SymbolicZero else t


def _refuse_closed_over(perturbed, name: str) -> None:
    if any(perturbed):
        raise TransformError(
            f"a value closed over by {name} is differentiated: the user's rule gives it no "
            "derivative (JAX refuses this too); pass it to the function as an argument or use "
            "jax.closure_convert")


def _passing(start: int, stop: int):
    def passing(*values):  # the primal: the inlined outputs, unchanged
        return list(values[start:stop])

    return passing


def user_cotangents(bwd, res, cts, primal_avals) -> list:
    """The user's bwd (a `UserRule`) on (residuals, output cotangents): one cotangent per primal
    input, None where it is zero or the input is not floating. A cotangent of another floating
    dtype (f32 for a bf16 input) is cast to the input's dtype, so the backward stays typed; a
    Python scalar (which JAX accepts for a scalar input) becomes an array."""
    cts_in = list(internals.call_user_bwd(bwd.fn, *res, *cts))[bwd.n_lifted:]
    out = []
    for ct, aval in zip(cts_in, primal_avals, strict=True):
        if ct is None or isinstance(ct, internals.SymbolicZero) or not is_float(aval):
            out.append(None)
        else:
            ct = jnp.asarray(ct)
            out.append(ct if ct.dtype == aval.dtype else ct.astype(aval.dtype))
    return out


def _rule_outputs(jvp, symbolic_zeros, primals, t_primals):
    """The user's JVP rule on JAX values: (primal outputs, tangent outputs)."""
    # A zero tangent stays symbolic only for a rule that takes symbolic zeros (as in JAX).
    zero_in = [not is_float(jax.typeof(x)) or (symbolic_zeros and type(t) is SymbolicZero)
               for x, t in zip(primals, t_primals, strict=True)]
    jaxpr, consts, zero_out = jvp.fn.call_wrapped(*zero_in)
    result = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, consts))(
        *primals, *[_tangent(t, x) for x, t, z in zip(primals, t_primals, zero_in, strict=True)
                    if not z])
    primal_out, nonzero = list(result[:len(zero_out)]), iter(result[len(zero_out):])
    return primal_out, [_zero(jax.typeof(x).to_tangent_aval()) if z else next(nonzero)
                        for x, z in zip(primal_out, zero_out, strict=True)]


# -- custom_jvp_call: (consts, primals, body outputs) -> body outputs ----------------------------
def lower_custom_jvp_call(*values, n_consts, n_primals, jvp, symbolic_zeros):
    """The user's JVP rule (its primal outputs too, as JAX uses them)."""
    lo = n_consts + n_primals
    fn = jax.custom_jvp(_passing(lo, len(values)))

    def rule(values, tangents):
        _refuse_closed_over([type(t) is not SymbolicZero for t in tangents[:n_consts]],
                            f"custom_jvp function {jvp.name!r}")
        return _rule_outputs(jvp, symbolic_zeros, values[n_consts:lo], tangents[n_consts:lo])

    fn.defjvp(rule, symbolic_zeros=True)
    return fn(*values)


def lower_expanded_custom_jvp_call(*values, n_consts, n_primals, jvp, symbolic_zeros):
    """An expanded custom_jvp_call: the body's outputs, differentiated as the rule's primal
    outputs are (JAX code, with the rules of the custom functions it calls)."""
    lo = n_consts + n_primals
    fn = jax.custom_jvp(_passing(lo, len(values)))

    def rule(values, tangents):
        _refuse_closed_over([type(t) is not SymbolicZero for t in tangents[:n_consts]],
                            f"custom_jvp function {jvp.name!r}")
        primals, t_primals = values[n_consts:lo], tangents[n_consts:lo]
        moving = [k for k, (x, t) in enumerate(zip(primals, t_primals, strict=True))
                  if is_float(jax.typeof(x)) and type(t) is not SymbolicZero]

        def primal_out(*moved):
            args = list(primals)
            for k, x in zip(moving, moved, strict=True):
                args[k] = x
            zeros = [SymbolicZero(jax.typeof(x).to_tangent_aval()) for x in args]
            return _rule_outputs(jvp, symbolic_zeros, args, zeros)[0]

        if not moving:
            out = primal_out()
            return out, [_zero(jax.typeof(x).to_tangent_aval()) for x in out]
        return jax.jvp(primal_out, [primals[k] for k in moving], [t_primals[k] for k in moving])

    fn.defjvp(rule, symbolic_zeros=True)
    return fn(*values)


# -- custom_vjp_call: (primals, residuals, fwd's outputs, consts) -> fwd's outputs ---------------
def lower_custom_vjp_call(*values, n_primals, n_res, bwd, symbolic_zeros, n_consts=0):
    """The user's bwd on the residuals; fwd's values are the inlined ones."""
    lo, hi = n_primals + n_res, len(values) - n_consts
    primal_avals = tuple(jax.typeof(x) for x in values[:n_primals])
    fn = jax.custom_vjp(_passing(lo, hi))

    def fwd(*args):
        values = _unwrap(args[hi:], f"custom_vjp function {bwd.name!r}", args)
        return values[lo:hi], values[n_primals:lo]

    def bwd_rule(res, cts):
        cts = [_tangent(ct, x) for ct, x in zip(cts, values[lo:hi], strict=True)]
        return (*user_cotangents(bwd, res, cts, primal_avals), *[None] * (len(values) - n_primals))

    fn.defvjp(fwd, bwd_rule, symbolic_zeros=n_consts > 0)
    return fn(*values)


def _unwrap(consts, name, args) -> list:
    """The values of fwd's arguments. With closed-over values, fwd takes symbolic zeros (its
    arguments are `CustomVJPPrimal`s) to refuse a perturbed one; without, plain values (JAX's
    custom_vjp3 has no forward-mode error for symbolic zeros, only a `NotImplementedError`)."""
    if not consts:
        return list(args)
    _refuse_closed_over([a.perturbed for a in consts], name)
    return [a.value for a in args]


def lower_expanded_custom_vjp_call(*values, n_primals, n_res, n_consts=0, **_):
    """An expanded custom_vjp_call: fwd's outputs, as they are."""
    return list(values[n_primals + n_res:len(values) - n_consts])


# Ops whose lowering carries the user's rule, which JAX differentiates (jgraph has no rule).
RULE_IN_LOWERING = frozenset({"custom_vjp_call_lazy"})


def lower_custom_vjp_call_lazy(*values, n_consts, n_primals, fwd, bwd, symbolic_zeros):
    """`custom_vjp_call_lazy` (consts, primals, body outputs) -> body outputs; differentiated,
    it runs the user's fwd (primal outputs and residuals) and bwd, as JAX does."""
    lo = n_consts + n_primals
    primal_avals = tuple(jax.typeof(x) for x in values[n_consts:lo])
    fn = jax.custom_vjp(_passing(lo, len(values)))

    def fwd_rule(*args):
        values = _unwrap(args[:n_consts], f"custom_vjp function {bwd.name!r}", args)
        return fwd.run(values[:n_consts], values[n_consts:lo])

    def bwd_rule(res, cts):
        cts = [_tangent(ct, x) for ct, x in zip(cts, values[lo:], strict=True)]
        return (*[None] * n_consts, *user_cotangents(bwd, res, cts, primal_avals),
                *[None] * (len(values) - lo))

    fn.defvjp(fwd_rule, bwd_rule, symbolic_zeros=n_consts > 0)
    return fn(*values)


# -- which custom eqns a joint graph has already expanded ---------------------------------------
def _primal_positions(eqn) -> range:
    p = eqn.params
    if eqn.op == "custom_jvp_call":
        return range(p["n_consts"], p["n_consts"] + p["n_primals"])
    return range(p["n_primals"])


def expanded_custom_eqns(graph: Graph) -> frozenset:
    """The `custom_jvp_call` / `custom_vjp_call` eqns (in `graph` and its sub-graphs) that
    `jax.value_and_grad` would have expanded: those a param perturbs, outside the backward (and
    the optimizer update that reads it). Empty for a graph jgraph has not differentiated."""
    if not any("backward" in e.tags for e in graph.eqns):
        return frozenset()
    found: set = set()
    _walk(graph, [r == "param" for r in graph.input_roles], [False] * len(graph.inputs), found)
    return frozenset(found)


def _walk(graph: Graph, perturbed_in, late_in, found: set):
    """Propagate (perturbed by a param, computed by the backward) through `graph`; returns the
    flags of its outputs."""
    constant = NON_DIFFERENTIABLE | CUTS_GRADIENT  # outputs no param perturbs
    perturbed = {v for v, f in zip(graph.inputs, perturbed_in, strict=True) if f}
    late = {v for v, f in zip(graph.inputs, late_in, strict=True) if f}
    for eqn in graph.eqns:
        p_in = [isinstance(a, Var) and a in perturbed for a in eqn.inputs]
        l_in = [isinstance(a, Var) and a in late for a in eqn.inputs]
        sub = _SUBGRAPHS.get(eqn.op)
        if sub is not None:
            p_out, l_out = sub(eqn, p_in, l_in, found)
        else:
            backward = "backward" in eqn.tags or any(l_in)
            if eqn.op in ("custom_jvp_call", "custom_vjp_call") and not backward and any(
                    p_in[k] for k in _primal_positions(eqn)):
                found.add(eqn)
            moves = any(p_in) and eqn.op not in constant
            p_out, l_out = [moves] * len(eqn.outputs), [backward] * len(eqn.outputs)
        perturbed.update(v for v, f in zip(eqn.outputs, p_out, strict=True) if f)
        late.update(v for v, f in zip(eqn.outputs, l_out, strict=True) if f)
    return ([isinstance(a, Var) and a in perturbed for a in graph.outputs],
            [isinstance(a, Var) and a in late for a in graph.outputs])


def _or(a, b):
    return [x or y for x, y in zip(a, b, strict=True)]


def _walk_scan(eqn, p_in, l_in, found):
    body, nc, nk = eqn.params["body"], eqn.params["num_consts"], eqn.params["num_carry"]
    while True:  # a carry is perturbed if its initial value or any iteration's is
        p_out, l_out = _walk(body, p_in, l_in, found)
        p_next = p_in[:nc] + _or(p_in[nc:nc + nk], p_out[:nk]) + p_in[nc + nk:]
        l_next = l_in[:nc] + _or(l_in[nc:nc + nk], l_out[:nk]) + l_in[nc + nk:]
        if (p_next, l_next) == (p_in, l_in):
            return p_in[nc:nc + nk] + p_out[nk:], l_in[nc:nc + nk] + l_out[nk:]
        p_in, l_in = p_next, l_next


def _walk_cond(eqn, p_in, l_in, found):
    flags = [_walk(g, p_in[1:], l_in[1:], found) for g in eqn.params["branches"]]
    p_out, l_out = flags[0]
    for p, late in flags[1:]:
        p_out, l_out = _or(p_out, p), _or(l_out, late)
    return p_out, l_out


def _walk_while(eqn, p_in, l_in, found):
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    while True:
        carry_p, carry_l = p_in[nc + nb:], l_in[nc + nb:]
        _walk(p["cond_graph"], p_in[:nc] + carry_p, l_in[:nc] + carry_l, found)
        p_out, l_out = _walk(p["body"], p_in[nc:nc + nb] + carry_p, l_in[nc:nc + nb] + carry_l,
                             found)
        p_next, l_next = p_in[:nc + nb] + _or(carry_p, p_out), l_in[:nc + nb] + _or(carry_l,
                                                                                   l_out)
        if (p_next, l_next) == (p_in, l_in):
            return p_in[nc + nb:], l_in[nc + nb:]
        p_in, l_in = p_next, l_next


_SUBGRAPHS = {"scan": _walk_scan, "cond": _walk_cond, "while": _walk_while}
