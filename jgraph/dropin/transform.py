"""`jg.value_and_grad` and `jg.grad`: JAX's transforms, computed by jgraph's backward graph.

A call splits its arguments (`jgraph.dropin.arguments`), and looks up the joint graph of their
abstract signature: on a miss, `fun` is traced once (`jg.trace`, from the avals of the arguments,
tracers included), differentiated (`jg.backward`) and rematerialized (`jg.remat`: the
`jax.checkpoint` regions of `fun`, and `policy=` / `budget=`), then cached on the transform
(`jgraph.dropin.cache`: the most recently used signatures, traced again when `fun`'s globals or
closure were rebound). The graph runs where the call is (`jgraph.dropin.runner`): inlined into an
enclosing trace, or eagerly.
A graph that closes over tracers of an enclosing trace (a loss defined inside the user's `jit`,
reading its batch) is traced again at every call: its inputs live in that trace only.

Results have `jax.value_and_grad`'s structure: `(value, grads)`, value `(loss, aux)` with
`has_aux`, grads shaped like `args[argnums]` (a tuple for a tuple of argnums). Aux leaves that are
not traced values (Python numbers, strings) come back as they are, as in JAX.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jgraph.backward import backward
from jgraph.dropin import arguments, recording
from jgraph.dropin.arguments import DATA, PARAM, STATIC, ArgumentError, UnsupportedOptionError
from jgraph.dropin.cache import TraceCache, reads
from jgraph.dropin.runner import GraphRunner
from jgraph.ir import Graph, short_aval
from jgraph.remat import remat
from jgraph.trace import trace_closure


def check_loss(loss, name: str) -> None:
    """The conditions of `jax.grad` on the differentiated output, as TypeErrors."""
    try:
        aval = jax.typeof(loss)
    except TypeError:
        raise ArgumentError(f"{name}: the function must return a scalar loss (or a pair (loss, "
                            f"aux) with has_aux=True); it returned a {type(loss).__name__} "
                            f"({loss!r:.80})") from None
    if aval.shape != ():
        raise ArgumentError(f"{name}: the loss must be a scalar (gradients are defined for "
                            f"scalar outputs only); it is {short_aval(aval)}")
    dtype = aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) or not jax.numpy.issubdtype(
            dtype, jax.numpy.floating):
        kind = "complex" if jax.numpy.issubdtype(dtype, jax.numpy.complexfloating) else "integer"
        raise ArgumentError(f"{name}: the loss must be real and floating; it is "
                            f"{short_aval(aval)} (for a {kind} output use jg.vjp)")


@dataclass
class _Outputs:
    """What one trace of `fun` returned besides its traced values: the aux's structure, and its
    leaves that were not traced (returned as they are)."""

    aux_tree: Any = None
    aux_static: list = field(default_factory=list)


@dataclass(eq=False)
class Entry:
    """The joint graph of one abstract signature, and how to read its outputs."""

    graph: Graph
    run: GraphRunner
    outputs: _Outputs
    grad_slots: list  # per differentiated argument: (treedef, [grad output index | aval | None])
    argnums_int: bool
    has_aux: bool
    filtered: bool

    def assemble(self, flat):
        n_value = 1 + self.outputs.aux_tree.num_leaves - sum(
            x is not None for x in self.outputs.aux_static)
        loss, aux_dynamic = flat[0], iter(flat[1:n_value])
        grads = flat[n_value:]
        per_arg = []
        for treedef, slots in self.grad_slots:
            per_arg.append(jax.tree.unflatten(treedef, [self._grad(grads, s) for s in slots]))
        grads = per_arg[0] if self.argnums_int else tuple(per_arg)
        if not self.has_aux:
            return loss, grads
        aux = [next(aux_dynamic) if s is None else s for s in self.outputs.aux_static]
        return (loss, jax.tree.unflatten(self.outputs.aux_tree, aux)), grads

    def _grad(self, grads, slot):
        if isinstance(slot, int):
            return grads[slot]
        if slot is None or self.filtered:  # equinox: no gradient for what is not differentiated
            return None
        return np.zeros(slot.shape, jax.dtypes.float0)  # allow_int: JAX's float0 zeros


class ValueAndGrad:
    """The transform `jg.value_and_grad(fun, ...)` returns (with `value=False`: `jg.grad`)."""

    def __init__(self, fun, argnums=0, has_aux=False, *, allow_int=False, policy=None,
                 budget=None, value=True, filtered=False, name="jg.value_and_grad", target=None):
        arguments.check_callable(fun, name)
        self.fun, self.has_aux, self.allow_int = fun, bool(has_aux), bool(allow_int)
        self.argnums = arguments.normalize_argnums(argnums, name)
        self.policy, self.budget, self.value, self.filtered = policy, budget, value, filtered
        self.target = target
        self.name = name
        self._cache = TraceCache()  # Signature -> Entry
        functools.update_wrapper(self, fun, updated=())

    def __get__(self, instance, owner=None):  # decorating a method, as a function would
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, *args, **kwargs):
        call = self._split(args, kwargs)
        recorder = recording.current()
        if recorder is not None:  # the step of a `jg.jit`: its graph computes this call
            entry, flat = recorder.grad_call(self, call, lambda: self._entry(call))
        else:
            entry = self._entry(call)
            flat = entry.run(call.dynamic)
        (value, grads) = entry.assemble(flat)
        if self.value:
            return value, grads
        return (grads, value[1]) if self.has_aux else grads

    def graph(self, *args, **kwargs) -> Graph:
        """The joint graph a call with these arguments runs (traced now if it is not cached).

        Its inputs are the array leaves of the call, in the order of `jax.tree.leaves((args,
        kwargs))` (keyword arguments as one more positional dict; static leaves are None
        there); then, if `fun` closes over traced values, a tuple of them."""
        return self._entry(self._split(args, kwargs)).graph

    # -- signature, cache, trace ---------------------------------------------------------------
    def _split(self, args, kwargs) -> arguments.Call:
        if self.filtered and not args:
            raise ArgumentError(f"{self.name}: the function needs its first argument (the one "
                                "differentiated) passed by position")

        def kind_of(x, path, differentiated):
            if not differentiated:
                return arguments.other_leaf_kind(x)
            if self.filtered:
                return arguments.filtered_leaf_kind(x)
            return arguments.differentiated_leaf_kind(x, path, self.name, self.allow_int)

        return arguments.split_call(args, kwargs, self.argnums, self.name, kind_of)

    def _entry(self, call: arguments.Call) -> Entry:
        signature = call.signature
        if not signature.hashable():
            return self._trace(call)
        now_reads = reads(self.fun)
        entry = self._cache.get(signature, now_reads)
        if entry is None:
            entry = self._trace(call)
            if not entry.run.closed_over:
                self._cache.put(signature, now_reads, entry)
        return entry

    def _trace(self, call: arguments.Call, planned: bool = True) -> Entry:
        """The call's entry; `planned=False`: its joint graph without remat (`jg.jit` plans the
        whole step it is part of)."""
        signature, outputs, name, has_aux = call.signature, _Outputs(), self.name, self.has_aux
        fun = self.fun

        def traced(*dynamic_args):
            args, kwargs = arguments.refill(signature, jax.tree.leaves(dynamic_args))
            out = fun(*args, **kwargs)
            if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise ArgumentError(f"{name}: has_aux=True needs the function to return a pair "
                                    f"(loss, aux); it returned a {type(out).__name__}")
            loss, aux = out if has_aux else (out, None)
            check_loss(loss, name)
            outputs.aux_tree, outputs.aux_static, aux_traced = arguments.split_traced(aux)
            if not has_aux:
                return loss
            # The graph returns the aux as fun does, unless some of it is not traced.
            return loss, (aux if all(x is None for x in outputs.aux_static) else aux_traced)

        nums = call.argnums
        param_argnums = nums[0] if isinstance(self.argnums, int) else nums
        with recording.suspended():  # a gradient inside `fun` is not the step's own
            graph, closed_over = trace_closure(traced, *arguments.with_holes(call),
                                               param_argnums=param_argnums, has_aux=has_aux)
        kinds = [d[0] for d in signature.leaves if d[0] != STATIC]
        differentiated = [k for k, pos in zip(kinds, _argument_of(call), strict=True)
                          if pos in nums]
        if DATA in differentiated:
            # Integer leaves of a differentiated argument (allow_int, equinox filters) are data:
            # the grads are then the params' in input order, placed by `grad_slots`.
            graph = graph.replace(input_roles=tuple(kinds) + ("data",) * len(closed_over),
                                  param_argnums=None)
        if PARAM not in differentiated:  # nothing to differentiate (an empty tree, integers)
            joint = graph
        else:
            joint = backward(graph)
            if planned and (self.policy is not None or self.budget is not None or joint.regions):
                joint = remat(joint, self.policy, budget=self.budget, target=self.target)
        return Entry(joint, GraphRunner(joint, closed_over), outputs,
                     _grad_slots(call, joint), isinstance(self.argnums, int), has_aux,
                     self.filtered)


def _argument_of(call: arguments.Call) -> list:
    """For each dynamic leaf of the call, its positional argument (None for keyword ones)."""
    positions = []
    args_tree = call.signature.treedef.children()[0]
    for i, sub in enumerate(args_tree.children()):
        positions += [i] * sub.num_leaves
    positions += [None] * (len(call.signature.leaves) - len(positions))
    return [p for p, d in zip(positions, call.signature.leaves, strict=True) if d[0] != STATIC]


def _grad_slots(call: arguments.Call, joint: Graph) -> list:
    """Per differentiated argument: its tree and, per leaf, the index of its gradient among the
    graph's grad outputs (a param), its aval (data: float0 zeros) or None (static)."""
    grad_index = {id(v): k for k, v in enumerate(joint.grad_params())} \
        if "grad" in joint.output_roles else {}
    args_tree = call.signature.treedef.children()[0]
    starts = np.cumsum([0] + [t.num_leaves for t in args_tree.children()])
    dynamic_index = np.cumsum([0] + [d[0] != STATIC for d in call.signature.leaves])
    slots = []
    for i in call.argnums:
        per_leaf = []
        for k in range(starts[i], starts[i + 1]):
            d = call.signature.leaves[k]
            if d[0] == PARAM:
                per_leaf.append(grad_index[id(joint.inputs[dynamic_index[k]])])
            else:
                per_leaf.append(d[1] if d[0] == DATA else None)
        slots.append((args_tree.children()[i], per_leaf))
    return slots


