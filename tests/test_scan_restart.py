"""Scans keeping every k-th carry (`scan[keep_every=k]`, `jgraph.vjp_rules.scan_restart`): the
forward keeps the carries of every k-th iteration, each backward iteration recomputes its carries
from the nearest kept ones.

Gradients against `jax.value_and_grad` (float32) and float64 finite differences; structure on
the graph; memory on XLA's compiled donated step; the planner's use of the mode under a budget.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jgraph as jg
from jgraph.planner.loops import keep_every
from jgraph.planner.search import xla_temp

RNG = np.random.default_rng(11)
L = 10
WS = (RNG.standard_normal((L, 4, 4)) / 2).astype(np.float32)
X = RNG.standard_normal((3, 4)).astype(np.float32)


def marked(graph, k):
    return graph.replace(eqns=tuple(
        dataclasses.replace(e, params={**e.params, "keep_every": k}) if e.op == "scan" else e
        for e in graph.eqns))


def tanh_layers(ws, x):
    h, ys = lax.scan(lambda h, w: (jnp.tanh(h @ w), jnp.sum(h)), x, ws)
    return jnp.sum(h ** 2) + jnp.sum(ys * jnp.arange(1.0, L + 1))


def reversed_layers(ws, x):
    h, ys = lax.scan(lambda h, w: (jnp.sin(h @ w), h), x, ws, reverse=True)
    return jnp.sum(h * ys[0]) + jnp.sum(ys[-1] ** 2)


def counter_key_and_consts(ws, x):
    """An int counter, a PRNG key and a float carry; a const read by every iteration."""
    scale = ws[0, 0, 0]

    def step(carry, w):
        i, key, h = carry
        key, sub = jax.random.split(key)
        h = jnp.tanh(h @ w * scale) + 0.01 * i * jax.random.normal(sub, h.shape, h.dtype)
        return (i + 1, key, h), None

    (_, _, h), _ = lax.scan(step, (0, jax.random.PRNGKey(0), x), ws)
    return jnp.sum(h)


def two_float_carries(ws, x):
    def step(carry, w):
        h, c = carry
        c = c * jax.nn.sigmoid(h @ w)
        return (jnp.tanh(c @ w + h), c), None

    (h, c), _ = lax.scan(step, (x, jnp.ones_like(x)), ws)
    return jnp.sum(h * c)


def inner_scan(ws, x):
    def outer(h, w):
        return lax.scan(lambda g, _: (jnp.tanh(g @ w), None), h, None, length=3)[0], None

    return jnp.sum(lax.scan(outer, x, ws)[0])


def linear_in_the_carry(ws, x):
    """No residual is a carry (the VJP of `h + sin(w)` reads only `w`): nothing to keep."""
    return jnp.sum(lax.scan(lambda h, w: (h + jnp.sin(w[0]), None), x, ws)[0])


PROGRAMS = [tanh_layers, reversed_layers, counter_key_and_consts, two_float_carries, inner_scan,
            linear_in_the_carry]


@pytest.mark.parametrize("k", [2, pytest.param(3, marks=pytest.mark.slow), 4, 9])
# 3 and 4 do not divide the length (3 runs opt-in: 4 checks a remainder by default)
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_gradients_equal_value_and_grad(fn, k):
    gb = jg.check(jg.backward(marked(jg.trace(fn, WS, X, param_argnums=0), k)))
    value, grad = jg.compile(gb)(WS, X)
    want_value, want_grad = jax.jit(jax.value_and_grad(fn))(WS, X)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(jg.evaluate(gb, WS, X)[1], want_grad, rtol=2e-5, atol=1e-6)
    plain = jg.backward(jg.trace(fn, WS, X, param_argnums=0))  # the same ops on the same values
    np.testing.assert_array_equal(jg.evaluate(gb, WS, X)[1], jg.evaluate(plain, WS, X)[1])


@pytest.mark.f64
@pytest.mark.parametrize("fn", PROGRAMS[:4], ids=lambda f: f.__name__)
def test_gradients_match_finite_differences(fn):
    ws, x = WS.astype(np.float64), X.astype(np.float64)
    gb = jg.backward(marked(jg.trace(fn, ws, x, param_argnums=0), 4))
    got = jg.compile(gb)(ws, x)[1]
    eps, rng = 1e-6, np.random.default_rng(0)
    for _ in range(3):
        d = rng.standard_normal(ws.shape)
        numeric = (fn(ws + eps * d, x) - fn(ws - eps * d, x)) / (2 * eps)
        np.testing.assert_allclose(np.sum(got * d), numeric, rtol=1e-6, atol=1e-8)


def test_the_forward_keeps_every_kth_carry_and_the_backward_recomputes():
    gb = jg.backward(marked(jg.trace(tanh_layers, WS, X, param_argnums=0), 4))
    forward = next(e for e in gb.eqns if e.op == "scan" and "backward" not in e.tags)
    backward = next(e for e in gb.eqns if e.op == "scan" and "backward" in e.tags)
    # carries: h, the step counter, h's buffer of ceil(10 / 4) = 3 slots; ys: the sums only
    assert [v.aval.shape for v in forward.outputs] == [(3, 4), (), (3, 3, 4), (L,)]
    inner = [e for e in backward.params["body"].eqns if e.op == "scan"]
    assert len(inner) == 1 and "recompute" in inner[0].tags
    assert inner[0].params["length"] == 3  # up to k - 1 forward iterations, each a cond
    assert [e.op for e in inner[0].params["body"].eqns].count("cond") == 1


def test_a_scan_with_nothing_to_keep_is_differentiated_as_usual():
    gb = jg.backward(marked(jg.trace(linear_in_the_carry, WS, X, param_argnums=0), 4))
    forward = next(e for e in gb.eqns if e.op == "scan" and "backward" not in e.tags)
    assert forward.params["num_carry"] == 1


def test_prints_run_once_per_forward_iteration(capfd):
    def printing(ws, x):
        def body(h, w):
            jax.debug.print("layer", ordered=True)
            return jnp.tanh(h @ w), None

        return jnp.sum(lax.scan(body, x, ws)[0])

    gb = jg.backward(marked(jg.trace(printing, WS, X, param_argnums=0), 3))
    capfd.readouterr()
    jax.block_until_ready(jg.compile(gb)(WS, X))
    jax.effects_barrier()
    assert capfd.readouterr().out.splitlines() == ["layer"] * L


def scanned(layers, width=64, batch=256):
    ws = (RNG.standard_normal((layers, width, width)) / np.sqrt(width)).astype(np.float32)
    x = RNG.standard_normal((batch, width)).astype(np.float32)
    fn = lambda ws, x: jnp.mean(lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0] ** 2)
    return fn, ws, x


def test_compiled_temp_keeps_a_carry_per_k_iterations():
    """XLA's donated step: 32 layers of 64 KiB carries. No remat stacks 32 of them; keeping
    every 8th keeps 4, and `jg.memory` follows."""
    fn, ws, x = scanned(32)
    g = jg.trace(fn, ws, x, param_argnums=0)
    plain, kept = jg.backward(g), jg.backward(marked(g, 8))
    carry = 256 * 64 * 4
    assert xla_temp(plain) - xla_temp(kept) >= (32 - 4 - 2) * carry
    assert abs(jg.memory(kept).peak_bytes - xla_temp(kept)) <= 0.25 * xla_temp(kept)
    np.testing.assert_allclose(jg.compile(kept)(ws, x)[1], jax.grad(fn)(ws, x), rtol=2e-5,
                               atol=1e-7)


def test_the_planner_keeps_every_kth_carry_below_what_nested_scans_reach():
    from jgraph.planner.search import problems

    fn, ws, x = scanned(64)
    g = jg.trace(fn, ws, x, param_argnums=0)
    assert [e.params.get("keep_every") for e in keep_every(g, 2).eqns if e.op == "scan"] == [16]
    gb = jg.backward(g)
    nested = problems(gb)["scans split in three, bodies keeping their inputs"].graph
    budget = int(0.9 * xla_temp(nested))  # below the least nested scans reach
    gr = jg.remat(gb, budget=budget)
    report = gr.info["remat"]
    assert "keeping every k-th carry" in report["plan"]
    assert report["xla_temp"] <= budget
    np.testing.assert_allclose(jg.compile(gr)(ws, x)[1], jg.compile(gb)(ws, x)[1], rtol=1e-6,
                               atol=1e-9)


def test_second_order_through_the_compiled_step():
    """jg.backward of a loss of the compiled gradient of a scan keeping every 3rd carry."""
    step = jg.compile(jg.backward(marked(jg.trace(tanh_layers, WS, X, param_argnums=0), 3)))
    twice = jg.backward(jg.trace(lambda w, x: jnp.sum(step(w, x)[1] ** 2), WS, X,
                                 param_argnums=0))
    want = jax.grad(lambda w: jnp.sum(jax.grad(tanh_layers)(w, X) ** 2))(WS)
    np.testing.assert_allclose(jg.compile(twice)(WS, X)[1], want, rtol=1e-4, atol=1e-5)
