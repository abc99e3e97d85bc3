"""Gradient families of reductions, with the parameters of JAX's autodiff suite: reduce
sum/max/min/prod over its shapes and axes (empty ones too), the variadic `reduce` (a pair
reduction, an argmax over (value, index)), windowed sum/max/min over strides, paddings, base and
window dilations (to third order, as JAX checks them), cumulative ops, sort (with keys and
values), top_k along any axis, and the tie conventions of max-like ops."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
from jax import lax
from op_families import COMPLEX, ISSUE_TAG, REAL, Arg, Case

RC = (REAL, COMPLEX)
REDUCE_SHAPES = [((), ()), ((3, 4, 5), ()), ((3, 4, 5), (0,)), ((3, 4, 5), (1, 2)),
                 ((3, 4, 5), (0, 2)), ((3, 4, 5), (0, 1, 2)), ((3, 1), (1,)), ((3, 0, 5), (1,))]


def _reduce_cases():
    """JAX's testReduceGrad (sum also complex; max/min on distinct values) and
    testReducePairGrad (a general reduce of two operands)."""
    cases = []
    monoids = [("reduce_sum", 0.0, lax.add, "default", RC),
               ("reduce_max", -np.inf, lax.max, "unique", (REAL,)),
               ("reduce_min", np.inf, lax.min, "unique", (REAL,)),
               ("reduce_prod", 1.0, lax.mul, (0.5, 1.5), (REAL,))]
    for (op, init, fn, kind, kinds), (shape, dims) in itertools.product(monoids, REDUCE_SHAPES):
        if op in ("reduce_max", "reduce_min") and 0 in shape:
            continue  # as JAX: no identity-valued gradient to check
        cases.append(Case(op, f"{shape}@{dims}",
                          lambda x, i=init, f=fn, d=dims: lax.reduce(x, np.array(i, x.dtype), f,
                                                                     d),
                          (Arg(shape, kind),), (op,), kinds, rtol=1e-4))

    def pair(xs, ys):
        return xs[0] + ys[0], xs[1] * ys[1]

    for shape, dims in REDUCE_SHAPES[1:]:
        cases.append(Case("reduce", f"pair{shape}@{dims}", lambda x, y, d=dims: lax.reduce(
            (x, y), (np.zeros((), x.dtype), np.ones((), y.dtype)), pair, d),
            (Arg(shape, (0.5, 1.5)), Arg(shape, (0.5, 1.5))), ("reduce",) if dims else (),
            rtol=1e-4))

    def argmax(a, b):  # (value, index) pairs: the larger value, the first index on ties
        take_a = (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
        return lax.select(take_a, a[0], b[0]), lax.select(take_a, a[1], b[1])

    def max_and_where(x, d):
        iota = lax.broadcasted_iota(jnp.int32, x.shape, d)
        value, _ = lax.reduce((x, iota), (np.array(-np.inf, x.dtype), np.int32(0)), argmax, (d,))
        return value

    # JAX's own JVP of a reduce with an integer operand fails (a symbolic zero tangent)
    cases += [Case("reduce", f"argmax{shape}@{d}", lambda x, d=d: max_and_where(x, d),
                   (Arg(shape, "unique"),), ("reduce",),
                   jax_fails="Error interpreting argument to reshape")
              for shape, d in [((7,), 0), ((3, 4, 5), 1)]]
    return cases


def _finite(y):
    """0 for windows of padding and base-dilation holes only (the identity, +-inf)."""
    return jnp.where(jnp.isfinite(y), y, jnp.zeros_like(y))


def _window_cases():
    """JAX's testReduceWindowGrad: window shapes, strides, paddings, base dilations, and window
    dilations for the sum (max/min: JAX has no rule with window dilation, nor has jgraph)."""
    cases = []
    grids = [((4, 6), [(2, 1), (1, 2)], [(1, 1), (2, 1), (1, 2)],
              ["VALID", "SAME", ((0, 3), (1, 2))], [(1, 1), (2, 3)], (1, 2)),
             ((3, 2, 4, 6), [(1, 1, 2, 1), (2, 1, 2, 1)], [(1, 2, 2, 1), (1, 1, 1, 1)],
              ["VALID", "SAME", ((0, 1), (1, 0), (2, 3), (0, 2))], [(1, 1, 1, 1), (2, 1, 3, 2)],
              (1, 2, 2, 1))]
    windows = [("reduce_window_sum", 0.0, lax.add, "small"),
               ("reduce_window_max", -np.inf, lax.max, "unique"),
               ("reduce_window_min", np.inf, lax.min, "unique")]
    for (op, init, fn, kind), (shape, dims, strides, pads, bases, wdil) in itertools.product(
            windows, grids):
        ones = (1,) * len(shape)
        wdils = [ones, wdil] if op == "reduce_window_sum" else [ones]
        for dim, stride, pad, base, wd in itertools.product(dims, strides, pads, bases, wdils):
            f = (lambda x, i=init, f=fn, dim=dim, s=stride, p=pad, b=base, w=wd: _finite(
                lax.reduce_window(x, np.array(i, x.dtype), f, dim, s, p, b, w)))
            cases.append(Case(op, f"{shape} w{dim} s{stride} p{pad} b{base} d{wd}", f,
                              (Arg(shape, kind),), (op,), rtol=1e-4,
                              order=3 if len(shape) == 2 else 2))
    for op, init, fn, _ in windows[1:]:  # a cotangent that depends on x: rules of orders 2 and 3
        cases.append(Case(op, "squared, order 3", lambda x, i=init, f=fn: jnp.square(
            lax.reduce_window(x, np.array(i, x.dtype), f, (2, 2), (1, 2), "SAME", (2, 1))),
            (Arg((4, 6), "unique"),), (op,), order=3, backward_ops=("select_and_scatter_add",),
            tags=ISSUE_TAG))
    return cases


def _cumulative_cases():
    """JAX's testCumulativeReduceGrad (and cummax/cummin on distinct values)."""
    ops = [("cumsum", lax.cumsum, "default", RC), ("cumprod", lax.cumprod, (0.5, 1.5), (REAL,)),
           ("cummax", lax.cummax, "unique", (REAL,)), ("cummin", lax.cummin, "unique", (REAL,))]
    return [Case(op, f"{shape}@{axis}{'r' if reverse else ''}",
                 lambda x, f=fn, a=axis, r=reverse: f(x, axis=a, reverse=r),
                 (Arg(shape, kind),), (op,), kinds, rtol=1e-4)
            for (op, fn, kind, kinds), shape in itertools.product(ops, [(10,), (3, 4, 5)])
            for axis in range(len(shape)) for reverse in (False, True)]


