"""VJP rules of ops that move data without arithmetic: broadcast, reshape, transpose, slice, pad,
concatenate, split, stack, tile, rev, squeeze. Each is linear; its rule is its transpose.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jgraph.backward import deflinear, defvjp
from jgraph.ops import lowerings


def _broadcast_in_dim_vjp(cts, ins, outs, *, shape, broadcast_dimensions, **_):
    x, ct = ins[0], cts[0]
    unit = tuple(i for i, n in enumerate(x.shape) if n == 1)
    kept = tuple(d for i, d in enumerate(broadcast_dimensions) if i not in unit)
    summed = tuple(d for d in range(len(shape)) if d not in kept)
    ct = lax.reduce_sum_p.bind(ct, axes=summed, out_sharding=None) if summed else ct
    ct = lax.expand_dims(ct, unit) if unit else ct
    return [ct] + [None] * (len(ins) - 1)


defvjp("broadcast_in_dim", _broadcast_in_dim_vjp)


def _reshape_vjp(ct, x, *, dimensions=None, **_):
    """`dimensions` transposes x before the reshape: undo the reshape, then the transpose."""
    if dimensions is None:
        return lax.reshape(ct, x.shape)
    ct = lax.reshape(ct, tuple(x.shape[d] for d in dimensions))
    return lax.transpose(ct, tuple(int(i) for i in np.argsort(dimensions)))


deflinear("reshape", _reshape_vjp)
deflinear("squeeze", lambda ct, x, **p: lax.reshape(ct, x.shape))
deflinear("transpose", lambda ct, x, *, permutation: lax.transpose(
    ct, tuple(int(i) for i in np.argsort(permutation))))
deflinear("rev", lambda ct, x, *, dimensions: lax.rev(ct, dimensions))


def _slice_vjp(ct, x, *, start_indices, limit_indices, strides):
    strides = strides or (1,) * x.ndim
    config = []
    for n, lo, k, s in zip(x.shape, start_indices, ct.shape, strides, strict=True):
        used = lo + (k - 1) * s + 1 if k else lo
        config.append((lo, n - used, s - 1) if k else (lo, n - lo, 0))
    return lax.pad(ct, lax.full((), 0, ct.dtype), config)


deflinear("slice", _slice_vjp)


def _pad_vjp(cts, ins, outs, *, padding_config):
    (ct,), (_x, _pad_value) = cts, ins
    if not padding_config:  # a rank-0 operand: nothing was padded
        return [ct, jnp.zeros((), ct.dtype)]
    lo, hi, interior = zip(*padding_config, strict=True)
    unpadded = lax.pad(ct, lax.full((), 0, ct.dtype),
                       [(-a, -b, 0) for a, b in zip(lo, hi, strict=True)])
    ct_x = lax.slice(unpadded, (0,) * ct.ndim, unpadded.shape, tuple(i + 1 for i in interior))
    axes = tuple(range(ct.ndim))
    ct_pad = lax.reduce_sum(ct, axes) - lax.reduce_sum(ct_x, axes)
    return [ct_x, ct_pad]


defvjp("pad", _pad_vjp)


def _concatenate_vjp(cts, ins, outs, *, dimension):
    ct, parts, start = cts[0], [], 0
    for x in ins:
        parts.append(lax.slice_in_dim(ct, start, start + x.shape[dimension], axis=dimension))
        start += x.shape[dimension]
    return parts


defvjp("concatenate", _concatenate_vjp)


def _stack_vjp(cts, ins, outs, *, axis):
    return [lax.index_in_dim(cts[0], i, axis, keepdims=False) for i in range(len(ins))]


defvjp("stack", _stack_vjp)


def _tile_vjp(ct, x, *, reps):
    """Each element of x is read once per tile: sum the tiles, split out as leading axes."""
    ct = lax.reshape(ct, tuple(n for pair in zip(reps, x.shape, strict=True) for n in pair))
    return lax.reduce_sum(ct, tuple(range(0, 2 * x.ndim, 2)))


deflinear("tile", _tile_vjp)


def _split_vjp(cts, ins, outs, *, axis, **_):
    return [lax.concatenate(list(cts), axis)]


defvjp("split", _split_vjp)


# -- unstack: the cotangents of the slices, stacked back along the axis --------------------------
def _unstack_vjp(cts, ins, outs, *, axis):
    return [lax.concatenate([lax.expand_dims(ct, (axis,)) for ct in cts], axis)]


defvjp("unstack", _unstack_vjp)


# -- sharding_constraint: a layout annotation, linear; the cotangent gets the same constraint ----
def _sharding_constraint_vjp(ct, x, **params):
    # the op binds jax's own primitive with the traced params
    return lowerings["sharding_constraint"](ct, **params)[0]


deflinear("sharding_constraint", _sharding_constraint_vjp)
