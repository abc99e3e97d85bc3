"""Regions whose backward reads recomputed copies of their outputs (`Region.outputs_recomputed`,
JAX's remat semantics; what plans made for a TPU or a GPU use): the same values, bit for bit,
and the kept outputs read by the forward and by matrix products alone (the next region's weight
gradient reads its input, kept for that region's recompute anyway: a TPU stores it in the
products' bfloat16)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgraph as jg

F32 = jnp.float32


def tanh_chain(ws, x):
    h = x
    for w in ws:
        h = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w)
    return jnp.mean(h**2)


def residual(ws, x):
    h = x
    for w in ws:
        h = h + jax.checkpoint(lambda h, w: jax.nn.gelu(h @ w) * jnp.sin(h))(h, w)
    return jnp.mean(jnp.tanh(h) ** 2)


def nested(ws, x):
    def pair(h, a, b):
        h = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, a)
        return jax.checkpoint(lambda h, w: jax.nn.relu(h @ w) + h)(h, b)

    h = x
    for a, b in zip(ws[::2], ws[1::2], strict=True):
        h = jax.checkpoint(pair)(h, a, b)
    return jnp.mean(h * h)


def args(layers=4, width=8, batch=6):
    ws = [jnp.linspace(-0.6, 0.6, width * width, dtype=F32).reshape(width, width) * (1 + k / 3)
          for k in range(layers)]
    return ws, jnp.linspace(-1, 1, batch * width, dtype=F32).reshape(batch, width)


def flavoured(gb):
    return gb.replace(regions=tuple(dataclasses.replace(r, outputs_recomputed=True)
                                    for r in gb.regions))


@pytest.mark.parametrize("fn", [tanh_chain, residual, nested])
def test_the_backward_reads_recomputed_outputs_and_the_values_are_the_same(fn):
    ws, x = args()
    gb = jg.backward(jg.trace(fn, ws, x, param_argnums=0))
    plain, jaxlike = jg.remat(gb), jg.remat(flavoured(gb))
    jg.check(jaxlike)
    kept_outputs = {v for e in gb.eqns if e.regions and "backward" not in e.tags
                    for v in e.outputs}
    read_back = {a for e in jaxlike.eqns if "backward" in e.tags and e.op != "dot_general"
                 for a in e.inputs}
    # the backward reads no value a checkpointed region computed in the forward, but as the
    # operand of a matrix product
    assert not (kept_outputs & read_back)
    more = sum("recompute" in e.tags for e in jaxlike.eqns) - sum(
        "recompute" in e.tags for e in plain.eqns)
    # a tanh's VJP reads its output: its region now recomputes it (a residual block's output
    # is read by no backward eqn, so nothing more is recomputed there)
    assert more > 0 if fn is not residual else more == 0
    want = jg.evaluate(jg.backward(jg.trace(fn, ws, x, param_argnums=0)), ws, x)
    for got in (jg.evaluate(jaxlike, ws, x), jg.evaluate(plain, ws, x)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert np.array_equal(a, b)
    reference = jax.value_and_grad(fn)(ws, x)
    for a, b in zip(jax.tree.leaves(jg.compile(jaxlike)(ws, x)), jax.tree.leaves(reference),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
