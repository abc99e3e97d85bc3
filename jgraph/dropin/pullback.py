"""`jg.vjp`: JAX's `vjp`, computed by jgraph's backward graph.

`fun` is traced on the primals (every floating leaf differentiated, as `jax.vjp` does), its VJP
graph is built (`jgraph.backward.vjp_graph`: cotangent inputs for the floating outputs) and split
where JAX splits it: a forward graph (primals -> outputs and the residuals the backward reads) run
now, and a backward graph (residuals, cotangents -> input cotangents) run by the returned function.
That function is a pytree whose leaves are the residuals, as JAX's is, so it can be returned from
or passed into a `jax.jit`. Graphs are cached per (function, abstract signature) while the function
lives (`jgraph.dropin.cache`: bounded, and traced again when what the function reads from its
globals or closure was rebound); both run where they are called (`jgraph.dropin.runner`).
`jax.checkpoint` regions in `fun` are rematerialized: their inner values are recomputed by the
returned function, not kept.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jgraph.backward import vjp_graph
from jgraph.dropin import arguments
from jgraph.dropin.arguments import (
    DATA,
    PARAM,
    ArgumentError,
    ArgumentValueError,
    UnsupportedOptionError,
)
from jgraph.dropin.cache import TraceCache, reads
from jgraph.dropin.runner import GraphRunner
from jgraph.ir import Graph, Var, is_float, short_aval
from jgraph.passes import dce
from jgraph.remat import remat
from jgraph.trace import trace_closure

NAME = "jg.vjp"


def _leaf_kind(x, path, _differentiated):
    """Every leaf of the primals is an input: floating ones get cotangents, others float0."""
    try:
        aval = jax.typeof(x)
    except TypeError:
        raise ArgumentError(f"{NAME}: primal {path().replace('args', 'primals', 1)} is a "
                            f"{type(x).__name__} ({x!r:.60}), not an array") from None
    return (PARAM if is_float(aval) else DATA), aval


@dataclass(eq=False)
class _Pullback:
    """One signature's forward and backward graphs, and the trees to read them with."""

    forward: GraphRunner  # primals (+ closed-over) -> outputs, aux (traced leaves), residuals
    backward: GraphRunner  # residuals, cotangents of the floating outputs -> input cotangents
    out_tree: Any  # of fun's output
    out_avals: list  # per output leaf
    aux_tree: Any
    aux_static: list  # per aux leaf: its value if it was not traced, else None
    primal_tree: Any  # of the primals tuple
    primal_kinds: list  # per primal leaf: PARAM (a cotangent output) or DATA (float0 zeros)
    primal_avals: list


def split_forward_backward(joint: Graph, n_inputs: int, n_outputs: int):
    """(forward graph, backward graph) of `vjp_graph`'s joint graph: the backward eqns (tagged
    `backward`, and the recompute of checkpoint regions) read forward values only through the
    residuals, outputs of the forward graph."""
    later = {"backward", "recompute"}
    backward_eqns = [e for e in joint.eqns if later & e.tags]
    forward_eqns = [e for e in joint.eqns if not later & e.tags]
    cts, grads = joint.inputs[n_inputs:], joint.outputs[n_outputs:]
    local = set(cts) | {v for e in backward_eqns for v in e.outputs}
    residuals: dict[Var, None] = {}
    for atom in [a for e in backward_eqns for a in e.inputs] + list(grads):
        if isinstance(atom, Var) and atom not in local:
            residuals[atom] = None
    residuals = list(residuals)
    forward = dce(Graph(joint.inputs[:n_inputs], tuple(forward_eqns),
                        joint.outputs[:n_outputs] + tuple(residuals),
                        joint.input_roles[:n_inputs], ("aux",) * (n_outputs + len(residuals)),
                        regions=joint.regions))
    backward = Graph(tuple(residuals) + tuple(cts), tuple(backward_eqns), tuple(grads),
                     ("data",) * (len(residuals) + len(cts)), ("aux",) * len(grads))
    return forward, backward


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fun -> TraceCache


def _cached(fun, signature, now_reads):
    try:
        return _cache[fun].get(signature, now_reads) if fun in _cache else None
    except TypeError:  # a function that cannot be weakly referenced, or an unhashable static
        return None


def _store(fun, signature, now_reads, pullback) -> None:
    try:
        if fun not in _cache:
            _cache[fun] = TraceCache()
        _cache[fun].put(signature, now_reads, pullback)
    except TypeError:
        pass


