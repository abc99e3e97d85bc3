"""The op tables: for every op, a shape/dtype rule and a lowering to `jax.lax`.

Most ops are JAX primitives, and for them both rules come from the primitive itself: the shape rule
is the primitive's abstract evaluation, the lowering binds it. That keeps jgraph's forward semantics
identical to JAX's (bitwise on CPU). Ops that are not JAX primitives (jgraph's own, such as
`custom_vjp_call`) register explicit rules with `defop`. VJP rules live in `jgraph.vjp_rules`.

    shape_rule(*in_avals, **params) -> list of out avals
    lowering(*in_values, **params)  -> list of out values (works on arrays and on JAX tracers)
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

from jgraph.errors import JGraphError
from jgraph.ir import Graph

Primitive = jex_core.Primitive
primitives: dict[str, Primitive] = {}  # op name -> the JAX primitive it binds
shape_rules: dict[str, Callable] = {}
lowerings: dict[str, Callable] = {}
# The custom-derivative ops jgraph's backward has expanded lower differently (`custom_lowering`).
expanded_lowerings: dict[str, Callable] = {}


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


# Ops with side effects (`jgraph.effects`): no pass removes, merges, copies or reorders them.
# Ops whose outputs carry no gradient to their inputs.
CUTS_GRADIENT = frozenset({"stop_gradient"})
# Ops with no differentiable floating output (comparisons, integer ops, RNG bits, piecewise
# constant functions, ...): their gradient is zero.
NON_DIFFERENTIABLE = frozenset(
    {"eq", "ne", "lt", "le", "gt", "ge", "eq_to", "le_to", "lt_to", "and", "or", "not", "xor",
     "iota", "argmax", "argmin", "is_finite", "sign", "floor", "ceil", "round", "stop_gradient",
     "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "clz",
     "mulhi", "random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in",
     "random_split", "threefry2x32", "rng_bit_generator", "rng_uniform", "nextafter",
     "reduce_and", "reduce_or", "reduce_xor", "bitcast_convert_type", "zeros_like",
     "create_token", "after_all", "platform_index", "empty", "empty2",
     "lu_pivots_to_permutation", "debug_print"}
)


EFFECTFUL = frozenset({"debug_print"})


def has_effects(eqn) -> bool:
    """Whether `eqn` has side effects: an effectful op, or a loop or cond whose body has one."""
    if eqn.op in EFFECTFUL:
        return True
    for value in eqn.params.values():
        for graph in value if isinstance(value, tuple) else (value,):
            if isinstance(graph, Graph) and any(has_effects(e) for e in graph.eqns):
                return True
    return False

# Public primitives that are not ops: JAX's internal linearization (`custom_lin`) and mutable-ref
# state (`get`, `swap`: effects, which the tracer refuses).
NOT_OPS = frozenset({"custom_lin", "get", "swap"})


def register_jax_primitives(rewritten: frozenset[str]) -> None:
    """Make every public JAX primitive (`jax.extend.core.primitives`) an op, except those the
    tracer rewrites, `NOT_OPS` and jgraph's own ops of the same name. Any other first-order
    primitive is registered by the tracer when it meets it."""
    found = [v for v in vars(jex_core.primitives).values() if isinstance(v, Primitive)]
    for value in found + _unlisted_primitives():
        if value.name not in rewritten | NOT_OPS and value.name not in shape_rules:
            defprim(value)


def _unlisted_primitives() -> list[Primitive]:
    """Primitives that `jax.extend.core.primitives` does not list, taken from the jaxprs of the
    public functions that bind them."""
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    perm = jax.ShapeDtypeStruct((4,), jnp.int32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    public = [
        (lambda x: jnp.stack([x, x]), x), (lambda x: jnp.tile(x, 2), x),
        (lambda x: jnp.split(x, 2), x), (lambda x: jnp.unstack(x.reshape(2, 2)), x),
        (lambda x: lax.optimization_barrier(x), x), (lambda x: x.at[0].subtract(1.0), x),
        (lambda p: lax.linalg.lu_pivots_to_permutation(p, 4), perm),
        (lambda k: jax.random.key_data(jax.random.wrap_key_data(k)), key),
    ]
    prims = []
    for fn, arg in public:
        try:
            prims += [e.primitive for e in jax.make_jaxpr(fn)(arg).jaxpr.eqns]
        except Exception:  # pragma: no cover - the tracer registers what it meets anyway
            continue
    return prims