def _sort_cases():
    """JAX's testSortGrad, testSortKeyValGrad and testTopKGrad, other axes too."""
    cases = []
    for shape, axis in [((0,), 0), ((5,), 0), ((5, 7), 1), ((4, 9, 3), 2), ((5, 7), 0)]:
        for stable in (False, True):
            cases.append(Case("sort", f"{shape}@{axis}{'s' if stable else ''}",
                              lambda x, a=axis, s=stable: lax.sort(x, dimension=a, is_stable=s),
                              (Arg(shape, "unique"),), ("sort",)))
    for shape in [(3,), (5, 3), (4, 9, 3)]:
        cases.append(Case("sort", f"key_val{shape}",
                          lambda k, v: lax.sort_key_val(k, v, -1, True),
                          (Arg(shape, "unique"), Arg(shape)), ("sort",)))
    cases.append(Case("sort", "three operands, two keys",
                      lambda k, v, w: lax.sort((k, v, w), dimension=0, num_keys=2),
                      (Arg((6, 2), "unique"), Arg((6, 2)), Arg((6, 2))), ("sort",)))
    for shape, k, axis in itertools.product([(4,), (5, 5), (3, 1, 4)], [1, 3], [0, -1]):
        if k <= shape[axis]:
            cases.append(Case("top_k", f"{shape} k{k}@{axis}",
                              lambda x, k=k, a=axis: lax.top_k(x, k, axis=a)[0],
                              (Arg(shape, "unique"),), ("top_k",),
                              tags=ISSUE_TAG if (shape, k, axis) == ((5, 5), 3, 0) else
                              frozenset()))
    cases.append(Case("argmax", "x[argmax]", lambda x: x[jnp.argmax(x[:, 0])] * x[0],
                      (Arg((4, 3), "unique"),), ("argmax",)))
    return cases


def _tie_cases():
    """Where the derivative is a convention (ties), jgraph's must be JAX's."""
    why = "ties: the derivative is a convention (JAX's, checked)"
    values = ("values", (1, 3, 3, 2, 2, 2))
    return [
        Case("ties", "reduce_max", lambda x: jnp.max(x, 1), (Arg((2, 3), values),),
             ("reduce_max",), order=0, why_no_fd=why),
        Case("ties", "reduce_min", lambda x: jnp.min(x, 1), (Arg((2, 3), values),),
             ("reduce_min",), order=0, why_no_fd=why),
        Case("ties", "max", lambda x, y: lax.max(x, y), (Arg((6,), values), Arg((6,), ("at", 2))),
             ("max",), order=0, why_no_fd=why),
        Case("ties", "min", lambda x, y: lax.min(x, y), (Arg((6,), values), Arg((6,), ("at", 2))),
             ("min",), order=0, why_no_fd=why),
        Case("ties", "cummax", lambda x: lax.cummax(x, 0), (Arg((6,), values),), ("cummax",),
             order=0, why_no_fd=why),
        Case("ties", "reduce_window_max", lambda x: lax.reduce_window(
            x, -np.inf, lax.max, (2,), (1,), "VALID"), (Arg((6,), values),),
             ("reduce_window_max",), order=0, why_no_fd=why),
        Case("ties", "sort stable", lambda x: lax.sort(x, is_stable=True) * np.arange(6.0),
             (Arg((6,), values),), ("sort",), order=0, why_no_fd=why),
    ]


def cases():
    return (_reduce_cases() + _window_cases() + _cumulative_cases() + _sort_cases()
            + _tie_cases())
