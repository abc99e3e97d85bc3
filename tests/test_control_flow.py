"""Structured control flow: scan, cond and while as ops with sub-graphs, their VJPs, remat inside.

Every loop kind is checked against `jax.value_and_grad` (float32, JAX's defaults) and central
finite differences in float64 (orders 1 and 2); structure is checked on the graphs (what a forward
scan stacks for its backward) and memory on XLA's compiled, donated step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jgraph as jg

RNG = np.random.default_rng(0)
WS = RNG.standard_normal((4, 3, 3)).astype(np.float32) / 2
X = RNG.standard_normal(3).astype(np.float32)


def scan_tanh(ws, x):
    h, ys = lax.scan(lambda h, w: (jnp.tanh(h @ w), jnp.sum(h)), x, ws)
    return jnp.sum(h) + jnp.sum(ys * jnp.arange(1.0, 1.0 + ys.shape[0]))


def scan_reverse(ws, x):
    h, ys = lax.scan(lambda h, w: (jnp.sin(h @ w), h), x, ws, reverse=True)
    return jnp.sum(h * ys)


def scan_consts_no_xs(ws, x):
    h, _ = lax.scan(lambda h, _: (jnp.tanh(h @ ws[0]) + ws[1, 0], None), x, None, length=5)
    return jnp.sum(h ** 2)


def nested_scans(ws, x):
    def outer(h, w):
        h, ys = lax.scan(lambda g, i: (jnp.sin(g @ w) + 0.1 * i, jnp.sum(g)), h, jnp.arange(2.0))
        return h, ys

    h, ys = lax.scan(outer, x, ws)
    return jnp.sum(h) + jnp.sum(ys ** 2)


def fori(ws, x):
    return jnp.sum(lax.fori_loop(0, 5, lambda i, h: jnp.sin(h @ ws[i % 4]) * (i + 1.0), x))


def lax_map(ws, x):
    return jnp.sum(lax.map(lambda w: jnp.cos(x @ w), ws))


def cond_on_data(ws, x):
    h = lax.cond(jnp.sum(x) > 0, lambda h: jnp.sin(h @ ws[0]), lambda h: h * ws[1, 1], x)
    return jnp.sum(h ** 2)


def switch(ws, x):
    branches = [lambda w: jnp.sin(x @ w[0]), lambda w: w[1] @ x, lambda w: x * w[2, 0, 0]]
    return jnp.sum(lax.switch(jnp.argmax(x), branches, ws))


def int_carry_and_keys(ws, x):
    def step(carry, w):
        i, key, h = carry
        key, sub = jax.random.split(key)
        h = jnp.tanh(h @ w) + 0.01 * i * jax.random.normal(sub, h.shape, h.dtype)
        return (i + 1, key, h), i

    (_, _, h), _ = lax.scan(step, (0, jax.random.PRNGKey(0), x), ws)
    return jnp.sum(h)


def cond_in_scan(ws, x):
    def step(h, w):
        h = lax.cond(jnp.sum(h) > 0, lambda h: jnp.tanh(h @ w), lambda h: jnp.sin(h) @ w, h)
        return h, None

    return jnp.sum(lax.scan(step, x, ws)[0])


def checkpointed_body(ws, x):
    layer = jax.checkpoint(lambda h, w: (jnp.tanh(jnp.sin(h @ w) @ w), None))
    return jnp.sum(lax.scan(layer, x, ws)[0])


LOOPS = [scan_tanh, scan_reverse, scan_consts_no_xs, nested_scans, fori, lax_map, cond_on_data,
         switch, int_carry_and_keys, cond_in_scan, checkpointed_body]


def joint(fn, *args):
    return jg.check(jg.backward(jg.check(jg.trace(fn, *args, param_argnums=0))))


@pytest.mark.parametrize("fn", LOOPS, ids=lambda f: f.__name__)
def test_gradients_equal_value_and_grad(fn):
    value, grad = jg.compile(joint(fn, WS, X))(WS, X)
    want_value, want_grad = jax.jit(jax.value_and_grad(fn))(WS, X)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.f64
@pytest.mark.parametrize("fn", LOOPS, ids=lambda f: f.__name__)
def test_gradients_match_finite_differences(fn):
    jg.testing.check_grads(fn, (WS.astype(np.float64), X.astype(np.float64)), order=2)


def test_the_loop_stays_a_loop():
    gb = joint(scan_tanh, WS, X)
    scans = [e for e in gb.eqns if e.op == "scan"]
    assert len(scans) == 2  # the forward, and the backward running the other way
    forward, backward = scans
    assert "backward" in backward.tags and backward.params["reverse"] is True
    assert len(gb.eqns) < 40 and not any(e.op == "tanh" for e in gb.eqns)


def test_a_long_scan_is_one_op():
    ws = np.ones((2000, 3, 3), np.float32) / 3
    gb = joint(scan_tanh, ws, X)
    assert len(gb.eqns) < 40  # not unrolled: 2,000 steps are one forward and one backward op
    value, grad = jg.compile(gb)(ws, X)
    want_value, want_grad = jax.jit(jax.value_and_grad(scan_tanh))(ws, X)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


def stacked_residuals(graph, n_ys=0):
    """Shapes of what the forward scan stacks for its backward (its outputs after the carries
    and the `n_ys` stacked ys of the traced scan)."""
    scan = next(e for e in graph.eqns if e.op == "scan" and "backward" not in e.tags)
    return [v.aval.shape for v in scan.outputs[scan.params["num_carry"] + n_ys:]]


def test_checkpoint_in_the_body_stacks_only_the_carry():
    """scan(checkpoint(layer)): per iteration, the backward keeps the layer's input (the carry);
    the weight slice is re-read from xs and everything else is recomputed inside the backward
    loop. Without the checkpoint, two of the layer's intermediates are stacked too (the third,
    the tanh output, is the next iteration's carry: read back shifted, not stacked again)."""
    plain = lambda ws, x: jnp.sum(lax.scan(
        lambda h, w: (jnp.tanh(jnp.sin(h @ w) @ w), None), x, ws)[0])
    assert len(stacked_residuals(joint(plain, WS, X))) == 3
    gr = joint(checkpointed_body, WS, X)
    assert stacked_residuals(gr) == [(4, 3)]
    backward = next(e for e in gr.eqns if e.op == "scan" and "backward" in e.tags)
    assert [e.op for e in backward.params["body"].eqns if "recompute" in e.tags] == [
        "dot_general", "sin", "dot_general", "tanh"]


