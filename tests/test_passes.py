"""The clean-up passes: dead-code elimination and common-subexpression elimination.

Both are pure (the input graph is unchanged), keep the signature, give a graph that passes
`check`, and compute the same values. CSE merges identical eqns but never one tagged `no_cse`,
and never across checkpoint regions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jgraph as jg
from jgraph.passes import cse, dce

X = jnp.linspace(0.1, 1.0, 6, dtype=jnp.float32).reshape(2, 3)


def _ops(graph):
    return [e.op for e in graph.eqns]


def _duplicated(x):
    a = jnp.sin(x) * 2.0
    b = jnp.sin(x) * 2.0  # the same computation again
    c = jnp.cos(x)  # dead: nobody reads it
    del c
    return jnp.sum(a + b)


def test_dce_drops_dead_eqns_and_keeps_inputs():
    def f(x, unused):
        jnp.exp(x)  # dead
        return jnp.sum(jnp.sin(x))

    g = jg.trace(f, X, X)
    dead = g.replace(eqns=g.eqns + (dataclasses.replace(g.eqns[0], outputs=(
        jg.Var(g.eqns[0].outputs[0].aval),)),))
    out = dce(dead)
    jg.check(out)
    assert "exp" not in _ops(out) and len(out.eqns) == len(g.eqns) - ("exp" in _ops(g))
    assert out.inputs == g.inputs and dce(out) is out


def test_cse_merges_duplicates_and_keeps_values():
    g = jg.trace(_duplicated, X)
    assert _ops(g).count("sin") == 2
    before = str(g)
    out = cse(g)
    jg.check(out)
    assert str(g) == before  # pure
    assert _ops(out).count("sin") == 1 and _ops(out).count("mul") == 1
    np.testing.assert_array_equal(jg.evaluate(out, X), jg.evaluate(g, X))
    assert cse(out) is out


def test_cse_merges_equal_literals_not_different_ones():
    def f(x):
        return jnp.sum(x * 2.0) + jnp.sum(x * 2.0) + jnp.sum(x * 3.0)

    out = cse(jg.trace(f, X))
    assert _ops(out).count("mul") == 2
    np.testing.assert_allclose(jg.evaluate(out, X), f(X), rtol=1e-6)


def test_cse_respects_no_cse():
    g = jg.trace(_duplicated, X)
    sins = [i for i, e in enumerate(g.eqns) if e.op == "sin"]
    eqns = list(g.eqns)
    eqns[sins[1]] = dataclasses.replace(eqns[sins[1]], tags=frozenset({"recompute", "no_cse"}))
    out = cse(g.replace(eqns=tuple(eqns)))
    assert _ops(out).count("sin") == 2
    jg.check(out)


def test_cse_does_not_merge_across_checkpoint_regions():
    def f(x):
        y = jax.checkpoint(lambda x: jnp.sin(x) * 2.0)(x)
        return jnp.sum(y + jnp.sin(x) * 2.0)

    g = jg.trace(f, X)
    assert _ops(cse(g)).count("sin") == 2


def test_cse_after_backward_shares_forward_values():
    # sin's rule computes cos(x); the forward computes it too: CSE keeps one.
    f = lambda w, x: jnp.sum(jnp.sin(x * w) + jnp.cos(x * w))
    w = jnp.float32(0.5)
    gb = jg.backward(jg.trace(f, w, X, param_argnums=0))
    out = cse(gb)
    jg.check(out)
    assert _ops(out).count("cos") < _ops(gb).count("cos")
    for a, b in zip(jax.tree.leaves(jg.compile(out)(w, X)), jax.tree.leaves(jg.compile(gb)(w, X)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
