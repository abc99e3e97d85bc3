"""VJP rules of indexing ops: gather <-> scatter-add, dynamic_slice <-> dynamic_update_slice,
scatter (overwrite), scatter-sub and scatter-max/min. Index operands are integers and get no
cotangent.

Out-of-bounds indices follow the op's `mode`: every gather a rule emits uses the scatter's mode and
fills with 0, so a dropped update (mode "fill") gets a zero cotangent, never NaN. A dynamic slice's
starts reach the primitive already normalised, and it clamps them: the rules bind the primitives
on those starts as they are (the `lax` wrappers would normalise negative starts a second time).
With duplicate indices, an overwriting scatter keeps one update per element; as in JAX, the rule
finds which one by scattering update ids and reading them back, and only that update gets the
cotangent.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jgraph.backward import defvjp
from jgraph.errors import TransformError


def _gather_vjp(cts, ins, outs, *, dimension_numbers, slice_sizes, indices_are_sorted,
                unique_indices, mode, fill_value=None, **_):
    (ct,), (x, indices) = cts, ins
    d = dimension_numbers
    scatter_dnums = lax.ScatterDimensionNumbers(
        update_window_dims=d.offset_dims,
        inserted_window_dims=d.collapsed_slice_dims,
        scatter_dims_to_operand_dims=d.start_index_map,
        operand_batching_dims=d.operand_batching_dims,
        scatter_indices_batching_dims=d.start_indices_batching_dims,
    )
    zeros = jnp.zeros(x.shape, ct.dtype)
    return [lax.scatter_add(zeros, indices, ct, scatter_dnums,
                            indices_are_sorted=indices_are_sorted,
                            unique_indices=unique_indices, mode=mode), None]


defvjp("gather", _gather_vjp)


def _gather_of_updates(ct, indices, updates, d, params):
    """The slices of `ct` a scatter with dimension numbers `d` wrote `updates` to (0 where the
    scatter dropped an out-of-bounds update)."""
    gather_dnums = lax.GatherDimensionNumbers(
        offset_dims=d.update_window_dims,
        collapsed_slice_dims=d.inserted_window_dims,
        start_index_map=d.scatter_dims_to_operand_dims,
        operand_batching_dims=d.operand_batching_dims,
        start_indices_batching_dims=d.scatter_indices_batching_dims,
    )
    slice_sizes, pos = [], 0
    for i in range(ct.ndim):
        if i in d.inserted_window_dims or i in d.operand_batching_dims:
            slice_sizes.append(1)
        else:
            slice_sizes.append(updates.shape[d.update_window_dims[pos]])
            pos += 1
    return lax.gather(ct, indices, gather_dnums, tuple(slice_sizes),
                      indices_are_sorted=params["indices_are_sorted"],
                      unique_indices=params["unique_indices"], mode=params["mode"],
                      fill_value=0)


def _scatter_add_vjp(cts, ins, outs, *, dimension_numbers, **params):
    (ct,), (_x, indices, updates) = cts, ins
    return [ct, None, _gather_of_updates(ct, indices, updates, dimension_numbers, params)]


defvjp("scatter-add", _scatter_add_vjp)
defvjp("scatter_add", _scatter_add_vjp)


def _scatter_sub_vjp(cts, ins, outs, *, dimension_numbers, **params):
    (ct,), (_x, indices, updates) = cts, ins
    return [ct, None, -_gather_of_updates(ct, indices, updates, dimension_numbers, params)]


defvjp("scatter-sub", _scatter_sub_vjp)


def _is_overwrite(update_jaxpr) -> bool:
    """A scatter with no combiner, or one that returns the update: `x.at[i].set(u)`."""
    if update_jaxpr is None:
        return True
    jaxpr = getattr(update_jaxpr, "jaxpr", update_jaxpr)
    return (not jaxpr.eqns and len(jaxpr.invars) == 2 and len(jaxpr.outvars) == 1
            and jaxpr.outvars[0] is jaxpr.invars[1])


def _update_ids(updates, d):
    """1, 2, ... per scattered window (0 marks an element no update wrote), updates-shaped."""
    ids_shape = [1 if i in d.update_window_dims else n for i, n in enumerate(updates.shape)]
    ids = lax.reshape(lax.iota(jnp.int32, math.prod(ids_shape)) + 1, tuple(ids_shape))
    return jnp.broadcast_to(ids, updates.shape)


def _scatter_vjp(cts, ins, outs, *, dimension_numbers, update_jaxpr=None, update_consts=(),
                 **params):
    (ct,), (x, indices, updates) = cts, ins
    d = dimension_numbers
    if not _is_overwrite(update_jaxpr):
        raise TransformError(
            "no VJP rule for op 'scatter' with a combining update_jaxpr (as `x.at[i].apply(f)` "
            "binds; JAX has no derivative for it either): write the update as "
            "`x.at[i].set(f(x[i]))`")
    flags = dict(indices_are_sorted=params["indices_are_sorted"], mode=params["mode"])
    if params["unique_indices"]:  # every update lands
        ct_x = lax.scatter(ct, indices, jnp.zeros(updates.shape, ct.dtype), d,
                           unique_indices=True, **flags)
        return [ct_x, None, _gather_of_updates(ct, indices, updates, d, params)]
    ids = _update_ids(updates, d)
    landed = lax.scatter(jnp.zeros(x.shape, ids.dtype), indices, ids, d, unique_indices=False,
                         **flags)
    ct_x = jnp.where(landed == 0, ct, jnp.zeros_like(ct))
    won = _gather_of_updates(landed, indices, updates, d, params) == ids
    ct_updates = _gather_of_updates(ct, indices, updates, d, params)
    return [ct_x, None, jnp.where(won, ct_updates, jnp.zeros_like(ct_updates))]


defvjp("scatter", _scatter_vjp)


def _scatter_extremal_vjp(cts, ins, outs, *, dimension_numbers, **params):
    """JAX's scatter-max/min JVP, transposed: an element's cotangent is split evenly among the
    updates that equal the result there, and the operand if it does too."""
    (ct,), (x, indices, updates), (y,) = cts, ins, outs
    d = dimension_numbers
    flags = dict(indices_are_sorted=params["indices_are_sorted"],
                 unique_indices=params["unique_indices"], mode=params["mode"])

    def gather(v):
        return _gather_of_updates(v, indices, updates, d, params)

    def count(mask):  # per update: how many updates of its element have `mask`
        hits = jnp.where(mask, jnp.ones_like(updates), jnp.zeros_like(updates))
        return gather(lax.scatter_add(jnp.zeros_like(x), indices, hits, d, **flags))

    target = gather(y)
    won, kept = updates == target, gather(x) == target
    n_won, n_refs = count(won), count(jnp.ones(updates.shape, jnp.bool_))
    share = jnp.where(kept, 1 / (n_won + 1), 1 / n_won)
    update_coef = jnp.where(won, share, jnp.zeros_like(share))
    operand_share = jnp.where(kept, 1 / (n_won + 1), jnp.zeros_like(n_won))
    operand_coef = jnp.where(n_refs > 0, (operand_share - 1) / n_refs, jnp.zeros_like(n_refs))
    ct_target = gather(ct)
    ct_x = ct + lax.scatter_add(jnp.zeros_like(ct), indices, ct_target * operand_coef, d, **flags)
    return [ct_x, None, ct_target * update_coef]


defvjp("scatter-max", _scatter_extremal_vjp)
defvjp("scatter-min", _scatter_extremal_vjp)


def _dynamic_slice_vjp(cts, ins, outs, *, slice_sizes):
    (ct,), (x, *idx) = cts, ins
    zeros = jnp.zeros(x.shape, ct.dtype)
    return [lax.dynamic_update_slice_p.bind(zeros, ct, *idx)] + [None] * len(idx)


defvjp("dynamic_slice", _dynamic_slice_vjp)


def _dynamic_update_slice_vjp(cts, ins, outs, **_):
    (ct,), (_x, update, *idx) = cts, ins
    ct_x = lax.dynamic_update_slice_p.bind(ct, jnp.zeros(update.shape, ct.dtype), *idx)
    ct_update = lax.dynamic_slice_p.bind(ct, *idx, slice_sizes=tuple(update.shape))
    return [ct_x, ct_update] + [None] * len(idx)


defvjp("dynamic_update_slice", _dynamic_update_slice_vjp)


# -- scatter-mul: y[i] = x[i] * (product of the updates scattered to i) --------------------------
def _scatter_mul_vjp(cts, ins, outs, *, dimension_numbers, update_jaxpr=None, update_consts=(),
                     **params):
    """ct_x multiplies ct by the same products. An update's cotangent is ct * x at its target
    times the product of the *other* updates to that target (duplicate indices included): the
    product of the target's nonzero updates divided by this one, or, when this one is the
    target's only zero, that product itself (exact at zeros)."""
    (ct,), (x, indices, updates) = cts, ins
    d = dimension_numbers

    def scatter(prim, operand, values):
        return prim(operand, indices, values, d, indices_are_sorted=params["indices_are_sorted"],
                    unique_indices=params["unique_indices"], mode=params["mode"])

    def at_updates(t):  # the value at each update's target
        return _gather_of_updates(t, indices, updates, d, params)

    ct_x = scatter(lax.scatter_mul, ct, updates)
    is_zero = updates == 0
    nonzero = jnp.where(is_zero, jnp.ones_like(updates), updates)
    product = at_updates(scatter(lax.scatter_mul, jnp.ones_like(x), nonzero))
    zeros = at_updates(scatter(lax.scatter_add, jnp.zeros(x.shape, ct.real.dtype),
                               is_zero.astype(ct.real.dtype)))
    none = jnp.zeros_like(product)
    others = jnp.where(is_zero, jnp.where(zeros == 1, product, none),
                       jnp.where(zeros == 0, product / nonzero, none))
    return [ct_x, None, at_updates(ct * x) * others]


defvjp("scatter-mul", _scatter_mul_vjp)
defvjp("scatter_mul", _scatter_mul_vjp)
