"""The op tables: for every op, a shape/dtype rule and a lowering to `jax.lax`.

Most ops are JAX primitives, and for them both rules come from the primitive itself: the shape rule
is the primitive's abstract evaluation, the lowering binds it. That keeps jgraph's forward semantics
identical to JAX's (bitwise on CPU). Ops that are not JAX primitives (jgraph's own, such as
`custom_vjp_call`) register explicit rules with `defop`. VJP rules live in `jgraph.vjp`.

    shape_rule(*in_avals, **params) -> list of out avals
    lowering(*in_values, **params)  -> list of out values (works on arrays and on JAX tracers)
"""

from __future__ import annotations

import importlib
from typing import Callable

from jax._src.core import Primitive

from jgraph.errors import JGraphError

primitives: dict[str, Primitive] = {}  # op name -> the JAX primitive it binds
shape_rules: dict[str, Callable] = {}
lowerings: dict[str, Callable] = {}

# Higher-order primitives the tracer rewrites (inlines, unrolls or records as regions): they never
# appear as ops in a graph. `while` and `cond` are carried whole, as opaque ops.
REWRITTEN_BY_TRACER = frozenset(
    {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat2",
     "checkpoint", "scan"}
)


def defop(name: str, shape_rule: Callable, lowering: Callable) -> None:
    """Register an op that is not a JAX primitive."""
    shape_rules[name] = shape_rule
    lowerings[name] = lowering


def defprim(prim: Primitive) -> str:
    """Register a JAX primitive as an op: shape rule = abstract eval, lowering = bind."""
    name = prim.name
    if name in primitives and primitives[name] is not prim:
        raise JGraphError(f"two different JAX primitives are named {name!r}")
    primitives[name] = prim

    def shape_rule(*avals, **params):
        out, _effects = prim.abstract_eval(*avals, **params)
        return list(out) if prim.multiple_results else [out]

    def lowering(*args, **params):
        out = prim.bind(*args, **params)
        return list(out) if prim.multiple_results else [out]

    shape_rules.setdefault(name, shape_rule)
    lowerings.setdefault(name, lowering)
    return name


def has_op(name: str) -> bool:
    return name in shape_rules and name in lowerings


# The primitives of `jax.lax` (linear algebra and FFT included), of checkpoint_name and of the PRNG
# are ops from import on; any other first-order primitive is registered by the tracer when it
# meets it.
_LAX_MODULES = (
    "jax._src.lax.lax",
    "jax._src.lax.slicing",
    "jax._src.lax.windowed_reductions",
    "jax._src.lax.convolution",
    "jax._src.lax.special",
    "jax._src.lax.control_flow.loops",
    "jax._src.lax.control_flow.conditionals",
    "jax._src.lax.control_flow.solves",
    "jax._src.lax.linalg",
    "jax._src.lax.fft",
    "jax._src.ad_checkpoint",
    "jax._src.ad_util",
    "jax._src.random.prng",
    "jax._src.random.threefry2x32",
)
for _module in _LAX_MODULES:
    try:
        _namespace = vars(importlib.import_module(_module))
    except ImportError:  # private module moved: the tracer registers what it meets anyway
        continue
    for _value in _namespace.values():
        if isinstance(_value, Primitive) and _value.name not in REWRITTEN_BY_TRACER:
            defprim(_value)