def _check_options(name, holomorphic, reduce_axes):
    if holomorphic:  # a TypeError, as JAX's refusals of holomorphic=True are
        raise ArgumentError(f"{name}: holomorphic=True is not supported (jgraph differentiates "
                            "real-valued losses); use jax.grad(..., holomorphic=True)")
    if reduce_axes:
        raise UnsupportedOptionError(f"{name}: reduce_axes is not supported (JAX deprecated it "
                                     "too)")


def value_and_grad(fun, argnums=0, has_aux=False, holomorphic=False, allow_int=False,
                   reduce_axes=(), *, policy=None, budget=None, target=None) -> ValueAndGrad:
    """`jax.value_and_grad`, computed by jgraph's backward graph (see the module docstring).

    Same arguments, results and errors as JAX's; usable wherever JAX's is (eager, inside the
    user's `jax.jit`, `vmap`, `lax.scan`, `shard_map`, under `jax.grad`). `jax.checkpoint` regions
    in `fun` are rematerialized in any case.

    Args:
        fun: the function to differentiate.
        argnums: an int or a tuple of ints: the arguments differentiated.
        has_aux: `fun` returns `(value, aux)`.
        holomorphic: not supported (an error, as named).
        allow_int: as JAX's: integer inputs get float0 gradients.
        reduce_axes: not supported (JAX deprecated it): only `()`.
        policy: a `jg.policies` / `jax.checkpoint_policies` policy, passed to `jg.remat`.
        budget: bytes, or a percentage, passed to `jg.remat`.
        target: the chip the budget is planned for (`jgraph.target`), passed to `jg.remat`.

    Returns:
        A `ValueAndGrad` callable: `(value, grads)`, or `((value, aux), grads)`;
        `.graph(*args)` is the joint graph a call with these arguments runs."""
    _check_options("jg.value_and_grad", holomorphic, reduce_axes)
    return ValueAndGrad(fun, argnums, has_aux, allow_int=allow_int, policy=policy,
                        budget=budget, target=target)


def grad(fun, argnums=0, has_aux=False, holomorphic=False, allow_int=False, reduce_axes=(), *,
         policy=None, budget=None, target=None) -> ValueAndGrad:
    """`jax.grad`, computed by jgraph's backward graph.

    Args:
        fun: the function to differentiate.
        argnums: an int or a tuple of ints: the arguments differentiated.
        has_aux: `fun` returns `(value, aux)`.
        holomorphic: not supported.
        allow_int: as JAX's.
        reduce_axes: as JAX's.
        policy: passed to `jg.remat`, as `value_and_grad`'s.
        budget: passed to `jg.remat`, as `value_and_grad`'s.
        target: passed to `jg.remat`, as `value_and_grad`'s.

    Returns:
        A callable returning `grads`, or `(grads, aux)` with `has_aux`."""
    _check_options("jg.grad", holomorphic, reduce_axes)
    return ValueAndGrad(fun, argnums, has_aux, allow_int=allow_int, policy=policy,
                        budget=budget, value=False, name="jg.grad", target=target)
