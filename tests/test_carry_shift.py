"""Carry-shift residuals: a scan body's carry output that its backward reads is the next
iteration's carry input, which the forward scan stacks already; the backward scan carries it from
one iteration to the next instead of the forward scan stacking it a second time.

Checked against `jax.value_and_grad` (float32) and float64 finite differences, on the graph (what
the forward scan stacks, what the backward scan carries) and on XLA's compiled donated step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jgraph as jg
from jgraph.planner.search import xla_temp

RNG = np.random.default_rng(7)
WS = (RNG.standard_normal((5, 4, 4)) / 2).astype(np.float32)
X = RNG.standard_normal((3, 4)).astype(np.float32)


def tanh_layers(ws, x):
    return jnp.sum(lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0] ** 2)


def reversed_layers(ws, x):
    h, ys = lax.scan(lambda h, w: (jnp.tanh(h @ w), jnp.sum(h ** 2)), x, ws, reverse=True)
    return jnp.sum(h ** 3) + jnp.sum(ys * jnp.arange(1.0, 6.0))


def output_also_a_y(ws, x):
    """The shifted carry is also a stacked y, and the loss reads the ys and the final carry."""
    def step(h, w):
        y = jnp.tanh(h @ w)
        return y, y

    h, ys = lax.scan(step, x, ws)
    return jnp.sum(ys ** 2 * jnp.arange(1.0, 6.0)[:, None, None]) + jnp.sum(jnp.sin(h))


def two_carries(ws, x):
    """An LSTM-like pair: both outputs are read by their VJPs; the cell is an exp (its VJP
    reads its output), the hidden state a tanh of a product."""
    def step(carry, w):
        h, c = carry
        c = jnp.exp(0.3 * jnp.tanh(h @ w)) * c
        h = jnp.tanh(c @ w + h)
        return (h, c), None

    (h, c), _ = lax.scan(step, (x, jnp.ones_like(x)), ws)
    return jnp.sum(h * c)


def swapped_carries(ws, x):
    """(a, b) -> (b, tanh(a @ w) * b): carry 0's output is carry 1's input, not a new value."""
    def step(carry, w):
        a, b = carry
        return (b, jnp.tanh(a @ w) * b), None

    (a, b), _ = lax.scan(step, (x, x + 1.0), ws)
    return jnp.sum(a * b)


def nested(ws, x):
    def outer(h, w):
        return lax.scan(lambda g, _: (jnp.tanh(g @ w), None), h, None, length=3)[0], None

    return jnp.sum(lax.scan(outer, x, ws)[0])


def unrolled(ws, x):
    return jnp.sum(lax.scan(lambda h, w: (jnp.sin(jnp.tanh(h @ w)), None), x, ws, unroll=2)[0])


def exp_only(ws, x):
    """The body's VJP reads only its output (exp): the carry input is not a residual, so there
    is nothing to shift (stacking the output or the input costs the same)."""
    return jnp.sum(lax.scan(lambda h, w: (jnp.exp(h + w[0]) / 4, None), x, ws)[0])


PROGRAMS = [tanh_layers, reversed_layers, output_also_a_y, two_carries, swapped_carries, nested,
            unrolled, exp_only]


def joint(fn, *args):
    return jg.check(jg.backward(jg.check(jg.trace(fn, *args, param_argnums=0))))


def scans(graph):
    forward = next(e for e in graph.eqns if e.op == "scan" and "backward" not in e.tags)
    backward = next(e for e in graph.eqns if e.op == "scan" and "backward" in e.tags)
    return forward, backward


def stacked(forward, n_ys=0):
    return forward.outputs[forward.params["num_carry"] + n_ys:]


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_gradients_equal_value_and_grad(fn):
    gb = joint(fn, WS, X)
    value, grad = jg.compile(gb)(WS, X)
    want_value, want_grad = jax.jit(jax.value_and_grad(fn))(WS, X)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-6)
    ev_value, ev_grad = jg.evaluate(gb, WS, X)
    np.testing.assert_allclose(ev_grad, want_grad, rtol=2e-5, atol=1e-6)


@pytest.mark.f64
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_gradients_match_finite_differences(fn):
    jg.testing.check_grads(fn, (WS.astype(np.float64), X.astype(np.float64)), order=1)


@pytest.mark.parametrize("fn, n_ys, stacks, shifted", [
    (tanh_layers, 0, 1, 1),  # h (for the dot's VJP); tanh's output is the next h
    (reversed_layers, 1, 1, 1),
    (output_also_a_y, 1, 1, 1),
    (two_carries, 0, 4, 2),  # h, c, tanh's and exp's outputs; both carry outputs shifted
    (swapped_carries, 0, 3, 0),  # a, b and tanh's output; carry 0's output is an input
    (exp_only, 0, 1, 0)])
def test_what_the_forward_stacks_and_the_backward_carries(fn, n_ys, stacks, shifted):
    forward, backward = scans(joint(fn, WS, X))
    assert len(stacked(forward, n_ys)) == stacks
    ct_carries = forward.params["num_carry"]  # every carry here has a cotangent
    assert backward.params["num_carry"] == ct_carries + shifted  # (the weights are xs)


def test_the_backward_starts_from_the_final_carry():
    """Iteration i's tanh output is iteration i+1's carry: the last one is the final carry, the
    backward scan's initial shifted value (so a loss that ignores the final carry still gets a
    gradient through the last layer's tanh right)."""
    def ys_only(ws, x):
        return jnp.sum(lax.scan(lambda h, w: (jnp.tanh(h @ w), jnp.sum(h)), x, ws)[1] ** 2)

    forward, backward = scans(joint(ys_only, WS, X))
    assert forward.outputs[0] in backward.inputs
    want = jax.grad(ys_only)(WS, X)
    np.testing.assert_allclose(jg.compile(joint(ys_only, WS, X))(WS, X)[1], want, rtol=2e-5,
                               atol=1e-6)


