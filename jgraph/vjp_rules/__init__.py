"""VJP rules: for each differentiable op, the cotangents of its inputs, emitted as IR eqns.

A rule is a JAX function `rule(cts, ins, outs, **params) -> cotangent per input (or None)`, where
`cts`, `ins` and `outs` are tuples of arrays. The backward pass traces it once per (rule, params,
avals) and replays it as eqns (`jgraph.builder.Builder.call`), so rules read like JAX code and
what they emit is ordinary IR. Families share helpers (`defunary`, `defbinary`, `unbroadcast`).
Where cheap, a rule uses the same formula as JAX's, so that gradients agree bitwise.

The rules live by op family in the submodules (`elementwise`, `structural`, `indexing`,
`contractions`, `reductions`, `linalg`, `fft`); importing this package registers them all.

Ops in NON_DIFFERENTIABLE have no floating outputs that depend differentiably on their inputs
(their gradient is zero, as in JAX); ops in CUTS_GRADIENT stop gradient flow. Any other op met on
the gradient path without a rule is an error naming the op and the user's source line (never a
silent zero).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from jgraph.errors import TransformError
from jgraph.ir import is_float
from jgraph.ops import EFFECTFUL

vjp_rules: dict[str, Callable] = {}
# op -> fn(n_inputs, params) -> input positions the rule never differentiates (error if needed).
undifferentiable_inputs: dict[str, Callable] = {}

# Ops whose outputs carry no gradient to their inputs.
CUTS_GRADIENT = frozenset({"stop_gradient"})
# Ops with no differentiable floating output (comparisons, integer ops, RNG bits, piecewise
# constant functions, ...): their gradient is zero.
NON_DIFFERENTIABLE = frozenset(
    {"eq", "ne", "lt", "le", "gt", "ge", "eq_to", "le_to", "lt_to", "and", "or", "not", "xor",
     "iota", "argmax", "argmin", "is_finite", "sign", "floor", "ceil", "round", "stop_gradient",
     "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "clz",
     "mulhi", "random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in",
     "random_split", "threefry2x32", "rng_bit_generator", "rng_uniform", "nextafter",
     "reduce_and", "reduce_or", "reduce_xor", "bitcast_convert_type", "zeros_like",
     "create_token", "after_all", "platform_index", "empty", "empty2",
     "lu_pivots_to_permutation", "debug_print"}
)
# Ops that are registered (they trace, evaluate and compile) but have no VJP rule, and why. On the
# gradient path each is a TransformError naming the op, the reason and the user's line.
NO_VJP_RULE = {
    **dict.fromkeys(("psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all",
                     "ragged_all_to_all", "axis_index"),
                    "a collective over named axes (inside shard_map/pmap): jgraph differentiates "
                    "shard_map's typed collectives only (check_vma=True: pvary and psum)"),
    **dict.fromkeys(("igamma", "igammac", "igamma_grad_a", "random_gamma",
                     "regularized_incomplete_beta", "zeta"),
                    "special function without a jgraph rule yet (jax.scipy.special.gammainc, "
                    "betainc, zeta, jax.random.gamma)"),
    **dict.fromkeys(("hessenberg", "householder_product", "schur", "tridiagonal",
                     "tridiagonal_solve", "approx_top_k"),
                    "no jgraph rule yet (rarely on a training path); JAX differentiates some"),
    "reduce_window": "a windowed reduction with a user computation: only the sum/max/min "
                     "windows (reduce_window_sum/max/min) have rules",
    "select_and_scatter": "XLA's select-and-scatter with a user computation (JAX has no "
                          "VJP for it either)",
    "while": "a loop with a data-dependent trip count has no reverse-mode derivative (as in "
             "JAX); use lax.scan or lax.fori_loop with static bounds",
}


def add_cotangents(a, b):
    return a + b


def unbroadcast(ct, x):
    """Sum `ct` down to the shape of `x` (undoes rank-0 and size-1 broadcasting of nary ops)."""
    if ct.shape == x.shape:
        return ct
    if x.ndim == 0:
        return jnp.sum(ct).astype(ct.dtype)
    dims = tuple(i for i, (a, b) in enumerate(zip(ct.shape, x.shape, strict=True)) if a != b)
    return ct.sum(axis=dims).reshape(x.shape)


def apply_rule(b, eqn, out_cts, needed=None):
    """Emit the eqns of `eqn`'s VJP rule; return one cotangent atom (or None) per input.

    `needed` (one bool per input) says which cotangents the caller will use; the others are
    returned as None and their eqns are not emitted.
    """
    rule = vjp_rules.get(eqn.op)
    if rule is None:
        if eqn.op in NON_DIFFERENTIABLE or not any(is_float(v.aval) for v in eqn.outputs):
            return [None] * len(eqn.inputs)
        why = f": {NO_VJP_RULE[eqn.op]}" if eqn.op in NO_VJP_RULE else ""
        raise TransformError(
            f"no VJP rule for op {eqn.op!r}{why}; it is on the gradient path"
            + (f" at {eqn.source}" if eqn.source else "")
            + " (jgraph never substitutes a zero gradient)"
        )
    n_in, n_out = len(eqn.inputs), len(eqn.outputs)
    positions = undifferentiable_inputs.get(eqn.op)
    if positions is not None and needed is not None:
        for k in positions(n_in, eqn.params):
            if needed[k]:
                raise TransformError(
                    f"op {eqn.op!r} gives its input {k} no cotangent, but that input needs a "
                    f"gradient" + (f" at {eqn.source}" if eqn.source else "")
                    + " (for custom_jvp/custom_vjp: a closed-over value on the gradient path; "
                    "pass it as an argument or use jax.closure_convert)")
    cts = list(out_cts)
    for k, ct in enumerate(cts):
        if ct is None:  # an output nobody differentiates through: a zero cotangent
            cts[k] = b.call(jnp.zeros_like, eqn.outputs[k])[0]
    needed = (True,) * n_in if needed is None else tuple(needed)
    start = len(b.eqns)
    outs = b.call(_run_rule, *eqn.inputs, *eqn.outputs, *cts, rule=rule, n_in=n_in, n_out=n_out,
                  params=_freeze(eqn.params), needed=needed)
    if getattr(rule, "replays_forward", False):  # its prints ran in the forward already
        b.eqns[start:] = [e for e in b.eqns[start:] if e.op not in EFFECTFUL]
    return outs + [None] * (n_in - len(outs))


def _run_rule(*arrays, rule, n_in, n_out, params, needed):
    ins, outs, cts = arrays[:n_in], arrays[n_in:n_in + n_out], arrays[n_in + n_out:]
    # A rule that can skip work for unneeded cotangents says so (`wants_needed`): the custom_jvp
    # rule, whose tangents are then symbolic zeros (a closed-over value's must be).
    extra = {"needed": needed} if getattr(rule, "wants_needed", False) else {}
    result = list(rule(cts, ins, outs, **dict(params), **extra))
    # Cotangents of integer inputs (indices, exponents) are dropped, whatever the rule said, and
    # so are those the caller does not need (the call's template drops the eqns computing them).
    return [None if ct is None or not use or not jnp.issubdtype(x.dtype, jnp.inexact) else ct
            for ct, x, use in zip(result, ins, needed, strict=False)]


def _freeze(params):
    return tuple(sorted(params.items()))


def defvjp(op: str, rule: Callable) -> None:
    vjp_rules[op] = rule


def defunary(op: str, fn: Callable) -> None:
    """Rule for a one-input op from `fn(ct, x, y) -> ct_x` (y is the op's output)."""
    vjp_rules[op] = lambda cts, ins, outs, **p: [fn(cts[0], ins[0], outs[0])]


def defbinary(op: str, fn: Callable) -> None:
    """Rule for a two-input op from `fn(ct, x, y, z) -> (ct_x, ct_y)`, unbroadcast after."""
    def rule(cts, ins, outs, **p):
        cx, cy = fn(cts[0], ins[0], ins[1], outs[0])
        return [unbroadcast(cx, ins[0]), unbroadcast(cy, ins[1])]

    vjp_rules[op] = rule


def deflinear(op: str, fn: Callable) -> None:
    """Rule for an op linear in its first input: `fn(ct, x, **params) -> ct_x`."""
    vjp_rules[op] = lambda cts, ins, outs, **p: [fn(cts[0], ins[0], **p)]


# Registration of the rules, by op family (imported for their side effect on `vjp_rules`).
from jgraph import (  # noqa: E402,F401  (tracer handlers)
    control_flow,
    custom_derivatives,
    effects,
    hi_primitives,
)
from jgraph.vjp_rules import (  # noqa: E402
    collectives,
    contractions,
    custom,
    elementwise,
    fft,
    indexing,
    linalg,
    linear_solve,
    loops,
    reductions,
    structural,
)

__all__ = ["CUTS_GRADIENT", "NON_DIFFERENTIABLE", "NO_VJP_RULE", "add_cotangents", "apply_rule",
           "collectives", "contractions", "custom", "defbinary", "deflinear", "defunary", "defvjp",
           "elementwise", "fft", "indexing", "linalg", "linear_solve", "loops", "reductions",
           "structural", "unbroadcast", "vjp_rules"]
