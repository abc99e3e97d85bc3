"""Op families of integer and boolean side computations: comparisons, logic, integer arithmetic,
argmax, and conversions between floats and integers (which cut gradients)."""

from __future__ import annotations

import jax.numpy as jnp

from jgraph.testing.families import Family, Proposal, axis_of, binary, pick, ranked, register, unary
from jgraph.testing.recipe import BOOL, FLOAT, INT, INT_HIGH


# -- integer and boolean side computations -----------------------------------------------------
def _compare(x, y, *, op):
    return getattr(jnp, op)(x, y)


def _draw_compare(c, slots):
    d = binary(lambda a, b: 1.0)(c, slots)
    if d is None:
        return None
    return Proposal(d.operands, {"op": c.choice(("less", "greater", "less_equal"))}, 1.0)


register(Family("compare", _compare, _draw_compare, "integer"))


def _logical(x, y, *, op):
    return getattr(jnp, op)(x, y)


def _draw_logical(c, slots):
    d = binary(lambda a, b: 1.0, kind=BOOL)(c, slots)
    if d is None:
        return None
    return Proposal(d.operands, {"op": c.choice(("logical_and", "logical_or", "logical_xor"))},
                    1.0)


register(Family("logical", _logical, _draw_logical, "integer"))


def _int_arith(x, y, *, op, c):
    return getattr(jnp, op)(x, y) % c


def _draw_int_arith(c, slots):
    d = binary(lambda a, b: 1.0, kind=INT)(c, slots)
    if d is None:
        return None
    modulus = c.integer(2, 2 * INT_HIGH)
    return Proposal(d.operands, {"op": c.choice(("add", "multiply", "subtract", "maximum")),
                                 "c": modulus}, float(modulus))


register(Family("int_arith", _int_arith, _draw_int_arith, "integer"))


def _argmax(x, *, axis):
    return jnp.argmax(x, axis=axis).astype(jnp.int32)


def _draw_argmax(c, slots):
    x = pick(c, slots, ranked(FLOAT))
    if x is None:
        return None
    axis = axis_of(c, slots[x])
    return Proposal((x,), {"axis": axis}, float(slots[x].shape[axis]))


register(Family("argmax", _argmax, _draw_argmax, "integer"))


def _to_float(x, *, dtype):
    return x.astype(dtype)


def _draw_to_float(c, slots):
    x = pick(c, slots, lambda s: s.kind in (INT, BOOL))
    if x is None:
        return None
    return Proposal((x,), {"dtype": c.dtype}, slots[x].bound)


register(Family("to_float", _to_float, _draw_to_float, "integer"))


def _to_int(x):
    return jnp.floor(x).astype(jnp.int32)


register(Family("to_int", _to_int, unary(lambda b: b + 1.0), "integer"))