def test_checkpointed_bodies_are_unchanged():
    """A body that keeps only its input recomputes its output; nothing to shift."""
    layer = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None))
    fn = lambda ws, x: jnp.sum(lax.scan(layer, x, ws)[0])
    forward, backward = scans(joint(fn, WS, X))
    assert len(stacked(forward)) == 1 and backward.params["num_carry"] == 1


def test_a_scanned_mlp_stacks_half_of_what_jax_stacks():
    """On XLA's compiled donated step: 16 tanh layers of a 256 x 64 batch. JAX stacks every
    layer's input and output (2 x 16 x 64 KiB), jgraph the inputs only."""
    layers, width, batch = 16, 64, 256
    ws = (RNG.standard_normal((layers, width, width)) / 8).astype(np.float32)
    x = RNG.standard_normal((batch, width)).astype(np.float32)
    gb = joint(tanh_layers, ws, x)
    ours = xla_temp(gb)
    theirs = jax.jit(jax.value_and_grad(tanh_layers), donate_argnums=0).lower(
        ws, x).compile().memory_analysis().temp_size_in_bytes
    layer_bytes = batch * width * 4
    assert theirs - ours >= (layers - 2) * layer_bytes, (ours, theirs)
    estimate = jg.memory(gb).peak_bytes
    assert abs(estimate - ours) <= 0.25 * ours, (estimate, ours)


def test_second_order_through_the_compiled_step():
    """Hessian-vector products (jax.jvp of the compiled gradient) and jg.backward of a loss of
    the compiled gradient, against JAX's."""
    step = jg.compile(joint(tanh_layers, WS, X))
    v = RNG.standard_normal(WS.shape).astype(np.float32)
    ours = jax.jvp(lambda w: step(w, X)[1], (WS,), (v,))[1]
    theirs = jax.jvp(lambda w: jax.grad(tanh_layers)(w, X), (WS,), (v,))[1]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    twice = joint(lambda w, x: jnp.sum(step(w, x)[1] ** 2), WS, X)
    want = jax.grad(lambda w: jnp.sum(jax.grad(tanh_layers)(w, X) ** 2))(WS)
    np.testing.assert_allclose(jg.compile(twice)(WS, X)[1], want, rtol=1e-4, atol=1e-5)
