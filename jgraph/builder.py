"""Building eqns: binding ops, inlining jaxprs, and emitting JAX functions as IR.

A `Builder` appends eqns to a list. The tracer uses it to turn a jaxpr into eqns (`inline`); every
transform uses `call` to emit a JAX function as IR: VJP rules, accumulation, optimizer updates are
ordinary JAX functions, traced once per (function, static params, input avals) by `jax.make_jaxpr`
into a template (its eqns with operands given as positions, dead eqns dropped by `passes.dce`).
Emitting a template again only creates fresh variables and eqns, with no tracing and no shape
inference, so a backward pass costs microseconds per eqn. So a rule reads like JAX code, and what
it emits is IR that later transforms can see and rewrite.

Higher-order primitives are rewritten by handlers (registered with `@handler(name)`): nested
`jit` is inlined, `custom_jvp_call` and `custom_vjp_call` are inlined with an op carrying the
user's rule (`jgraph.custom_jvp`, `jgraph.custom_vjp`), `checkpoint` becomes a recorded region
around its inlined body, `scan`, `cond` and `while` become ops holding sub-graphs
(`jgraph.control_flow`).
Any other higher-order or effectful primitive is a `TraceError` naming it and the user's line.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.extend import core as jex_core
from jax.extend import source_info_util

from jgraph import _jax_internals as internals
from jgraph import ops
from jgraph.errors import TraceError
from jgraph.ir import Eqn, Graph, Literal, Region, ShapedArray, Var, literal_of
from jgraph.passes import dce

_JAXPR_TYPES = (jex_core.Jaxpr, jex_core.ClosedJaxpr)

# Higher-order primitives carried whole as ops, their sub-jaxprs left as JAX's (the solve has a
# VJP rule of its own). `scan`, `cond` and `while` become ops with sub-graphs (`control_flow`).
CARRIED_WHOLE = frozenset({"custom_linear_solve"})


def source_line(jaxpr_eqn) -> str:
    """The user's frame that produced a jaxpr eqn, as "file:line:col (function)"."""
    try:
        return source_info_util.summarize(jaxpr_eqn.source_info)
    except Exception:  # pragma: no cover - API drift: provenance is best effort
        return ""


def _has_subjaxpr(params) -> bool:
    for key, value in params.items():
        if key == "update_jaxpr" or (key == "jaxpr" and "computation" in params):  # combiners
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, _JAXPR_TYPES) for v in values):
            return True
    return False


class Builder:
    """Appends eqns. `tags`, `regions` and `source` are stamped on every eqn it creates."""

    def __init__(self, tags=frozenset(), regions=(), source=""):
        self.eqns: list[Eqn] = []
        self.tags = frozenset(tags)
        self.regions = tuple(regions)
        self.source = source
        self.new_regions: list[Region] = []  # regions met while inlining (checkpoint in a jaxpr)
        self.next_region_id = 0
        self.in_custom_fwd = False  # inlining a custom_vjp's fwd: nested custom_vjps are inlined
        # Policies of the checkpoint regions around what this builder traces (a loop body or a
        # branch inside a region), outermost first; None saves nothing.
        self.enclosing_policies: tuple = ()

    # -- binding ------------------------------------------------------------------------------
    def bind(self, op: str, *inputs, **params) -> list[Var]:
        """Append `outs = op[params] inputs` and return the new output variables."""
        try:
            rule = ops.shape_rules[op]
        except KeyError:
            raise TraceError(f"no shape rule for op {op!r} (at {self.source})") from None
        return self.emit(op, inputs, params, rule(*(a.aval for a in inputs), **params))

    def emit(self, op: str, inputs, params, out_avals) -> list[Var]:
        """Append an eqn whose output avals are already known (from a jaxpr)."""
        outs = tuple(Var(aval) for aval in out_avals)
        self.eqns.append(Eqn(op, tuple(inputs), params, outs, self.tags, self.regions, self.source))
        return list(outs)

    def call(self, fn: Callable, *inputs, **static) -> list:
        """Emit the eqns of JAX function `fn(*arrays, **static)` applied to `inputs` (atoms).

        `fn` returns an array or a sequence of arrays (None entries pass through as None). The eqns
        carry the builder's tags, regions and `source` (the user's line being differentiated or
        transformed), not the line of `fn`, which is jgraph's own code. `static` values must be
        hashable: they are part of the template's cache key.
        """
        typed = internals.shard_map_typed
        avals = tuple((tuple(a.aval.shape), a.aval.dtype, a.aval.weak_type, typed(a.aval))
                      for a in inputs)
        steps, out_refs = _template(fn, tuple(sorted(static.items())), avals, _trace_config())
        values = list(inputs)
        tags, regions, source, eqns = self.tags, self.regions, self.source, self.eqns
        for op, refs, params, out_avals in steps:
            outs = tuple([Var(aval) for aval in out_avals])
            ins = tuple([values[r] if type(r) is int else r for r in refs])
            eqns.append(Eqn(op, ins, params, outs, tags, regions, source))
            values.extend(outs)
        return [values[r] if type(r) is int else r for r in out_refs]

    # -- inlining jaxprs ----------------------------------------------------------------------
    def inline(self, jaxpr, consts, inputs) -> list:
        """Append the eqns of `jaxpr` applied to `inputs`; return the output atoms.

        Each eqn gets the source line of its jaxpr eqn (the user's)."""
        env: dict = {}

        def read(v):
            if isinstance(v, jex_core.Literal):
                return literal_of(v.val, v.aval)
            return env[v]

        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = c if isinstance(c, (Var, Literal)) else literal_of(c, v.aval)
        for v, a in zip(jaxpr.invars, inputs, strict=True):
            env[v] = a
        saved_source = self.source
        try:
            for eqn in jaxpr.eqns:
                self.source = source_line(eqn) or saved_source
                outs = self.inline_eqn(eqn, [read(v) for v in eqn.invars])
                for v, o in zip(eqn.outvars, outs, strict=True):
                    if not isinstance(v, jex_core.DropVar):
                        env[v] = o
        finally:
            self.source = saved_source
        return [read(v) for v in jaxpr.outvars]

    def inline_eqn(self, eqn, inputs) -> list:
        name = eqn.primitive.name
        rewrite = _HANDLERS.get(name)
        if rewrite is not None:
            return rewrite(self, eqn, inputs)
        if eqn.effects and not internals.harmless_effects(eqn.effects):
            effects = ", ".join(sorted(map(str, eqn.effects)))
            raise TraceError(f"primitive {name!r} has side effects ({effects}), which jgraph does "
                             f"not support, at {self.source}")
        if name not in CARRIED_WHOLE and _has_subjaxpr(eqn.params):
            raise TraceError(f"higher-order primitive {name!r} is not supported by jgraph, at "
                             f"{self.source}")
        return self.carry(eqn, inputs)

    def carry(self, eqn, inputs) -> list:
        """Emit a jaxpr eqn as the op of its primitive's name (registered if new)."""
        if eqn.primitive.name not in ops.lowerings:
            ops.defprim(eqn.primitive)
        # The jaxpr already holds the output avals: no need to run the shape rule again.
        return self.emit(eqn.primitive.name, inputs, eqn.params, [v.aval for v in eqn.outvars])

    def enter_region(self, policy, prevent_cse, name) -> Region:
        parent = self.regions[-1] if self.regions else None
        region = Region(self.next_region_id, parent, policy, prevent_cse, name, self.source)
        self.next_region_id += 1
        self.new_regions.append(region)
        self.regions = self.regions + (region.id,)
        return region

    def remat_policies(self) -> tuple:
        """The policies of the checkpoint regions the eqns being traced lie in, outermost first,
        through loop bodies and branches; empty outside any region."""
        own = {r.id: r.policy for r in self.new_regions}
        return self.enclosing_policies + tuple(own.get(r) for r in self.regions)


