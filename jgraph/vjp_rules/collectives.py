"""VJP rules of the collectives of `shard_map`'s typed mode: `pvary` and `psum_invariant`.

Inside `shard_map` (with its default `check_vma=True`), JAX types which mesh axes a value varies
over: `pvary` casts an invariant value to a varying one where they meet (a replicated param times
a sharded batch), and `lax.psum` of a varying value is `psum_invariant`. Each is the other's
transpose, as in JAX: a `pvary`'s cotangent is summed over its axes, a `psum`'s is cast back.
The rules are traced on avals that carry those axes (`jgraph.builder`), so they type as JAX's.
"""

from __future__ import annotations

from jax import lax

from jgraph.backward import defvjp


def _pvary_vjp(cts, ins, outs, *, axes):
    return [lax.psum(cts[0], axes)]


def _psum_invariant_vjp(cts, ins, outs, *, axes):
    return [lax.pcast(cts[0], axes, to="varying")]


defvjp("pvary", _pvary_vjp)
defvjp("psum_invariant", _psum_invariant_vjp)
