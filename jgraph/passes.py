"""Pure graph -> graph clean-up passes: dead-code elimination (and CSE, respecting `no_cse`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jgraph.ir import Eqn, Graph, Var
from jgraph.ops import has_effects


def dce(graph: Graph) -> Graph:
    """Drop eqns none of whose outputs reaches a graph output, except those with side effects
    (`jax.debug.print`, or a loop printing). Inputs are kept (the signature)."""
    live = {a for a in graph.outputs if isinstance(a, Var)}
    kept = []
    for eqn in reversed(graph.eqns):
        if any(v in live for v in eqn.outputs) or has_effects(eqn):
            kept.append(eqn)
            live.update(a for a in eqn.inputs if isinstance(a, Var))
    if len(kept) == len(graph.eqns):
        return graph
    return graph.replace(eqns=tuple(reversed(kept)))


def without_unused_ys(eqn: Eqn, live: set) -> Eqn:
    """A scan without the stacked outputs nobody reads (`live`: the vars read after it), its
    body no longer computing them, as XLA's while-loop simplifier drops a loop's dead outputs."""
    p = eqn.params
    nk, body = p["num_carry"], p["body"]
    keep = [j for j, v in enumerate(eqn.outputs[nk:]) if v in live]
    if len(keep) == len(eqn.outputs) - nk:
        return eqn
    outs = body.outputs[:nk] + tuple(body.outputs[nk + j] for j in keep)
    body = dce(body.replace(outputs=outs, output_roles=("aux",) * len(outs)))
    ys = tuple(eqn.outputs[nk + j] for j in keep)
    return dataclasses.replace(eqn, outputs=eqn.outputs[:nk] + ys, params={**p, "body": body})


def cse(graph: Graph) -> Graph:
    """Merge eqns computing the same op on the same atoms with the same params into the first.

    Eqns tagged `no_cse` (recomputation that remat placed on purpose) and eqns with side effects
    are never merged, nor used to replace another. Eqns in different checkpoint regions are not
    merged either: which values a region saves is remat's decision. Inputs are kept (the
    signature).
    """
    renamed: dict[Var, Var] = {}
    seen: dict[tuple, tuple[Var, ...]] = {}
    kept = []

    def read(a):
        return renamed.get(a, a) if isinstance(a, Var) else a

    for eqn in graph.eqns:
        inputs = tuple(read(a) for a in eqn.inputs)
        if inputs != eqn.inputs:
            eqn = dataclasses.replace(eqn, inputs=inputs)
        key = None if "no_cse" in eqn.tags or has_effects(eqn) else _cse_key(eqn)
        if key is not None and key in seen:
            renamed.update(zip(eqn.outputs, seen[key], strict=True))
            continue
        if key is not None:
            seen[key] = eqn.outputs
        kept.append(eqn)
    if len(kept) == len(graph.eqns) and not renamed:
        return graph
    return graph.replace(eqns=tuple(kept), outputs=tuple(read(a) for a in graph.outputs))


def _atom_key(a):
    if isinstance(a, Var):
        return a
    value = np.asarray(a.value)
    return ("literal", value.dtype.str, value.shape, value.tobytes(), a.aval.weak_type)


def _cse_key(eqn):
    """A hashable key of what `eqn` computes, or None when it cannot be merged safely."""
    try:
        params = tuple(sorted(eqn.params.items()))
        key = (eqn.op, tuple(_atom_key(a) for a in eqn.inputs), params, eqn.regions,
               tuple(v.aval for v in eqn.outputs))
        hash(key)
    except TypeError:  # unhashable params (arrays): leave the eqn alone
        return None
    return key
