"""Op families of floating math: elementwise functions (and ones with custom derivatives),
broadcasting binaries, `dot_general` with batch dims, reductions, and constants."""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jgraph.testing.families import (
    LIMIT,
    Family,
    Proposal,
    axis_of,
    binary,
    is_float,
    pick,
    ranked,
    register,
    unary,
    with_literal,
)
from jgraph.testing.recipe import FLOAT

# -- elementwise, floating ---------------------------------------------------------------------
register(Family("tanh", jnp.tanh, unary(lambda b: 1.0), "elementwise"))
register(Family("sin", jnp.sin, unary(lambda b: 1.0), "elementwise"))
register(Family("cos", jnp.cos, unary(lambda b: 1.0), "elementwise"))
register(Family("logistic", jax.nn.sigmoid, unary(lambda b: 1.0), "elementwise"))
register(Family("exp", jnp.exp, unary(math.exp, ok=lambda b: b <= 4.0), "elementwise"))
register(Family("log1p_square", lambda x: jnp.log1p(x * x), unary(lambda b: math.log1p(b * b)),
                "elementwise"))
register(Family("sqrt_1p_square", lambda x: jnp.sqrt(1.0 + x * x),
                unary(lambda b: math.sqrt(1 + b * b)), "elementwise"))
register(Family("stop_gradient", lax.stop_gradient, unary(lambda b: b), "elementwise"))
register(Family("relu", jax.nn.relu, unary(lambda b: b), "custom"))
register(Family("softplus", jax.nn.softplus, unary(lambda b: b + 1.0), "custom"))


def _power(x, *, n):
    return x ** n


def _draw_power(c, slots):
    x = pick(c, slots, lambda s: is_float(s) and s.bound ** 3 <= LIMIT)
    if x is None:
        return None
    n = c.choice((2, 3))
    return Proposal((x,), {"n": n}, slots[x].bound ** n)


register(Family("integer_pow", _power, _draw_power, "elementwise"))


def _scale(x, *, c):
    return x * c


register(Family("scale", _scale, with_literal(operator.mul), "elementwise"))


def _rsub(x, *, c):
    return c - x


register(Family("rsub", _rsub, with_literal(operator.add), "elementwise"))


@jax.custom_vjp
def sin_custom_vjp(x):
    return jnp.sin(x)


sin_custom_vjp.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda cos, g: (g * cos,))
register(Family("sin_custom_vjp", sin_custom_vjp, unary(lambda b: 1.0), "custom"))

# -- broadcasting binaries ---------------------------------------------------------------------
register(Family("add", jnp.add, binary(operator.add), "binary"))
register(Family("sub", jnp.subtract, binary(operator.add), "binary"))
register(Family("mul", jnp.multiply, binary(operator.mul), "binary"))
register(Family("maximum", jnp.maximum, binary(max), "binary"))
register(Family("div_1p_square", lambda x, y: x / (1.0 + y * y), binary(lambda a, b: a),
                "binary"))


# -- contraction -------------------------------------------------------------------------------
def _dot(x, y, *, dims):
    return lax.dot_general(x, y, dims)


def _draw_dot(c, slots):
    """Mostly matrix products: one contracting pair (an outer product one time in four), then
    up to two more pairs of equal dims, each contracting or batch."""
    x = pick(c, slots, ranked(FLOAT))
    if x is None:
        return None
    sx = slots[x].shape
    y = pick(c, slots, lambda s: s.kind == FLOAT and bool(set(s.shape) & set(sx)))
    sy = slots[y].shape
    pairs = [(i, j) for i in range(len(sx)) for j in range(len(sy)) if sx[i] == sy[j]]
    contract, batch, used_x, used_y = ([], []), ([], []), set(), set()
    first = [] if c.integer(0, 3) == 3 else [c.choice(pairs)]
    more = [c.choice(pairs) for _ in range(c.integer(0, 2))]
    for n, (i, j) in enumerate(first + more):
        if i in used_x or j in used_y:
            continue
        used_x.add(i)
        used_y.add(j)
        into = batch if n > 0 and c.boolean() else contract
        into[0].append(i)
        into[1].append(j)
    k = math.prod(sx[i] for i in contract[0])
    b = slots[x].bound * slots[y].bound * k
    if b > LIMIT:
        return None
    dims = ((tuple(contract[0]), tuple(contract[1])), (tuple(batch[0]), tuple(batch[1])))
    return Proposal((x, y), {"dims": dims}, b)


register(Family("dot_general", _dot, _draw_dot, "contraction"))


# -- reductions --------------------------------------------------------------------------------
_REDUCERS = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "mean": jnp.mean, "prod": jnp.prod,
             "logsumexp": jax.nn.logsumexp}


def _reduce(x, *, op, axes, keepdims):
    return _REDUCERS[op](x, axis=axes, keepdims=keepdims)


def _draw_reduce(c, slots):
    x = pick(c, slots, ranked(FLOAT))
    if x is None:
        return None
    s = slots[x]
    axes = c.subset(range(len(s.shape)), min_size=1)
    n = math.prod(s.shape[a] for a in axes)
    op = c.choice(tuple(_REDUCERS))
    b = {"sum": s.bound * n, "prod": s.bound ** n, "logsumexp": s.bound + math.log(n)}.get(
        op, s.bound)
    if b > LIMIT:
        return None
    return Proposal((x,), {"op": op, "axes": axes, "keepdims": c.boolean()}, b)


register(Family("reduce", _reduce, _draw_reduce, "reduction"))


def _cumsum(x, *, axis, reverse):
    return lax.cumsum(x, axis, reverse)


def _draw_cumsum(c, slots):
    x = pick(c, slots, ranked(FLOAT))
    if x is None:
        return None
    s = slots[x]
    axis = axis_of(c, s)
    b = s.bound * s.shape[axis]
    return None if b > LIMIT else Proposal((x,), {"axis": axis, "reverse": c.boolean()}, b)


register(Family("cumsum", _cumsum, _draw_cumsum, "reduction"))


# -- constants ---------------------------------------------------------------------------------
def _constant(*, n, dtype):
    return jnp.asarray(np.linspace(-1.0, 1.0, n), dtype)  # a closed-over array: a literal


def _iota(*, n, dtype):
    return lax.iota(np.dtype(dtype), n) * 0.5


def _draw_constant(c, slots):
    return Proposal((), {"n": c.integer(1, 4), "dtype": c.dtype}, 2.0)


register(Family("constant", _constant, _draw_constant, "constant"))
register(Family("iota", _iota, _draw_constant, "constant"))
