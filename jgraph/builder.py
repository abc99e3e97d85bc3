"""Building eqns: binding ops, inlining jaxprs, and emitting JAX functions as IR.

A `Builder` appends eqns to a list. The tracer uses it to turn a jaxpr into eqns; the backward pass
uses the same builder to emit the eqns of VJP rules, which are written as ordinary JAX functions and
traced once per (rule, params, input avals) by `jax.make_jaxpr`, then inlined. So a rule reads like
JAX code, and what it emits is IR that later transforms can see and rewrite.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax._src import source_info_util
from jax.extend import core as jex_core

from jgraph import ops
from jgraph.errors import TraceError
from jgraph.ir import Eqn, Literal, Region, Var

_JAXPR_TYPES = (jex_core.Jaxpr, jex_core.ClosedJaxpr)


def source_line(jaxpr_eqn) -> str:
    try:
        return source_info_util.summarize(jaxpr_eqn.source_info)
    except Exception:  # pragma: no cover - private API drift: provenance is best effort
        return ""


def _has_subjaxpr(params) -> bool:
    for key, value in params.items():
        if key == "update_jaxpr":  # a scatter's combiner, lowered by the primitive itself
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, _JAXPR_TYPES) for v in values):
            return True
    return False


# Higher-order primitives carried whole as opaque ops (only valid off the gradient path).
OPAQUE_HIGHER_ORDER = frozenset({"while", "cond"})


class Builder:
    """Appends eqns. `tags`, `regions` and `source` are stamped on every eqn it creates."""

    def __init__(self, tags=frozenset(), regions=(), source=""):
        self.eqns: list[Eqn] = []
        self.tags = frozenset(tags)
        self.regions = tuple(regions)
        self.source = source
        self.new_regions: list[Region] = []  # regions met while inlining (checkpoint in a jaxpr)
        self.next_region_id = 0

    # -- binding ------------------------------------------------------------------------------
    def bind(self, op: str, *inputs, **params) -> list[Var]:
        """Append `outs = op[params] inputs` and return the new output variables."""
        try:
            rule = ops.shape_rules[op]
        except KeyError:
            raise TraceError(f"no shape rule for op {op!r} ({self.source})") from None
        out_avals = rule(*(a.aval for a in inputs), **params)
        outs = tuple(Var(aval) for aval in out_avals)
        self.eqns.append(Eqn(op, tuple(inputs), params, outs, self.tags, self.regions, self.source))
        return list(outs)

    def call(self, fn: Callable, *inputs, **static) -> list:
        """Emit the eqns of JAX function `fn(*arrays, **static)` applied to `inputs` (atoms).

        `fn` returns an array or a sequence of arrays (None entries pass through as None).
        """
        avals = tuple(_aval_key(a.aval) for a in inputs)
        closed, none_mask = _trace_cached(fn, tuple(sorted(static.items())), avals)
        outs = iter(self.inline(closed.jaxpr, closed.consts, inputs))
        return [None if is_none else next(outs) for is_none in none_mask]

    # -- inlining jaxprs ----------------------------------------------------------------------
    def inline(self, jaxpr, consts, inputs) -> list:
        """Append the eqns of `jaxpr` applied to `inputs`; return the output atoms."""
        env: dict = {}

        def read(v):
            if isinstance(v, jex_core.Literal):
                return Literal(v.val, v.aval)
            return env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c if isinstance(c, (Var, Literal)) else Literal(c, jax.typeof(c))
        for v, a in zip(jaxpr.invars, inputs):
            env[v] = a
        saved_source = self.source
        try:
            for eqn in jaxpr.eqns:
                self.source = source_line(eqn) or saved_source
                outs = self.inline_eqn(eqn, [read(v) for v in eqn.invars])
                for v, o in zip(eqn.outvars, outs):
                    if not isinstance(v, jex_core.DropVar):
                        env[v] = o
        finally:
            self.source = saved_source
        return [read(v) for v in jaxpr.outvars]

    def inline_eqn(self, eqn, inputs) -> list:
        name = eqn.primitive.name
        handler = _HANDLERS.get(name)
        if handler is not None:
            return handler(self, eqn, inputs)
        if eqn.effects:
            raise TraceError(
                f"primitive {name!r} has side effects ({eqn.effects}), which jgraph does not "
                f"support, at {self.source}"
            )
        if _has_subjaxpr(eqn.params) and name not in OPAQUE_HIGHER_ORDER:
            raise TraceError(
                f"higher-order primitive {name!r} is not supported by jgraph, at {self.source}"
            )
        if not ops.has_op(name):
            ops.defprim(eqn.primitive)
        return self.bind(name, *inputs, **eqn.params)

    def enter_region(self, policy, prevent_cse, name) -> Region:
        parent = self.regions[-1] if self.regions else None
        region = Region(self.next_region_id, parent, policy, prevent_cse, name, self.source)
        self.next_region_id += 1
        self.new_regions.append(region)
        self.regions = self.regions + (region.id,)
        return region


def _aval_key(aval):
    return (tuple(aval.shape), aval.dtype, getattr(aval, "weak_type", False))


@functools.lru_cache(maxsize=8192)
def _trace_cached(fn, static_items, avals):
    static = dict(static_items)
    none_mask = []

    def flat_fn(*args):
        out = fn(*args, **static)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        none_mask[:] = [o is None for o in outs]
        return [o for o in outs if o is not None]

    specs = [jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in avals]
    closed = jax.make_jaxpr(flat_fn)(*specs)
    return closed, tuple(none_mask)


# -- handlers for the higher-order primitives the tracer rewrites ---------------------------------
_HANDLERS: dict[str, Callable] = {}


def _inline_call(b: Builder, eqn, inputs):
    closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    if isinstance(closed, jex_core.ClosedJaxpr):
        return b.inline(closed.jaxpr, closed.consts, inputs)
    return b.inline(closed, (), inputs)


for _name in ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call"):
    _HANDLERS[_name] = _inline_call


def _checkpoint_region(b: Builder, eqn, inputs):
    saved = b.regions
    b.enter_region(eqn.params.get("policy"), bool(eqn.params.get("prevent_cse", True)),
                   eqn.params.get("name", ""))
    try:
        return _inline_call(b, eqn, inputs)
    finally:
        b.regions = saved


_HANDLERS["remat2"] = _HANDLERS["checkpoint"] = _checkpoint_region


def _scan_unrolled(b: Builder, eqn, inputs):
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry, xs = inputs[:n_consts], inputs[n_consts:n_consts + n_carry], inputs[
        n_consts + n_carry:]
    body = p["jaxpr"]
    ys_per_step = []
    steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
    for i in steps:
        x_i = [b.call(_index, x, i=i)[0] for x in xs]
        outs = b.inline(body.jaxpr, body.consts, [*consts, *carry, *x_i])
        carry, ys = outs[:n_carry], outs[n_carry:]
        ys_per_step.append(ys)
    if p["reverse"]:
        ys_per_step.reverse()
    n_ys = len(eqn.outvars) - n_carry
    stacked = [b.call(_stack, *[ys[k] for ys in ys_per_step])[0] for k in range(n_ys)]
    return [*carry, *stacked]


def _index(x, *, i):
    return jax.lax.index_in_dim(x, i, axis=0, keepdims=False)


def _stack(*ys):
    return jax.numpy.stack(ys)


_HANDLERS["scan"] = _scan_unrolled
