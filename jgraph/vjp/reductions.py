"""VJP rules of reductions: reduce_sum/max/min/prod, cumulative ops, windowed reductions, sort.

`reduce_max`/`reduce_min` split the cotangent evenly among tied maxima, as JAX does. The
cumulative max/min/prod rules differentiate the same associative scan JAX uses to define them.
Windowed max/min scatter the cotangent to the selected element (XLA's select-and-scatter); a
windowed sum's cotangent is a windowed sum of the stride-dilated cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lax import windowed_reductions as wr

from jgraph.errors import TransformError
from jgraph.vjp import defvjp
from jgraph.vjp.contractions import transposed_window_padding


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


def _reduce_window_chooser_vjp(select_prim, cts, ins, outs, *, window_dimensions, window_strides,
                               padding, base_dilation, window_dilation):
    (ct,), (x,) = cts, ins
    if any(d != 1 for d in (*base_dilation, *window_dilation)):  # as in JAX
        raise TransformError("no VJP rule for a windowed max/min with dilation")
    return [wr._select_and_scatter_add(ct, x, select_prim, window_dimensions, window_strides,
                                       padding)]


defvjp("reduce_window_max", functools.partial(_reduce_window_chooser_vjp, lax.ge_p))
defvjp("reduce_window_min", functools.partial(_reduce_window_chooser_vjp, lax.le_p))


def _sort_vjp(cts, ins, outs, *, dimension, is_stable, num_keys):
    """Route each output cotangent back to where its element came from (inverse permutation)."""
    iota = lax.broadcasted_iota(jnp.int32, ins[0].shape, dimension)
    perm = lax.sort([*ins, iota], dimension=dimension, is_stable=is_stable,
                    num_keys=num_keys)[-1]
    inverse = jnp.argsort(perm, axis=dimension)
    return [jnp.take_along_axis(ct, inverse, axis=dimension) for ct in cts]


defvjp("sort", _sort_vjp)


def _top_k_vjp(cts, ins, outs, **_):
    (ct, _), (x,), (_, idx) = cts, ins, outs
    k, n = ct.shape[-1], x.shape[-1]
    one_hot = (idx[..., None] == lax.broadcasted_iota(idx.dtype, (*idx.shape, n), idx.ndim))
    return [jnp.einsum("...k,...kn->...n", ct, one_hot.astype(ct.dtype),
                       precision=lax.Precision.HIGHEST) if k else jnp.zeros_like(x)]


defvjp("top_k", _top_k_vjp)


def _select_and_scatter_add_vjp(cts, ins, outs, *, select_prim, window_dimensions,
                                window_strides, padding):
    """Linear in the scattered source: its transpose gathers from the selected elements."""
    (ct,), (_source, x) = cts, ins
    ones = (1,) * len(window_dimensions)
    return [wr._select_and_gather_add(ct, x, select_prim, window_dimensions, window_strides,
                                      padding, ones, ones), None]


defvjp("select_and_scatter_add", _select_and_scatter_add_vjp)


# -- cumlogsumexp: differentiates the associative scan of logaddexp that defines it (as JAX) -----
defvjp("cumlogsumexp", functools.partial(_cumulative_vjp, jnp.logaddexp))