@pytest.mark.parametrize("policy, residuals", [
    (jg.policies.nothing_saveable, 1), (jg.policies.dots_saveable, 3),
    (jg.policies.everything_saveable, 3)])  # 3: the tanh output is the next carry (shifted)
def test_a_policy_sees_through_loops(policy, residuals):
    plain = lambda ws, x: jnp.sum(lax.scan(
        lambda h, w: (jnp.tanh(jnp.sin(h @ w) @ w), None), x, ws)[0])
    gb = joint(plain, WS, X)
    gr = jg.check(jg.remat(gb, policy=policy))
    assert len(stacked_residuals(gr)) == residuals
    for a, b in zip(jg.evaluate(gr, WS, X), jg.evaluate(gb, WS, X), strict=True):
        np.testing.assert_array_equal(a, b)  # op by op: the same values, bit for bit
    assert jg.memory(gr).peak_bytes <= jg.memory(gb).peak_bytes


def test_policy_needs_the_graph_backward_returned():
    gb = joint(scan_tanh, WS, X)
    changed = gb.replace(eqns=gb.eqns[:-1] + gb.eqns[-1:])  # another eqns tuple: not backward's
    with pytest.raises(jg.TransformError, match="apply remat right after backward"):
        jg.remat(changed, policy=jg.policies.dots_saveable)


def test_a_budget_can_recompute_loop_bodies():
    plain = lambda ws, x: jnp.mean(lax.scan(
        lambda h, w: (jnp.tanh(jnp.sin(h @ w) @ w), None), x, ws)[0] ** 2)
    ws, x = RNG.standard_normal((8, 16, 16)).astype(np.float32) / 4, np.ones((4, 16), np.float32)
    gb = joint(plain, ws, x)
    full = jg.compiled_memory(gb, ws, x).temp_bytes  # a budget is on the compiled step's temp
    gr = jg.remat(gb, budget=full - 1)
    assert gr.info["remat"]["plan"].startswith("loop bodies keep")  # a policy inside the body
    assert jg.compiled_memory(gr, ws, x).temp_bytes <= full - 1
    np.testing.assert_allclose(jg.compile(gr)(ws, x)[1], jax.grad(plain)(ws, x), rtol=1e-5,
                               atol=1e-7)
    with pytest.raises(jg.TransformError, match="percentage"):
        jg.remat(gb, budget="1MB")


