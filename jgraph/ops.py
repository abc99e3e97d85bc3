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
from jgraph.ir import PARAM_VIEWS, Graph

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


# -- param views: how `str(graph)` prints an op's params (`jgraph.ir.PARAM_VIEWS`) -----------
def _dims(lhs, rhs) -> str:
    return f"[{','.join(map(str, lhs))}]x[{','.join(map(str, rhs))}]"


def _dot_general_params(params, eqn):
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    out = {"contract": _dims(lc, rc)}
    if lb or rb:
        out["batch"] = _dims(lb, rb)
    pet = params.get("preferred_element_type")
    rest = {k: v for k, v in params.items() if k not in ("dimension_numbers",
                                                         "preferred_element_type")}
    if pet is not None and eqn.outputs and pet != eqn.outputs[0].aval.dtype:
        out["preferred_element_type"] = pet
    return out | rest


def _layout(spec, first: str, second: str) -> str:
    chars = [""] * len(spec)
    chars[spec[0]], chars[spec[1]] = first, second
    for i, dim in enumerate(spec[2:]):
        chars[dim] = str(i)
    return "".join(chars)


def _all(values, unit) -> bool:
    return values is None or all(v == unit for v in values)


def _conv_params(params, eqn):
    out = dict(params)
    dn = out.pop("dimension_numbers")
    if dn is not None:
        lhs, rhs, res = dn
        out = {"dims": f"{_layout(lhs, 'N', 'C')},{_layout(rhs, 'O', 'I')}->"
                       f"{_layout(res, 'N', 'C')}"} | out
    for key in ("lhs_dilation", "rhs_dilation"):
        if _all(out.get(key), 1):
            out.pop(key, None)
    for key in ("feature_group_count", "batch_group_count"):
        if out.get(key) == 1:
            out.pop(key)
    return out


def _gather_params(params, eqn):
    out = dict(params)
    dn = out.pop("dimension_numbers")
    short = {"offset_dims": "offset", "collapsed_slice_dims": "collapsed",
             "start_index_map": "start_map", "operand_batching_dims": "operand_batch",
             "start_indices_batching_dims": "indices_batch",
             "update_window_dims": "window", "inserted_window_dims": "inserted",
             "scatter_dims_to_operand_dims": "to_operand",
             "scatter_indices_batching_dims": "indices_batch"}
    fields = {short.get(k, k): v for k, v in zip(dn._fields, dn, strict=True) if v != ()}
    combiner = out.pop("update_jaxpr", None)
    if combiner is not None and eqn.op == "scatter":  # what it computes (the others: their name)
        out["update_jaxpr"] = " ".join(str(combiner).split())
    if out.get("update_consts") == ():
        out.pop("update_consts")
    return fields | out


def _reduce_window_params(params, eqn):
    out = dict(params)
    if _all((p for pair in out.get("padding", ()) for p in pair), 0):
        out.pop("padding", None)
    for key in ("base_dilation", "window_dilation"):
        if _all(out.get(key), 1):
            out.pop(key, None)
    return out


def _without(*keys):
    return lambda params, eqn: {k: v for k, v in params.items() if k not in keys}


def _broadcast_params(params, eqn):
    return {"dims": params["broadcast_dimensions"]} | _without(
        "shape", "broadcast_dimensions")(params, eqn)


# How `str(graph)` prints some ops' params (what the output aval says, or a compact form).
PARAM_VIEWS.update({
    "dot_general": _dot_general_params,
    "conv_general_dilated": _conv_params,
    "gather": _gather_params,
    "broadcast_in_dim": _broadcast_params,
    "reshape": _without("new_sizes"),
})
for _op in ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter-min", "scatter-max"):
    PARAM_VIEWS[_op] = _gather_params
for _op in ("reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window"):
    PARAM_VIEWS[_op] = _reduce_window_params
