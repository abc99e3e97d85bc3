"""`lax.platform_dependent` (behind `jnp.diagonal`, `jnp.trace`, ...): resolved while tracing.

JAX stages platform-specific code as a `cond` on `platform_index`, with one branch per group of
platforms (`branches_platforms`, `None` for the default branch), and picks the branch when it
lowers for a known platform. jgraph traces and compiles for the default backend, so the tracer
picks the branch then: it inlines the branch for `jax.default_backend()` (its operands are the
cond's inputs after the index), and the graph holds ordinary, differentiable ops. (A branch for
`mosaic`, Pallas' TPU kernels, is never the platform of a jitted computation.)
A `cond` without `branches_platforms` is carried whole, as an opaque op.
"""

from __future__ import annotations

from jgraph import _jax_internals as internals
from jgraph.builder import Builder, handler
from jgraph.errors import TraceError


def branch_for(branches_platforms, platform: str) -> int:
    default = None
    for k, group in enumerate(branches_platforms):
        if group is None:
            default = k
        elif platform in group:
            return k
    if default is None:
        raise TraceError(f"platform-dependent code has no branch for platform {platform!r} "
                         f"(branches: {branches_platforms})")
    return default


@handler("cond")
def _cond(b: Builder, eqn, inputs):
    platforms = eqn.params.get("branches_platforms")
    if platforms is None:
        return b.carry(eqn, inputs)
    branch = eqn.params["branches"][branch_for(platforms, internals.compile_platform())]
    return b.inline(branch.jaxpr, branch.consts, inputs[1:])
