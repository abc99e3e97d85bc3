"""Checkpoint region markers for user code: `checkpoint` and `checkpoint_name`.

`checkpoint` is `jax.checkpoint`, so the tracer records a region (with its policy and prevent_cse)
exactly as it does for `jax.checkpoint` in user code, and the function keeps JAX's meaning when it
runs outside jgraph. `checkpoint_name` is JAX's named identity, which name policies match.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["checkpoint", "checkpoint_name"]


def checkpoint(fn=None, *, policy=None, prevent_cse=True, static_argnums=()):
    """Mark `fn` as a checkpoint region; usable as `checkpoint(fn)` or `@checkpoint(policy=...)`.

    `jax.checkpoint` traces to the same region: either marks what `jg.remat(gb)` recomputes.

    Args:
        fn: the function whose intermediate values the backward recomputes instead of keeping.
        policy: what the region saves nonetheless (`jg.policies`, `jax.checkpoint_policies`);
            None saves nothing but the region's inputs.
        prevent_cse: as `jax.checkpoint`'s.
        static_argnums: as `jax.checkpoint`'s.

    Returns:
        `fn`, wrapped (or a decorator, when `fn` is not given)."""
    if fn is None:
        return lambda f: checkpoint(f, policy=policy, prevent_cse=prevent_cse,
                                    static_argnums=static_argnums)
    return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse,
                          static_argnums=static_argnums)
