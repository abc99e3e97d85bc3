"""The trace -> backward -> compile pipeline on a 2-layer MLP, against jax.value_and_grad."""

import jax
import jax.numpy as jnp
import numpy as np

import jgraph as jg


def mlp(p, x):
    return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])


P = {"w1": jnp.full((3, 4), 0.1, jnp.float32), "w2": jnp.full((4, 2), 0.2, jnp.float32)}
X = (jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)) / 6


def test_forward_and_backward_match_jax():
    g = jg.check(jg.trace(mlp, P, X, param_argnums=0))
    np.testing.assert_array_equal(jg.compile(g)(P, X), mlp(P, X))
    gb = jg.check(jg.backward(g))
    got = jg.compile(gb)(P, X)
    want = jax.value_and_grad(mlp)(P, X)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