def test_memory_counts_stacked_residuals_and_the_body_peak():
    gb = joint(scan_tanh, WS, X)
    report = jg.memory(gb)
    forward = next(e for e in gb.eqns if e.op == "scan")
    i = gb.eqns.index(forward)
    body_peak = jg.memory(forward.params["body"]).peak_bytes
    stacked = sum(int(np.prod(v.aval.shape)) * 4 for v in forward.outputs)
    assert report.live_bytes[i] >= stacked + body_peak


def test_while_on_the_gradient_path_is_an_error_naming_the_line():
    def f(w, x):
        return jnp.sum(lax.while_loop(lambda h: jnp.sum(h) < 10, lambda h: h * w + 1, x))

    g = jg.trace(f, np.float32(1.5), X, param_argnums=0)
    with pytest.raises(jg.TransformError, match=r"'while': a loop with a data-dependent trip "
                                                r"count .* at .*test_control_flow.py:\d+"):
        jg.backward(g)


def test_while_off_the_gradient_path_is_fine():
    def f(w, x):
        n = lax.while_loop(lambda i: i < jnp.int32(7), lambda i: i + 2, jnp.int32(0))
        return jnp.sum(jnp.sin(x * w)) * n

    value, grad = jg.compile(joint(f, np.float32(1.5), X))(np.float32(1.5), X)
    np.testing.assert_allclose(grad, jax.grad(f)(np.float32(1.5), X), rtol=1e-6)


def test_check_names_a_broken_body():
    g = jg.trace(scan_tanh, WS, X)
    scan = g.eqns[0]
    body = scan.params["body"]
    broken = dataclasses.replace(scan, params={**scan.params,
                                               "body": body.replace(eqns=body.eqns[1:])})
    with pytest.raises(jg.GraphError, match=r"eqn 0 `.* = scan\[.*in its body: eqn 0 .* is used "
                                            r"before it is defined"):
        jg.check(g.replace(eqns=(broken,) + g.eqns[1:]))
    g = jg.trace(lambda ws, x: jnp.sum(lax.scan(lambda h, w: (h @ w, None), x, ws)[0]), WS, X)
    scan = g.eqns[0]
    lying = dataclasses.replace(scan, params={**scan.params, "length": 5})
    with pytest.raises(jg.GraphError, match=r"scan of length 5 over xs \['f32\[4,3,3\]'\]"):
        jg.check(g.replace(eqns=(lying,) + g.eqns[1:]))


def test_to_jax_differentiates_loops_with_jgraph_rules():
    g = jg.trace(cond_in_scan, WS, X)
    np.testing.assert_allclose(jax.grad(jg.to_jax(g))(WS, X), jax.grad(cond_in_scan)(WS, X),
                               rtol=1e-5, atol=1e-6)


def test_optimizer_trains_a_scanned_model_as_optax():
    def model(p, x):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["ws"])
        return h @ p["head"]

    params = {"ws": WS, "head": RNG.standard_normal((3, 2)).astype(np.float32)}
    xs = RNG.standard_normal((3, 8, 3)).astype(np.float32)
    tx = optax.adam(1e-2)
    opt = jg.Optimizer(model, tx, loss="mean", period=1)
    state = opt.init(params, xs[0])
    want, opt_state = params, tx.init(params)
    for x in xs:
        state, _ = opt.step(state, x)
        grads = jax.grad(lambda p: jnp.mean(model(p, x)))(want)
        updates, opt_state = tx.update(grads, opt_state, want)
        want = optax.apply_updates(want, updates)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prevent_cse", [True, False])
def test_recomputed_dots_inside_the_backward_loop_survive_xla(prevent_cse):
    ws, x = WS.repeat(3, 1).repeat(3, 2), np.ones((2, 9), np.float32)
    layer = lambda h, w: (jnp.tanh(jnp.sin(h @ w) @ w), None)
    plain = lambda ws, x: jnp.sum(lax.scan(layer, x, ws)[0])
    ck = lambda ws, x: jnp.sum(lax.scan(jax.checkpoint(layer, prevent_cse=prevent_cse), x, ws)[0])
    base = jg.compiled_memory(joint(plain, ws, x), ws, x).dots
    assert jg.compiled_memory(joint(ck, ws, x), ws, x).dots == base + 2  # the layer's two dots
    assert base + 2 == jax.jit(jax.grad(ck)).lower(ws, x).compile().as_text().count(" dot(")