def _trace_config() -> tuple:
    """The JAX settings that change what tracing a function gives (its dtypes, its dots'
    precision): part of a template's cache key, so that a template traced inside
    `jax.enable_x64(True)` is not reused outside it."""
    c = jax.config
    return (c.jax_enable_x64, c.jax_default_matmul_precision, c.jax_numpy_rank_promotion,
            c.jax_numpy_dtype_promotion)


@functools.lru_cache(maxsize=16384)
def _template(fn, static_items, avals, config):
    """The eqns of `fn` traced on `avals` under JAX settings `config` (`_trace_config()`), as
    (steps, output refs); a ref is an int (a position among the inputs and the outputs of earlier
    steps), a Literal, or None."""
    static = dict(static_items)
    none_mask = []

    def flat_fn(*args):
        out = fn(*args, **static)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        none_mask[:] = [o is None for o in outs]
        return [o for o in outs if o is not None]

    # Inside shard_map, the avals themselves: they carry the mesh axes a value varies over.
    specs = [ShapedArray(s, d, weak_type=w) if typed is None else typed
             for s, d, w, typed in avals]
    closed = jax.make_jaxpr(flat_fn)(*specs)
    scratch = Builder()
    inputs = tuple(Var(aval) for aval in specs)
    outs = scratch.inline(closed.jaxpr, closed.consts, inputs)
    live = dce(Graph(inputs, tuple(scratch.eqns), tuple(outs), ("data",) * len(inputs),
                     ("aux",) * len(outs)))
    position = {v: i for i, v in enumerate(inputs)}

    def ref(a):
        return a if isinstance(a, Literal) else position[a]

    steps = []
    for eqn in live.eqns:
        steps.append((eqn.op, tuple(ref(a) for a in eqn.inputs), eqn.params,
                      tuple(v.aval for v in eqn.outputs)))
        for v in eqn.outputs:
            position[v] = len(position)
    outs = iter(outs)
    return tuple(steps), tuple(None if is_none else ref(next(outs)) for is_none in none_mask)


# -- handlers for the higher-order primitives the tracer rewrites ---------------------------------
_HANDLERS: dict[str, Callable] = {}  # primitive name -> handler(builder, jaxpr eqn, input atoms)


def handler(*names: str):
    """Register a handler for the JAX primitives `names`: it emits their eqns into the builder
    and returns the output atoms. Those primitives never appear as ops of their own name."""
    def register(fn):
        for name in names:
            _HANDLERS[name] = fn
        return fn

    return register


def rewritten_by_tracer() -> frozenset[str]:
    """Names of the primitives the tracer rewrites (not ops of their own)."""
    return frozenset(_HANDLERS)


@handler("jit", "pjit", "closed_call", "core_call", "call")
def _inline_call(b: Builder, eqn, inputs):
    jaxpr, consts = internals.call_body(eqn.params)
    return b.inline(jaxpr, consts, inputs)


@handler("remat2", "checkpoint")
def _checkpoint_region(b: Builder, eqn, inputs):
    jaxpr, consts = internals.call_body(eqn.params)
    name = getattr(jaxpr.debug_info, "func_name", "") or ""
    saved = b.regions
    b.enter_region(*internals.checkpoint_params(eqn.params), name)
    try:
        return b.inline(jaxpr, consts, inputs)
    finally:
        b.regions = saved
