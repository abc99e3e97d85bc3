"""The leaves the Optimizer carries: dtypes (extended ones included), checks, copies, PRNG keys.

Typed PRNG keys (`jax.random.key`, what `flax.nnx.Rngs` holds) have an extended dtype that NumPy
cannot interpret, so every question about a leaf's dtype goes through `dtype_of`/`is_key` here.
Keys among the params are not trainable: `split_keys` puts them aside (None in their place, which
optax and the grads tree skip), the step takes them as data, and `merge_keys` puts them back, so
they come out of every step unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jgraph.training.arguments import ArgumentError


def dtype_of(a):
    """The dtype of an array-like leaf; JAX's extended dtypes (typed PRNG keys) are kept."""
    dtype = getattr(a, "dtype", None)
    return dtype if dtype is not None else np.asarray(a).dtype


def is_key_dtype(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_key(a) -> bool:
    return a is not None and is_key_dtype(dtype_of(a))


def check_leaves(tree, what: str) -> None:
    """Every leaf of `tree` is an array of booleans, numbers or typed PRNG keys."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        try:
            dtype = dtype_of(leaf)
        except (TypeError, ValueError):
            dtype = None
        if dtype is None or not (is_key_dtype(dtype) or jnp.issubdtype(dtype, jnp.number)
                                 or jnp.issubdtype(dtype, jnp.bool_)):
            raise ArgumentError(f"{what}{jax.tree_util.keystr(path)} must be an array of "
                                f"numbers (or PRNG keys), got {type(leaf).__name__} of dtype "
                                f"{dtype}")


def signature(tree) -> tuple:
    """Shapes and dtypes of the leaves: what a static build is specialised to."""
    return tuple((np.shape(a), dtype_of(a)) for a in jax.tree.leaves(tree))


def _copy_leaf(a):
    if isinstance(a, jax.Array) and is_key(a):  # a typed key: copy its key data
        data = jax.device_put(np.array(jax.random.key_data(a)))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(a))
    return jax.device_put(np.array(a))  # through the host: no compiled copy per shape


def fresh_copy(tree):
    """Fresh device buffers (donating them never deletes the caller's arrays)."""
    return jax.tree.map(_copy_leaf, tree)


def deleted(tree) -> bool:
    """Some leaf is a JAX array whose buffer was donated and deleted."""
    return any(isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(tree))


def has_keys(tree) -> bool:
    return any(is_key(a) for a in jax.tree.leaves(tree))


def split_keys(tree):
    """`(trainable, keys)`: two trees shaped like `tree`, None where the other has a leaf."""
    return (jax.tree.map(lambda a: None if is_key(a) else a, tree),
            jax.tree.map(lambda a: a if is_key(a) else None, tree))


def merge_keys(trainable, keys):
    """The inverse of `split_keys`."""
    return jax.tree.map(lambda t, k: t if k is None else k, trainable, keys,
                        is_leaf=lambda x: x is None)
