"""`lax.platform_dependent` (behind `jnp.diagonal`, `jnp.trace`, ...): resolved while tracing.

JAX stages platform-specific code as a `cond` on `platform_index`, with one branch per group of
platforms (`branches_platforms`, `None` for the default branch), and picks the branch when it
lowers for a known platform. jgraph traces and compiles for the default backend, so the tracer
picks the branch then: it inlines the branch for `jax.default_backend()` (its operands are the
cond's inputs after the index), and the graph holds ordinary, differentiable ops. (A branch for
`mosaic`, Pallas' TPU kernels, is never the platform of a jitted computation.)
A `cond` without `branches_platforms` is left to the handler registered before this one (or
carried whole as an opaque op, as the builder does by default).
"""

from __future__ import annotations

import jax
from jax._src import xla_bridge

from jgraph import builder, ops
from jgraph.errors import TraceError


def compile_platform() -> str:
    """The lowering name of the default backend ("cpu", "cuda", "rocm", "tpu", ...)."""
    backend = jax.default_backend()
    try:
        return xla_bridge.canonicalize_platform(backend)
    except Exception:  # pragma: no cover - private API drift: the alias is the best guess
        return backend


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


_opaque_or_previous = builder._HANDLERS.get("cond")


def _cond(b: builder.Builder, eqn, inputs):
    platforms = eqn.params.get("branches_platforms")
    if platforms is None:
        if _opaque_or_previous is not None:
            return _opaque_or_previous(b, eqn, inputs)
        ops.defprim(eqn.primitive)
        return b.emit(eqn.primitive.name, inputs, eqn.params, [v.aval for v in eqn.outvars])
    branch = eqn.params["branches"][branch_for(platforms, compile_platform())]
    return b.inline(branch.jaxpr, branch.consts, inputs[1:])


builder._HANDLERS["cond"] = _cond
