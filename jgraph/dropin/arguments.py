"""Arguments of the drop-in transforms: JAX's checks, and which leaves are traced or static.

`jax.value_and_grad(fun, argnums)(*args, **kwargs)` differentiates the leaves of `args[argnums]`
and closes over everything else as it is. jgraph traces one graph per abstract signature, so each
leaf of the call is one of:
- `param`: a floating leaf of a differentiated argument (an array, a tracer or a Python float);
- `data`: any other array (numpy, JAX, tracer): an input of the graph, never baked into it; also an
  integer array of a differentiated argument under `allow_int` (its gradient is float0 zeros, as
  JAX's) or under equinox's filter semantics (its gradient is None);
- `static`: anything else (Python scalars, strings, functions, None-like objects of an argument that
  is not differentiated): a concrete value inside `fun`, as under JAX, and part of the cache key.

The checks raise where `jax.grad` raises, with the same exception type (`ArgumentError` is a
TypeError, `ArgumentValueError` a ValueError, `UnsupportedOptionError` a NotImplementedError, all
jgraph errors) and a message naming the argument.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jgraph.builder import _trace_config
from jgraph.dropin.cache import static_key
from jgraph.errors import TransformError
from jgraph.ir import short_aval

PARAM, DATA, STATIC = "param", "data", "static"


class ArgumentError(TransformError, TypeError):
    """A call that `jax.grad` refuses with a TypeError (integer input, non-scalar loss, ...)."""


class ArgumentValueError(TransformError, ValueError):
    """A call that JAX refuses with a ValueError (an argnum out of range, a cotangent's shape)."""


class UnsupportedOptionError(TransformError, NotImplementedError):
    """An option JAX deprecated and refuses with a NotImplementedError (`reduce_axes`)."""


def check_callable(fun, name: str) -> None:
    if isinstance(fun, staticmethod) or not callable(fun):
        raise ArgumentError(f"{name}: expected a callable to differentiate, got {fun!r:.80}")


def normalize_argnums(argnums, name: str) -> int | tuple[int, ...]:
    """An int or a tuple of ints, read as JAX reads them (`operator.index`)."""
    try:
        return operator.index(argnums)
    except TypeError:
        pass
    try:
        return tuple(operator.index(n) for n in argnums)
    except TypeError:
        raise ArgumentError(f"{name}: argnums must be an int or a sequence of ints, got "
                            f"{argnums!r}") from None


def resolve_argnums(argnums, nargs: int, name: str) -> tuple[int, ...]:
    """Non-negative positions of the differentiated arguments for a call with `nargs`."""
    nums = (argnums,) if isinstance(argnums, int) else argnums
    if not nums:  # JAX: a ValueError (max() of nothing)
        raise ArgumentValueError(f"{name}: argnums=() differentiates nothing; give at least one "
                                 "argument position")
    if nums and max(nums) >= nargs:
        raise ArgumentError(f"{name}: argnums={argnums} needs at least {max(nums) + 1} positional "
                            f"arguments, but the call passed {nargs}")
    for n in nums:
        if n < -nargs:
            raise ArgumentValueError(f"{name}: argnums={argnums} has {n}, out of range for "
                                     f"{nargs} positional arguments")
    resolved = tuple(n % nargs for n in nums)
    if len(set(resolved)) < len(resolved):
        # JAX passes None for the repeated argument, and `fun` fails on it (often a TypeError
        # from inside fun); the repeat is the mistake, so it is named here.
        raise ArgumentValueError(f"{name}: argnums={argnums} names an argument twice (positions "
                                 f"{resolved} for {nargs} positional arguments)")
    return resolved


def is_array(x) -> bool:
    """An array the graph takes as an input (JAX array, tracer, numpy array or scalar)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _is_inexact(aval) -> bool:
    return jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)


def _describe(x) -> str:
    return f"a {type(x).__name__} ({x!r:.60})"


def differentiated_leaf_kind(x, path, name: str, allow_int: bool):
    """(`param` or `data`, aval) for a leaf of a differentiated argument, or JAX's TypeError."""
    try:
        aval = jax.typeof(x)
    except TypeError:
        raise ArgumentError(
            f"{name}: argument {path()} is {_describe(x)}, not an array: gradients are taken "
            "with respect to arrays and Python floats (as jax.grad requires). Pass it in an "
            "argument that is not differentiated, or use jg.filter_value_and_grad (equinox's "
            "semantics: only floating arrays are differentiated)") from None
    if _is_inexact(aval):
        return PARAM, aval
    if allow_int and (jax.numpy.issubdtype(aval.dtype, jax.numpy.integer)
                      or jax.numpy.issubdtype(aval.dtype, jax.numpy.bool_)
                      or jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)):
        return DATA, aval
    raise ArgumentError(
        f"{name}: argument {path()} is {short_aval(aval)}; gradients need floating (real or "
        "complex) inputs, as jax.grad requires. Pass integer, boolean or key values in an "
        "argument that is not differentiated, use jg.vjp, or set allow_int=True (their "
        "gradient is then float0 zeros)")