def _trace(fun, call: arguments.Call, has_aux: bool) -> _Pullback:
    signature, box = call.signature, {}

    def traced(*primals):
        out = fun(*primals)
        if has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise ArgumentError(f"{NAME}: has_aux=True needs the function to return a pair "
                                    f"(out, aux); it returned a {type(out).__name__}")
            out, aux = out
        else:
            aux = None
        leaves, box["out_tree"] = jax.tree.flatten(out)
        for k, x in enumerate(leaves):
            try:
                jax.typeof(x)
            except TypeError:
                raise ArgumentError(f"{NAME}: output leaf {k} of the function is a "
                                    f"{type(x).__name__} ({x!r:.60}), not an array") from None
        box["aux_tree"], box["aux_static"], aux_traced = arguments.split_traced(aux)
        return leaves, aux_traced

    graph, closed_over = trace_closure(traced, *arguments.with_holes(call))
    kinds = [d[0] for d in signature.leaves]
    graph = graph.replace(input_roles=tuple(kinds) + ("data",) * len(closed_over))
    n_out = box["out_tree"].num_leaves
    with_ct = [k < n_out and is_float(a.aval) for k, a in enumerate(graph.outputs)]
    wrt = [r == PARAM for r in graph.input_roles]
    joint = vjp_graph(graph, wrt, with_ct)
    if joint.regions:  # jax.checkpoint in fun: its residuals are recomputed by vjp_fn
        joint = remat(joint)
    forward, backward = split_forward_backward(joint, len(graph.inputs), len(graph.outputs))
    return _Pullback(GraphRunner(forward, closed_over), GraphRunner(backward),
                     box["out_tree"], [a.aval for a in graph.outputs[:n_out]], box["aux_tree"],
                     box["aux_static"], signature.treedef.children()[0], kinds,
                     [d[1] for d in signature.leaves])


def vjp(fun, *primals, has_aux=False, reduce_axes=()):
    """`jax.vjp`, computed by jgraph's backward graph.

    Args:
        fun: the function.
        *primals: its arguments.
        has_aux: `fun` returns `(out, aux)`.
        reduce_axes: as JAX's.

    Returns:
        `(out, vjp_fn)`, or `(out, vjp_fn, aux)` with `has_aux`; `vjp_fn(ct)` returns one
        cotangent per primal (a tuple), float0 zeros for integer leaves, as JAX's. `vjp_fn` is a
        pytree of residuals, as JAX's."""
    arguments.check_callable(fun, NAME)
    if reduce_axes:
        raise UnsupportedOptionError(f"{NAME}: reduce_axes is not supported (JAX deprecated it "
                                     "too)")
    call = arguments.split_call(primals, {}, None, NAME, _leaf_kind)
    now_reads = reads(fun)
    pullback = _cached(fun, call.signature, now_reads)
    if pullback is None:
        pullback = _trace(fun, call, has_aux)
        if not pullback.forward.closed_over:
            _store(fun, call.signature, now_reads, pullback)
    flat = pullback.forward(call.dynamic)
    n_out = pullback.out_tree.num_leaves
    n_aux = sum(x is None for x in pullback.aux_static)
    out = jax.tree.unflatten(pullback.out_tree, flat[:n_out])
    vjp_fn = VJPFunction(pullback, tuple(flat[n_out + n_aux:]))
    if not has_aux:
        return out, vjp_fn
    aux_dynamic = iter(flat[n_out:n_out + n_aux])
    aux = [next(aux_dynamic) if x is None else x for x in pullback.aux_static]
    return out, vjp_fn, jax.tree.unflatten(pullback.aux_tree, aux)


@jax.tree_util.register_pytree_node_class
class VJPFunction:
    """The function `jg.vjp` returns: output cotangents -> one cotangent per primal. A pytree of
    its residuals (as JAX's), so it crosses `jax.jit` boundaries."""

    def __init__(self, pullback: _Pullback, residuals: tuple):
        self.pullback, self.residuals = pullback, residuals

    def tree_flatten(self):
        return self.residuals, self.pullback

    @classmethod
    def tree_unflatten(cls, pullback, residuals):
        return cls(pullback, tuple(residuals))

    def __call__(self, ct, *extra):
        p = self.pullback
        if extra:
            raise ArgumentError(f"{NAME}: the VJP function takes one argument, the cotangent of "
                                f"the whole output (a {p.out_tree}), got {1 + len(extra)}")
        leaves, tree = jax.tree.flatten(ct)
        if tree != p.out_tree:
            raise ArgumentValueError(f"{NAME}: the cotangent must have the structure of the "
                                     f"function's output, {p.out_tree}; got {tree}")
        floating = []
        for k, (x, aval) in enumerate(zip(leaves, p.out_avals, strict=True)):
            got = jax.typeof(x)
            if got.shape != aval.shape or (is_float(aval) and got.dtype != aval.dtype):
                want = short_aval(aval) if is_float(aval) else f"float0{list(aval.shape)}"
                raise ArgumentValueError(f"{NAME}: cotangent leaf {k} is {short_aval(got)}, but "
                                         f"the output there is {short_aval(aval)}: expected "
                                         f"{want}")
            if is_float(aval):
                floating.append(x)
        cts = iter(p.backward([*self.residuals, *floating]))
        per_leaf = [next(cts) if kind == PARAM else np.zeros(aval.shape, jax.dtypes.float0)
                    for kind, aval in zip(p.primal_kinds, p.primal_avals, strict=True)]
        return tuple(jax.tree.unflatten(p.primal_tree, per_leaf))
