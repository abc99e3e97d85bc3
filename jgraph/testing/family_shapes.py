"""Op families of shapes and indexing, on values of any kind: reshape, transpose, broadcast,
squeeze, flip, slice, pad, concatenate, gathers (`take`), dynamic slices and updates, selects."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jgraph.testing.families import (
    MAX_RANK,
    Family,
    Proposal,
    axis_of,
    broadcast,
    broadcasts,
    pick,
    ranked,
    register,
)
from jgraph.testing.recipe import BOOL, FLOAT, INT


# -- shape and layout (any kind) ---------------------------------------------------------------
def _reshape(x, *, shape):
    return jnp.reshape(x, shape)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _draw_reshape(c, slots):
    x = pick(c, slots, lambda s: True)
    rest, shape = slots[x].size, []
    for _ in range(c.integer(0, 2)):
        d = c.choice(_divisors(rest))
        shape.append(d)
        rest //= d
    shape.append(rest)
    if rest == 1 and c.boolean():
        shape = shape[:-1]
    return Proposal((x,), {"shape": tuple(shape)}, slots[x].bound)


register(Family("reshape", _reshape, _draw_reshape, "shape"))


def _transpose(x, *, perm):
    return jnp.transpose(x, perm)


def _draw_transpose(c, slots):
    x = pick(c, slots, ranked(min_rank=2))
    if x is None:
        return None
    return Proposal((x,), {"perm": c.permutation(len(slots[x].shape))}, slots[x].bound)


register(Family("transpose", _transpose, _draw_transpose, "shape"))


def _broadcast_to(x, *, shape):
    return jnp.broadcast_to(x, shape)


def _draw_broadcast(c, slots):
    x = pick(c, slots, lambda s: len(s.shape) < MAX_RANK)
    s = slots[x]
    k = c.integer(2, 3)
    if 1 in s.shape and c.boolean():
        shape = tuple(k if d == 1 else d for d in s.shape)
    else:
        shape = (k,) + s.shape
    return Proposal((x,), {"shape": shape}, s.bound)


register(Family("broadcast_to", _broadcast_to, _draw_broadcast, "shape"))


def _squeeze(x, *, axis):
    return jnp.squeeze(x, axis)


def _draw_squeeze(c, slots):
    x = pick(c, slots, lambda s: 1 in s.shape)
    if x is None:
        return None
    s = slots[x]
    return Proposal((x,), {"axis": c.choice([a for a, d in enumerate(s.shape) if d == 1])},
                    s.bound)


register(Family("squeeze", _squeeze, _draw_squeeze, "shape"))


def _flip(x, *, axis):
    return jnp.flip(x, axis)


def _draw_flip(c, slots):
    x = pick(c, slots, ranked())
    return None if x is None else Proposal((x,), {"axis": axis_of(c, slots[x])}, slots[x].bound)


register(Family("flip", _flip, _draw_flip, "shape"))


def _slice(x, *, start, limit, stride, axis):
    return lax.slice_in_dim(x, start, limit, stride, axis)


def _draw_slice(c, slots):
    x = pick(c, slots, ranked())
    if x is None:
        return None
    s = slots[x]
    axis = axis_of(c, s)
    n = s.shape[axis]
    start = c.integer(0, n - 1)
    limit = c.integer(start + 1, n)
    return Proposal((x,), {"start": start, "limit": limit, "stride": c.integer(1, 2),
                           "axis": axis}, s.bound)


register(Family("slice", _slice, _draw_slice, "shape"))


def _pad(x, *, config):
    return lax.pad(x, jnp.zeros((), x.dtype), config)


def _draw_pad(c, slots):
    x = pick(c, slots, ranked(FLOAT))
    if x is None:
        return None
    config = []
    for n in slots[x].shape:
        lo, hi, interior = c.integer(-1, 1), c.integer(-1, 1), c.integer(0, 1)
        if lo + hi + n + (n - 1) * interior < 1:
            lo = hi = 0
        config.append((lo, hi, interior))
    return Proposal((x,), {"config": tuple(config)}, slots[x].bound)


register(Family("pad", _pad, _draw_pad, "shape"))


def _concatenate(x, y, *, axis):
    return jnp.concatenate([x, y], axis)


def _draw_concatenate(c, slots):
    x = pick(c, slots, ranked())
    if x is None:
        return None
    s = slots[x]
    axis = axis_of(c, s)

    def fits(t):
        return t.kind == s.kind and len(t.shape) == len(s.shape) and all(
            a == b for k, (a, b) in enumerate(zip(s.shape, t.shape, strict=True)) if k != axis)

    y = pick(c, slots, fits)
    return Proposal((x, y), {"axis": axis}, max(s.bound, slots[y].bound))


register(Family("concatenate", _concatenate, _draw_concatenate, "shape"))


# -- indexing ----------------------------------------------------------------------------------
def _take(x, i, *, axis):
    return jnp.take(x, jnp.remainder(i, x.shape[axis]), axis=axis, mode="clip")


def _draw_take(c, slots):
    x = pick(c, slots, ranked())
    i = pick(c, slots, lambda s: s.kind == INT and len(s.shape) <= 2)
    if x is None or i is None:
        return None
    return Proposal((x, i), {"axis": axis_of(c, slots[x])}, slots[x].bound)


register(Family("take", _take, _draw_take, "indexing"))


def _first(i):
    return jnp.ravel(i)[0]


def _dynamic_slice(x, i, *, size, axis):
    return lax.dynamic_slice_in_dim(x, _first(i), size, axis)


def _draw_dynamic_slice(c, slots):
    x = pick(c, slots, ranked())
    i = pick(c, slots, lambda s: s.kind == INT)
    if x is None or i is None:
        return None
    axis = axis_of(c, slots[x])
    size = c.integer(1, slots[x].shape[axis])
    return Proposal((x, i), {"size": size, "axis": axis}, slots[x].bound)


register(Family("dynamic_slice", _dynamic_slice, _draw_dynamic_slice, "indexing"))


def _dynamic_update_slice(x, u, i):
    return lax.dynamic_update_slice(x, u, (_first(i),) * x.ndim)


def _draw_dynamic_update_slice(c, slots):
    x = pick(c, slots, ranked())
    i = pick(c, slots, lambda s: s.kind == INT)
    if x is None or i is None:
        return None
    s = slots[x]
    u = pick(c, slots, lambda t: t.kind == s.kind and len(t.shape) == len(s.shape)
             and all(a <= b for a, b in zip(t.shape, s.shape, strict=True)))
    return Proposal((x, u, i), {}, max(s.bound, slots[u].bound))


register(Family("dynamic_update_slice", _dynamic_update_slice, _draw_dynamic_update_slice,
                "indexing"))


def _select(p, x, y):
    return jnp.where(p, x, y)


def _draw_select(c, slots):
    x = pick(c, slots, lambda s: s.kind != BOOL)
    if x is None:
        return None
    s = slots[x]
    y = pick(c, slots, lambda t: t.kind == s.kind and broadcasts(t.shape, s.shape))
    shape = broadcast(s.shape, slots[y].shape)
    p = pick(c, slots, lambda t: t.kind == BOOL and broadcasts(t.shape, shape))
    if p is None:
        return None
    return Proposal((p, x, y), {}, max(s.bound, slots[y].bound))


register(Family("select", _select, _draw_select, "indexing"))
