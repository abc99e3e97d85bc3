"""Helpers of the property tests (`test_properties*.py`): example counts per profile, comparisons,
and the pytrees a drawn graph is called with.

`examples(n)`: n examples under the `ci` profile (the default run); under any other profile its own
count (`thorough`: 1000), so `HYPOTHESIS_PROFILE=thorough` draws >= 1000 graphs per property. A
float64 twin (`*_f64`, the `f64` marker: x64 on while drawing) checks what its float32 test checks
and draws fewer examples under `ci`.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from hypothesis import settings

import jgraph as jg

QUICK = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def examples(ci: int):
    if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci":
        return settings(max_examples=ci)
    return settings()


def assert_bitwise(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        np.testing.assert_array_equal(a, b)


def tolerance(dtype) -> float:
    return 1e-10 if np.dtype(dtype) == np.float64 else 2e-5


def assert_close(got, want, rtol: float):
    """Leaf by leaf: same structure, dtypes and shapes; floats within `rtol` of the leaf's scale
    (the largest |want|), others equal."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        if np.issubdtype(b.dtype, np.inexact):
            scale = max(1.0, float(np.max(np.abs(b), initial=0.0)))
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale)
        else:
            np.testing.assert_array_equal(a, b)


def argnums(graph) -> tuple[int, ...]:
    n = graph.param_argnums
    return (n,) if isinstance(n, int) else tuple(n)


def params_of(graph, args):
    """The params pytree as `jax.grad(argnums=graph.param_argnums)` sees it."""
    n = graph.param_argnums
    return args[n] if isinstance(n, int) else tuple(args[i] for i in n)


def jitted(fn, *args):
    """`fn` compiled quickly for `args` (a check runs once: compile time dominates)."""
    return jax.jit(fn).lower(*args).compile(QUICK)


def value_and_grad_of_graph(graph, args):
    """`jax.value_and_grad` of the graph's own JAX evaluation (JAX differentiates its ops)."""
    fn = jax.value_and_grad(lambda *a: jg.evaluate(graph, *a), argnums=graph.param_argnums,
                            has_aux=graph.has_aux)
    return jitted(fn, *args)(*args)


def snapshot(graph):
    """Everything a transform could mutate in place: printed text, identities, params, info."""
    return (str(graph), graph.inputs, graph.eqns, graph.outputs, graph.input_roles,
            graph.output_roles, graph.regions, tuple(e.inputs for e in graph.eqns),
            tuple(e.outputs for e in graph.eqns), tuple(repr(dict(e.params)) for e in graph.eqns),
            repr(dict(graph.info)))
