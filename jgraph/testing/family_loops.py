"""Op families of structured control flow (group "loop"): `lax.scan` (forward or reversed, its
body optionally under `jax.checkpoint`), `lax.fori_loop` with static bounds, `lax.cond` and
`lax.switch` on a data-dependent predicate, and `lax.while_loop` with a data-dependent trip count
(on integers, and on floats behind `stop_gradient`: a while loop has no reverse mode, so a drawn
one stays off the gradient path). Bodies close over a drawn value (`w`) where they can, so that
loop-invariant operands are exercised too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jgraph.testing.families import (
    LIMIT,
    Family,
    Proposal,
    broadcast,
    is_float,
    pick,
    register,
)
from jgraph.testing.recipe import FLOAT, INT


def _closing_over(c, slots, shape):
    """Optionally, a float slot broadcasting to exactly `shape` (a value the body closes over)."""
    if not c.boolean():
        return ()
    w = pick(c, slots, lambda s: is_float(s) and broadcast(s.shape, shape) == tuple(shape))
    return () if w is None else (w,)


# -- scan ------------------------------------------------------------------------------------------
def _scan(xs, *w, reverse, remat):
    def layer(carry, x):
        h = jnp.tanh(carry * w[0] + x if w else carry + x)
        return h, h * x

    body = jax.checkpoint(layer) if remat else layer
    return lax.scan(body, xs[0] * 0.5, xs, reverse=reverse)


def _draw_scan(c, slots):
    xs = pick(c, slots, lambda s: is_float(s) and len(s.shape) >= 1)
    if xs is None:
        return None
    w = _closing_over(c, slots, slots[xs].shape[1:])
    static = {"reverse": c.boolean(), "remat": c.boolean()}
    return Proposal((xs, *w), static, max(1.0, slots[xs].bound))


register(Family("scan", _scan, _draw_scan, "loop"))


# -- fori_loop -------------------------------------------------------------------------------------
def _fori(x, *w, n):
    def body(i, carry):
        return jnp.sin(carry * w[0] if w else carry) + 0.5 * carry

    return lax.fori_loop(0, n, body, x)


def _draw_fori(c, slots):
    x = pick(c, slots, is_float)
    if x is None:
        return None
    w = _closing_over(c, slots, slots[x].shape)
    n = c.integer(1, 3)
    bound = slots[x].bound
    for _ in range(n):
        bound = 1.0 + 0.5 * bound
    return Proposal((x, *w), {"n": n}, bound)


register(Family("fori_loop", _fori, _draw_fori, "loop"))


# -- cond and switch -------------------------------------------------------------------------------
def _cond(x, y, *, branches):
    shape = jnp.broadcast_shapes(x.shape, y.shape)
    x, y = jnp.broadcast_to(x, shape), jnp.broadcast_to(y, shape)
    cases = (lambda x, y: jnp.tanh(x) * y,
             lambda x, y: jnp.sin(y) - x,
             lambda x, y: x * y * 0.5)[:branches]
    if branches == 2:
        return lax.cond(jnp.sum(x) > 0, *cases, x, y)
    index = jnp.clip(jnp.sum(x > 0), 0, branches - 1)
    return lax.switch(index, cases, x, y)


def _draw_cond(c, slots):
    x = pick(c, slots, is_float)
    if x is None:
        return None
    y = pick(c, slots, lambda s: is_float(s) and broadcast(s.shape, slots[x].shape) is not None)
    bx, by = slots[x].bound, slots[y].bound
    branches = c.choice((2, 3))
    bound = max(by, 1.0 + bx, 0.5 * bx * by if branches == 3 else 0.0)
    return None if bound > LIMIT else Proposal((x, y), {"branches": branches}, bound)


register(Family("cond", _cond, _draw_cond, "loop"))


# -- while_loop (a data-dependent trip count, off the gradient path) -------------------------------
def _while_int(i):
    def more(state):
        k, v = state
        return (k < 4) & (jnp.sum(v) < 20)

    def step(state):
        k, v = state
        return k + 1, (v * 3 + 1) % 7

    return lax.while_loop(more, step, (jnp.int32(0), i))[1]


def _draw_while_int(c, slots):
    i = pick(c, slots, lambda s: s.kind == INT)
    return None if i is None else Proposal((i,), {}, 7.0)


register(Family("while_int", _while_int, _draw_while_int, "loop"))


def _while_float(x):
    def more(state):
        k, v = state
        return (k < 3) & (jnp.sum(v) > -1.0)

    def step(state):
        k, v = state
        return k + 1, jnp.cos(v) - 0.5

    return lax.while_loop(more, step, (jnp.int32(0), lax.stop_gradient(x)))[1]


def _draw_while_float(c, slots):
    x = pick(c, slots, lambda s: s.kind == FLOAT)
    return None if x is None else Proposal((x,), {}, max(1.5, slots[x].bound))


register(Family("while_float", _while_float, _draw_while_float, "loop"))
