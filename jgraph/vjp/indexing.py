"""VJP rules of indexing ops: gather <-> scatter-add, dynamic_slice <-> dynamic_update_slice,
and scatter (overwrite). Index operands are integers and get no cotangent.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jgraph.vjp import defvjp


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
    """The slices of `ct` a scatter with dimension numbers `d` wrote `updates` to."""
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
                      unique_indices=params["unique_indices"], mode=params["mode"])


def _scatter_add_vjp(cts, ins, outs, *, dimension_numbers, **params):
    (ct,), (_x, indices, updates) = cts, ins
    return [ct, None, _gather_of_updates(ct, indices, updates, dimension_numbers, params)]


defvjp("scatter-add", _scatter_add_vjp)
defvjp("scatter_add", _scatter_add_vjp)


def _scatter_vjp(cts, ins, outs, *, dimension_numbers, update_jaxpr=None, update_consts=(),
                 **params):
    """Overwriting scatter, for unique indices (as `x.at[i].set(u)` with distinct `i`)."""
    (ct,), (_x, indices, updates) = cts, ins
    d = dimension_numbers
    ct_x = lax.scatter(ct, indices, jnp.zeros_like(updates), d,
                       indices_are_sorted=params["indices_are_sorted"],
                       unique_indices=params["unique_indices"], mode=params["mode"])
    return [ct_x, None, _gather_of_updates(ct, indices, updates, d, params)]


defvjp("scatter", _scatter_vjp)


def _dynamic_slice_vjp(cts, ins, outs, *, slice_sizes):
    (ct,), (x, *idx) = cts, ins
    zeros = jnp.zeros(x.shape, ct.dtype)
    return [lax.dynamic_update_slice(zeros, ct, idx)] + [None] * len(idx)


defvjp("dynamic_slice", _dynamic_slice_vjp)


def _dynamic_update_slice_vjp(cts, ins, outs, **_):
    (ct,), (_x, update, *idx) = cts, ins
    ct_x = lax.dynamic_update_slice(ct, jnp.zeros(update.shape, ct.dtype), idx)
    ct_update = lax.dynamic_slice(ct, idx, update.shape)
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