def filtered_leaf_kind(x):
    """Equinox's `filter_*` semantics: floating arrays are params, other arrays data, the rest
    static (Python floats included, as `eqx.is_inexact_array` says)."""
    if not is_array(x):
        return STATIC, None
    aval = jax.typeof(x)
    return (PARAM if _is_inexact(aval) else DATA), aval


def other_leaf_kind(x):
    return (DATA, jax.typeof(x)) if is_array(x) else (STATIC, None)


class StaticValue:
    """A static leaf in a signature: equal to another of the same type and value, Python floats
    compared bitwise (a trace made with 0.0 is not reused for -0.0, and a NaN finds its trace:
    `==` and `hash` say otherwise). Unhashable if the value is."""

    __slots__ = ("value", "key")

    def __init__(self, value):
        self.value, self.key = value, static_key(value)

    def __eq__(self, other):
        return isinstance(other, StaticValue) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        return f"StaticValue({self.value!r:.60})"


@dataclass(frozen=True)
class Signature:
    """What a trace depends on: tree structure, each leaf's kind and aval (or static value), and
    JAX's trace settings. Hashable when every static value is."""

    treedef: Any  # of (args, kwargs)
    leaves: tuple  # per leaf: (kind, aval) for param/data, (STATIC, type, StaticValue) for static
    config: tuple  # x64, matmul precision, promotion rules (`jgraph.builder._trace_config`)

    def hashable(self) -> bool:
        try:
            hash(self)
            return True
        except TypeError:
            return False


@dataclass(frozen=True, eq=False)
class Call:
    """One call's arguments split into the graph's inputs and the static rest."""

    signature: Signature
    dynamic: list  # the param and data leaves, in flattening order
    leaves: list  # every leaf, in flattening order
    nargs: int  # positional arguments
    argnums: tuple[int, ...]  # differentiated positions, resolved
    has_kwargs: bool


def split_call(args, kwargs, argnums, name: str, kind_of) -> Call:
    """Classify every leaf of `(args, kwargs)`; `kind_of(leaf, path, differentiated)` gives its
    (kind, aval), `path()` (for messages) the leaf's place as the user wrote it: `args[0]['w']`."""
    nums = resolve_argnums(argnums, len(args), name) if argnums is not None else ()
    leaves, treedef = jax.tree.flatten((tuple(args), dict(kwargs)))
    positions = []  # per leaf, its positional argument (len(args) for keyword arguments)
    for i, sub in enumerate(treedef.children()[0].children()):
        positions += [i] * sub.num_leaves
    positions += [len(args)] * (len(leaves) - len(positions))

    def path_of(k):
        return lambda: _leaf_path(args, kwargs, k)

    described, dynamic = [], []
    for k, (x, i) in enumerate(zip(leaves, positions, strict=True)):
        kind, aval = kind_of(x, path_of(k), i in nums)
        if kind == STATIC:
            described.append((STATIC, type(x), StaticValue(x)))
        else:
            described.append((kind, aval))
            dynamic.append(x)
    signature = Signature(treedef, tuple(described), _trace_config())
    return Call(signature, dynamic, leaves, len(args), nums, bool(kwargs))


def _leaf_path(args, kwargs, k: int) -> str:
    path = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))[0][k][0]
    return ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(path[1:])


def with_holes(call: Call) -> tuple:
    """The graph's positional arguments: the call's, static leaves replaced by None (a tree with
    no leaf there), and the keyword arguments as one more dict when there are any."""
    values = [None if d[0] == STATIC else x
              for d, x in zip(call.signature.leaves, call.leaves, strict=True)]
    args, kwargs = jax.tree.unflatten(call.signature.treedef, values)
    return (*args, kwargs) if call.has_kwargs else args


def refill(signature: Signature, dynamic) -> tuple[tuple, dict]:
    """(args, kwargs) with the static leaves of `signature` and `dynamic` (tracers) everywhere
    else. (The signature, not the call: a cached trace must not keep a call's arrays alive.)"""
    dynamic = iter(dynamic)
    values = [d[2].value if d[0] == STATIC else next(dynamic) for d in signature.leaves]
    return jax.tree.unflatten(signature.treedef, values)


def split_traced(tree):
    """(treedef, per leaf its value if it is not traced else None, the traced leaves) of an
    output such as `aux`: what is not traced comes back as it is, as in JAX."""
    leaves, treedef = jax.tree.flatten(tree)
    traced = [isinstance(x, jax.core.Tracer) for x in leaves]
    return (treedef, [None if t else x for x, t in zip(leaves, traced, strict=True)],
            [x for x, t in zip(leaves, traced, strict=True) if t])
