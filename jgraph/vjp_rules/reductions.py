"""VJP rules of reductions: reduce_sum/max/min/prod, a general (variadic) reduce, cumulative
ops, windowed reductions, sort, top_k.

`reduce_max`/`reduce_min` split the cotangent evenly among tied maxima, as JAX does. The
cumulative max/min/prod rules differentiate the same associative scan JAX uses to define them; a
general `reduce` is differentiated, as in JAX, as a tree of pairwise applications of its reducer.
Windowed max/min scatter the cotangent to the selected element (XLA's select-and-scatter; base
dilation is supported, window dilation is not, as in JAX); a windowed sum's cotangent is a
windowed sum of the stride-dilated cotangent.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jgraph import _jax_internals as internals
from jgraph.backward import defvjp, undifferentiable_inputs
from jgraph.errors import TransformError
from jgraph.vjp_rules.contractions import transposed_window_padding


def _reduce_sum_vjp(cts, ins, outs, *, axes, **_):
    (x,) = ins
    kept = tuple(d for d in range(x.ndim) if d not in axes)
    return [lax.broadcast_in_dim(cts[0], x.shape, kept)]


defvjp("reduce_sum", _reduce_sum_vjp)


def _reduce_chooser_vjp(cts, ins, outs, *, axes, **_):
    (ct,), (x,), (y,) = cts, ins, outs
    kept = tuple(d for d in range(x.ndim) if d not in axes)
    shape = tuple(1 if d in axes else n for d, n in enumerate(x.shape))
    where = (x == lax.reshape(y, shape)).astype(ct.dtype)
    counts = lax.reduce_sum(where, axes)
    return [lax.broadcast_in_dim(ct / counts, x.shape, kept) * where]


defvjp("reduce_max", _reduce_chooser_vjp)
defvjp("reduce_min", _reduce_chooser_vjp)


def _reduce_prod_vjp(cts, ins, outs, *, axes, **_):
    """Product of all other elements, as exclusive cumulative products from both sides (exact
    at zeros, unlike y / x)."""
    (ct,), (x,) = cts, ins
    kept = tuple(d for d in range(x.ndim) if d not in axes)
    perm = kept + tuple(axes)
    xt = lax.transpose(x, perm).reshape([x.shape[d] for d in kept] + [-1])
    ones = jnp.ones_like(xt[..., :1])
    before = jnp.cumprod(jnp.concatenate([ones, xt[..., :-1]], -1), axis=-1)
    after = jnp.flip(jnp.cumprod(jnp.concatenate([ones, jnp.flip(xt, -1)[..., :-1]], -1),
                                 axis=-1), -1)
    others = (before * after).reshape([x.shape[d] for d in perm])
    ct_t = lax.broadcast_in_dim(ct, others.shape, tuple(range(len(kept)))) * others
    return [lax.transpose(ct_t, tuple(perm.index(d) for d in range(x.ndim)))]


defvjp("reduce_prod", _reduce_prod_vjp)


def _cumsum_vjp(cts, ins, outs, *, axis, reverse):
    return [lax.cumsum(cts[0], axis, reverse=not reverse)]


defvjp("cumsum", _cumsum_vjp)


def _cumulative_vjp(combine, cts, ins, outs, *, axis, reverse):
    scan = functools.partial(lax.associative_scan, combine, axis=axis, reverse=reverse)
    return list(jax.vjp(scan, ins[0])[1](cts[0]))


defvjp("cumprod", functools.partial(_cumulative_vjp, lax.mul))
defvjp("cummax", functools.partial(_cumulative_vjp, lax.max))
defvjp("cummin", functools.partial(_cumulative_vjp, lax.min))


def _reduce_window_sum_vjp(cts, ins, outs, *, window_dimensions, window_strides, padding,
                           base_dilation, window_dilation):
    """A windowed sum is a convolution with a kernel of ones: each input element collects the
    cotangent of every window it is in, a windowed sum of the cotangent dilated by the strides
    (the window is symmetric, so it needs no flip)."""
    (ct,), (x,) = cts, ins
    if ct.size == 0:
        return [jnp.zeros_like(x)]
    axes = zip(x.shape, window_dimensions, window_strides, ct.shape, padding, base_dilation,
               window_dilation, strict=True)
    config = [(*transposed_window_padding(*axis), axis[2] - 1) for axis in axes]
    ct = lax.pad(ct, np.zeros((), ct.dtype), config)
    return [lax.reduce_window(ct, np.zeros((), ct.dtype), lax.add, window_dimensions,
                              base_dilation, [(0, 0)] * x.ndim, window_dilation=window_dilation)]


defvjp("reduce_window_sum", _reduce_window_sum_vjp)


def _scatter_to_chosen(ct, x, select_prim, window_dimensions, window_strides, padding,
                      base_dilation):
    """Each window's cotangent goes to the element it chose (XLA's select-and-scatter). With base
    dilation, the holes between elements hold the identity, so no window chooses them."""
    dilated = any(d != 1 for d in base_dilation)
    if dilated:
        identity = np.array(-np.inf if select_prim is lax.ge_p else np.inf, x.dtype)
        x = lax.pad(x, identity, tuple((0, 0, d - 1) for d in base_dilation))
    ct_x = internals.select_and_scatter_add(ct, x, select_prim, window_dimensions, window_strides,
                                      padding)
    return lax.slice(ct_x, (0,) * x.ndim, ct_x.shape, base_dilation) if dilated else ct_x


def _reduce_window_chooser_vjp(op, select_prim, cts, ins, outs, *, window_dimensions,
                               window_strides, padding, base_dilation, window_dilation):
    if any(d != 1 for d in window_dilation):
        raise TransformError(f"no VJP rule for op {op!r} with window_dilation="
                             f"{tuple(window_dilation)} (JAX has none either)")
    return [_scatter_to_chosen(cts[0], ins[0], select_prim, window_dimensions, window_strides,
                               padding, base_dilation)]


defvjp("reduce_window_max",
       functools.partial(_reduce_window_chooser_vjp, "reduce_window_max", lax.ge_p))
defvjp("reduce_window_min",
       functools.partial(_reduce_window_chooser_vjp, "reduce_window_min", lax.le_p))


def _select_and_gather_add_vjp(cts, ins, outs, *, select_prim, window_dimensions,
                               window_strides, padding, base_dilation, window_dilation):
    """Linear in the gathered tangents (the windowed max/min's JVP): its transpose scatters to
    the chosen elements. The choice is piecewise constant in the operand: no cotangent."""
    if any(d != 1 for d in window_dilation):
        raise TransformError(f"no VJP rule for op 'select_and_gather_add' with window_dilation="
                             f"{tuple(window_dilation)} (JAX has none either)")
    (ct,), (_tangents, x) = cts, ins
    return [_scatter_to_chosen(ct, x, select_prim, window_dimensions, window_strides, padding,
                               base_dilation), None]


defvjp("select_and_gather_add", _select_and_gather_add_vjp)


def _sort_vjp(cts, ins, outs, *, dimension, is_stable, num_keys):
    """Route each output cotangent back to where its element came from (inverse permutation)."""
    iota = lax.broadcasted_iota(jnp.int32, ins[0].shape, dimension)
    perm = lax.sort([*ins, iota], dimension=dimension, is_stable=is_stable,
                    num_keys=num_keys)[-1]
    inverse = jnp.argsort(perm, axis=dimension)
    return [jnp.take_along_axis(ct, inverse, axis=dimension) for ct in cts]


defvjp("sort", _sort_vjp)


def _top_k_vjp(cts, ins, outs, *, axis=-1, **_):
    """Each of the k cotangents goes to the element its index names (one-hot, exact)."""
    (ct, _), (x,), (_, idx) = cts, ins, outs
    axis = axis % x.ndim
    if ct.shape[axis] == 0:
        return [jnp.zeros_like(x)]
    ct, idx = jnp.moveaxis(ct, axis, -1), jnp.moveaxis(idx, axis, -1)
    n = x.shape[axis]
    one_hot = (idx[..., None] == lax.broadcasted_iota(idx.dtype, (*idx.shape, n), idx.ndim))
    ct_x = jnp.einsum("...k,...kn->...n", ct, one_hot.astype(ct.dtype),
                      precision=lax.Precision.HIGHEST)
    return [jnp.moveaxis(ct_x, -1, axis)]


defvjp("top_k", _top_k_vjp)


def _reduce_pairwise(reducer, xs, inits, axes):
    """A general `reduce` as a tree of pairwise applications of its reducer (as JAX
    differentiates it: the reducer is taken to be associative, the init values its identity)."""
    shape = xs[0].shape
    kept = [d for d in range(len(shape)) if d not in axes]
    kept_shape = tuple(shape[d] for d in kept)
    n = math.prod(shape[d] for d in axes)
    if n == 0:
        return [jnp.full(kept_shape, i) for i in inits]
    xs = [lax.reshape(x, (n, *kept_shape), (*axes, *kept)) for x in xs]
    for _ in range(len(kept) + 1):  # the reducer acts on scalars: map it over every axis
        reducer = jax.vmap(reducer)
    while n > 1:
        half = (n + 1) // 2
        first = [lax.slice_in_dim(x, 0, half) for x in xs]
        second = [lax.slice_in_dim(x, half, n) for x in xs]
        if n % 2:  # pad the shorter half with the identity
            config = [(0, 1, 0)] + [(0, 0, 0)] * len(kept)
            second = [lax.pad(x, i, config) for x, i in zip(second, inits, strict=True)]
        xs, n = reducer(*first, *second), half
    return [lax.squeeze(x, (0,)) for x in xs]


def _reduce_vjp(cts, ins, outs, *, jaxpr, dimensions, **_):
    """The pullback of the pairwise tree, for the floating operands; init values get none."""
    n = len(ins) // 2
    xs, inits = list(ins[:n]), ins[n:]
    floats = [k for k, x in enumerate(xs) if jnp.issubdtype(x.dtype, jnp.inexact)]
    reducer = jex_core.jaxpr_as_fun(jaxpr)

    def tree(*float_xs):
        for k, x in zip(floats, float_xs, strict=True):
            xs[k] = x
        outs = _reduce_pairwise(reducer, xs, inits, tuple(dimensions))
        return [outs[k] for k in floats]

    _, pullback = jax.vjp(tree, *(xs[k] for k in floats))
    float_cts = iter(pullback([cts[k] for k in floats]))
    return [next(float_cts) if k in floats else None for k in range(n)] + [None] * n


defvjp("reduce", _reduce_vjp)
# JAX differentiates no general reduce through its init values (they must be the identity).
undifferentiable_inputs["reduce"] = lambda n_in, params: range(n_in // 2, n_in)


def _select_and_scatter_add_vjp(cts, ins, outs, *, select_prim, window_dimensions,
                                window_strides, padding):
    """Linear in the scattered source: its transpose gathers from the selected elements."""
    (ct,), (_source, x) = cts, ins
    ones = (1,) * len(window_dimensions)
    return [internals.select_and_gather_add(ct, x, select_prim, window_dimensions, window_strides,
                                      padding, ones, ones), None]


defvjp("select_and_scatter_add", _select_and_scatter_add_vjp)


# -- cumlogsumexp: differentiates the associative scan of logaddexp that defines it (as JAX) -----
defvjp("cumlogsumexp", functools.partial(_cumulative_vjp, jnp.logaddexp))
