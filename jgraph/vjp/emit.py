"""`emit`: Builder.call for the backward pass, replayed from a cached template.

A rule is traced and inlined once per (function, static params, input avals) into a template: the
list of its eqns with operands given as positions (an input, or an earlier eqn's output) or
literals. Emitting it again only creates fresh variables and eqns, with no tracing and no shape
inference, so a backward pass costs a few microseconds per eqn (linear in the graph's size).
Eqns of the traced function that no output depends on are dropped from the template.
Emitted eqns carry the builder's tags, regions and source (the user's line of the forward eqn).
"""

from __future__ import annotations

import functools

from jax.core import ShapedArray

from jgraph.builder import Builder
from jgraph.ir import Eqn, Literal, Var


def emit(b: Builder, fn, *inputs, **static) -> list:
    """Append the eqns of `fn(*inputs, **static)` to `b`; return its outputs (atoms or None)."""
    avals = tuple((tuple(a.aval.shape), a.aval.dtype, a.aval.weak_type) for a in inputs)
    steps, out_refs = _template(fn, tuple(sorted(static.items())), avals)
    values = list(inputs)
    tags, regions, source, eqns = b.tags, b.regions, b.source, b.eqns
    for op, refs, params, out_avals in steps:
        outs = tuple([Var(aval) for aval in out_avals])
        ins = tuple([values[r] if type(r) is int else r for r in refs])
        eqns.append(Eqn(op, ins, params, outs, tags, regions, source))
        values.extend(outs)
    return [values[r] if type(r) is int else r for r in out_refs]


@functools.lru_cache(maxsize=16384)
def _template(fn, static_items, avals):
    scratch = Builder()
    inputs = [Var(ShapedArray(s, d, weak_type=w)) for s, d, w in avals]
    outs = scratch.call(fn, *inputs, **dict(static_items))
    position = {v: i for i, v in enumerate(inputs)}

    def ref(a):
        return a if isinstance(a, Literal) else position[a]

    steps = []
    for eqn in _live(scratch.eqns, outs):
        steps.append((eqn.op, tuple(ref(a) for a in eqn.inputs), eqn.params,
                      tuple(v.aval for v in eqn.outputs)))
        for v in eqn.outputs:
            position[v] = len(position)
    return tuple(steps), tuple(None if o is None else ref(o) for o in outs)


def _live(eqns, outs):
    """The eqns some output depends on (the traced rule may compute cotangents nobody reads)."""
    live = {o for o in outs if isinstance(o, Var)}
    kept = []
    for eqn in reversed(eqns):
        if any(v in live for v in eqn.outputs):
            kept.append(eqn)
            live.update(a for a in eqn.inputs if isinstance(a, Var))
    return reversed(kept)
