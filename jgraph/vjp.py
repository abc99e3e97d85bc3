"""VJP rules: for each differentiable op, the cotangents of its inputs, emitted as IR eqns.

A rule is a JAX function `rule(cts, ins, outs, **params) -> cotangent per input (or None)`, where
`cts`, `ins` and `outs` are tuples of arrays. The backward pass traces it once per (rule, params,
avals) and inlines the result (see `jgraph.builder.Builder.call`), so rules read like JAX code and
what they emit is ordinary IR. Families share helpers (`defunary`, `defbinary`, `unbroadcast`).

Ops in NON_DIFFERENTIABLE have no floating outputs that depend differentiably on their inputs;
ops in CUTS_GRADIENT stop gradient flow. Any other op met on the gradient path without a rule is an
error naming the op and the user's source line (never a silent zero).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax

from jgraph.errors import TransformError
from jgraph.ir import is_float

vjp_rules: dict[str, Callable] = {}

# Ops whose outputs carry no gradient to their inputs.
CUTS_GRADIENT = frozenset({"stop_gradient"})
# Ops with no differentiable floating output (comparisons, integer ops, RNG bits, ...).
NON_DIFFERENTIABLE = frozenset(
    {"eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "iota", "argmax", "argmin",
     "is_finite", "sign", "floor", "ceil", "round", "stop_gradient", "shift_left",
     "shift_right_logical", "shift_right_arithmetic", "population_count", "clz",
     "random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in",
     "random_split", "threefry2x32", "rng_bit_generator", "rng_uniform", "nextafter",
     "reduce_and", "reduce_or", "reduce_xor", "bitcast_convert_type"}
)


def add_cotangents(a, b):
    return a + b


def unbroadcast(ct, x):
    """Sum `ct` down to the shape of `x` (undoes rank-0 broadcasting of binary ops)."""
    if ct.shape == x.shape:
        return ct
    return jnp.sum(ct).astype(ct.dtype) if x.ndim == 0 else ct.sum(
        axis=tuple(i for i, (a, b) in enumerate(zip(ct.shape, x.shape)) if a != b), keepdims=True)


def apply_rule(b, eqn, out_cts):
    """Emit the eqns of `eqn`'s VJP rule; return one cotangent atom (or None) per input."""
    rule = vjp_rules.get(eqn.op)
    if rule is None:
        if eqn.op in NON_DIFFERENTIABLE or not any(is_float(v.aval) for v in eqn.outputs):
            return [None] * len(eqn.inputs)
        raise TransformError(
            f"no VJP rule for op {eqn.op!r}, which is on the gradient path"
            + (f" at {eqn.source}" if eqn.source else "")
            + " (jgraph never substitutes a zero gradient)"
        )
    n_in, n_out = len(eqn.inputs), len(eqn.outputs)
    cts = list(out_cts)
    for k, ct in enumerate(cts):
        if ct is None:  # an output nobody differentiates through: a zero cotangent
            cts[k] = b.call(jnp.zeros_like, eqn.outputs[k])[0]
    return b.call(_run_rule, *eqn.inputs, *eqn.outputs, *cts, rule=rule, n_in=n_in, n_out=n_out,
                  params=_freeze(eqn.params))


def _run_rule(*arrays, rule, n_in, n_out, params):
    ins, outs, cts = arrays[:n_in], arrays[n_in:n_in + n_out], arrays[n_in + n_out:]
    result = rule(cts, ins, outs, **dict(params))
    return list(result)


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


# -- elementwise ----------------------------------------------------------------------------------
defbinary("add", lambda ct, x, y, z: (ct, ct))
defbinary("add_any", lambda ct, x, y, z: (ct, ct))
defbinary("sub", lambda ct, x, y, z: (ct, -ct))
defbinary("mul", lambda ct, x, y, z: (ct * y, ct * x))
defbinary("div", lambda ct, x, y, z: (ct / y, -ct * x / (y * y)))
defunary("neg", lambda ct, x, y: -ct)
defunary("tanh", lambda ct, x, y: ct * (1 - y * y))
defunary("exp", lambda ct, x, y: ct * y)
defunary("log", lambda ct, x, y: ct / x)
defunary("logistic", lambda ct, x, y: ct * y * (1 - y))
defunary("copy", lambda ct, x, y: ct)
defunary("name", lambda ct, x, y: ct)
defunary("convert_element_type", lambda ct, x, y: ct.astype(x.dtype))


# -- structural -----------------------------------------------------------------------------------
def _reduce_sum_vjp(cts, ins, outs, *, axes, **_):
    (x,) = ins
    kept = tuple(d for d in range(x.ndim) if d not in axes)
    return [lax.broadcast_in_dim(cts[0], x.shape, kept)]


defvjp("reduce_sum", _reduce_sum_vjp)


def _broadcast_in_dim_vjp(cts, ins, outs, *, shape, broadcast_dimensions, **_):
    x = ins[0]
    ct = cts[0]
    new_dims = tuple(d for d in range(len(shape)) if d not in broadcast_dimensions)
    expanded = tuple(i for i, d in enumerate(broadcast_dimensions) if x.shape[i] == 1 and shape[d]
                     != 1)
    ct = ct.sum(axis=new_dims + tuple(broadcast_dimensions[i] for i in expanded))
    ct = jnp.expand_dims(ct, expanded) if expanded else ct
    return [ct.reshape(x.shape)] + [None] * (len(ins) - 1)


defvjp("broadcast_in_dim", _broadcast_in_dim_vjp)


# -- contractions ---------------------------------------------------------------------------------
def _dot_transpose(ct, other, self_ndim, self_c, other_c, self_b, other_b, ct_self_free,
                   ct_other_free, other_free, dtype):
    """Cotangent of one dot_general operand: contract ct with the other operand, then permute."""
    nb = len(self_b)
    dims = ((tuple(ct_other_free), tuple(other_free)), (tuple(range(nb)), tuple(other_b)))
    r = lax.dot_general(ct, other, dims, preferred_element_type=dtype)
    # r's dims: batch, self free (as in ct), then other's remaining dims (its contracting ones,
    # in increasing order), each standing for the matching contracting dim of self.
    other_rest = sorted(other_c)
    self_free = [d for d in range(self_ndim) if d not in self_c and d not in self_b]
    src = list(self_b) + self_free + [self_c[list(other_c).index(d)] for d in other_rest]
    return lax.transpose(r, tuple(src.index(d) for d in range(self_ndim))).astype(dtype)


def _dot_general_vjp(cts, ins, outs, *, dimension_numbers, **_):
    (xc, yc), (xb, yb) = dimension_numbers
    x, y = ins
    ct = cts[0]
    nb = len(xb)
    x_free = [d for d in range(x.ndim) if d not in xc and d not in xb]
    y_free = [d for d in range(y.ndim) if d not in yc and d not in yb]
    ct_x_free = range(nb, nb + len(x_free))
    ct_y_free = range(nb + len(x_free), nb + len(x_free) + len(y_free))
    dx = _dot_transpose(ct, y, x.ndim, xc, yc, xb, yb, ct_x_free, ct_y_free, y_free, x.dtype)
    dy = _dot_transpose(ct, x, y.ndim, yc, xc, yb, xb, ct_y_free, ct_x_free, x_free, y.dtype)
    return [dx, dy]


defvjp("dot_general", _dot_general_vjp)
