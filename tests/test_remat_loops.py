"""Remat around and inside loops does no more work than JAX's: JAX's own RematTest programs
(checkpoint_dots around / inside a `lax.scan` and a `lax.cond`, a remat'd function of a constant),
counted by op name in the joint graph against the count in JAX's backward jaxpr, with gradients
equal to `jax.value_and_grad`."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jgraph as jg
from jgraph.ir import sub_graphs

cp = jax.checkpoint_policies
HI = lax.Precision.HIGHEST
X = jnp.ones((5,))
W = jnp.linspace(-0.4, 0.6, 25, dtype=jnp.float32).reshape(5, 5)


def executed(graph, op, backward=False, in_backward=False):
    """Eqns of `op` the forward (backward=False) or the backward and its recompute runs,
    loop bodies included (everything inside a backward loop is backward)."""
    total = 0
    for e in graph.eqns:
        inner = in_backward or bool({"backward", "recompute"} & e.tags)
        total += e.op == op and inner == backward
        total += sum(executed(sub, op, backward, inner) for sub in sub_graphs(e))
    return total


def jax_backward_count(fn, w, op):
    """Eqns of `op` in JAX's backward (`make_jaxpr` of the vjp function, as RematTest counts)."""
    y, f_vjp = jax.vjp(fn, w)
    return str(jax.make_jaxpr(f_vjp)(y)).count(f" {op}")


def three_layers(w):
    def f(x):
        x = jnp.sin(jnp.dot(x, w, precision=HI))
        x = jnp.sin(jnp.dot(x, w, precision=HI))
        return jnp.sin(jnp.dot(x, w, precision=HI))

    return f


def dots_outside_scan(policy):
    @partial(jax.checkpoint, policy=policy)
    def f(w):
        layers = three_layers(w)
        return lax.scan(lambda x, _: (layers(x), None), X, None, length=2)[0]

    return f


def dots_inside_scan(policy):
    def f(w):
        layers = jax.checkpoint(three_layers(w), policy=policy)
        return lax.scan(lambda x, _: (layers(x), None), X, None, length=2)[0]

    return f


def dots_outside_cond(policy):
    @partial(jax.checkpoint, policy=policy)
    def f(w):
        return lax.cond(X.sum() > 0, three_layers(w), lambda x: x, X)

    return f


def dots_inside_cond(policy):
    def f(w):
        return lax.cond(X.sum() > 0, jax.checkpoint(three_layers(w), policy=policy),
                        lambda x: x, X)

    return f


PROGRAMS = [dots_outside_scan, dots_inside_scan, dots_outside_cond, dots_inside_cond]
# The counts JAX's RematTest asserts for checkpoint_dots (dot_general, sin, cos).
JAX_TEST_COUNTS = {"dots_outside_scan": (6, 3, 3), "dots_inside_scan": (6, 2, 3),
                   "dots_outside_cond": (5, 2, 3), "dots_inside_cond": (5, 2, 3)}


def rematerialized(fn):
    loss = lambda w: jnp.sum(fn(w))  # noqa: E731
    gb = jg.backward(jg.trace(loss, W, param_argnums=0))
    gr = jg.check(jg.remat(gb))
    got = jg.compile(gr)(W)
    want = jax.value_and_grad(loss)(W)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(jg.evaluate(gr, W)), jax.tree.leaves(jg.evaluate(gb, W)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    return gr


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.__name__)
def test_checkpoint_dots_around_and_inside_loops_matches_jax_counts(program):
    fn = program(cp.checkpoint_dots)
    gr = rematerialized(fn)
    want = JAX_TEST_COUNTS[program.__name__]
    assert tuple(jax_backward_count(fn, W, op) for op in ("dot_", "sin ", "cos ")) == want
    dots, sins, coss = (executed(gr, op, backward=True) for op in ("dot_general", "sin", "cos"))
    assert dots == want[0] and sins <= want[1] and coss == want[2], (dots, sins, coss)
    assert executed(gr, "dot_general") == 3  # the forward runs each dot once per iteration


SAVE_POLICIES = [cp.dots_with_no_batch_dims_saveable, cp.save_only_these_names("d"),
                 cp.save_any_names_but_these("s"),
                 jg.policies.save_anything_except_these_names("s")]


def named_layers(w):
    def f(x):
        for _ in range(3):
            x = jnp.sin(jax.ad_checkpoint.checkpoint_name(jnp.dot(x, w, precision=HI), "d"))
            x = jax.ad_checkpoint.checkpoint_name(x, "s")
        return x

    return f


@pytest.mark.parametrize("policy", SAVE_POLICIES, ids=lambda p: jg.policies.policy_name(p))
@pytest.mark.parametrize("where", ["scan", "cond"])
def test_other_save_policies_around_loops_recompute_no_saved_dot(policy, where):
    @partial(jax.checkpoint, policy=policy)
    def fn(w):
        layers = named_layers(w)
        if where == "cond":
            return lax.cond(X.sum() > 0, layers, lambda x: x, X)
        return lax.scan(lambda x, _: (layers(x), None), X, None, length=2)[0]

    gr = rematerialized(fn)
    jax_dots = jax_backward_count(fn, W, "dot_")
    assert executed(gr, "dot_general", backward=True) <= jax_dots
    assert executed(gr, "dot_general", backward=True) == (6 if where == "scan" else 5)


def test_nothing_saveable_around_a_scan_recomputes_it_whole():
    """A region that saves nothing inside the loop keeps only the loop's inputs: the forward
    scan is run again in the backward (JAX's behaviour too)."""
    fn = dots_outside_scan(cp.nothing_saveable)
    gr = rematerialized(fn)
    assert executed(gr, "dot_general", backward=True) == 3 + 6
    assert executed(gr, "dot_general", backward=True) <= jax_backward_count(fn, W, "dot_")


@pytest.mark.parametrize("remat", [jax.checkpoint, partial(jax.checkpoint,
                                                           policy=lambda *_, **__: False)])
def test_a_constant_inside_a_region_is_computed_once(remat):
    """RematTest.test_remat_no_redundant_flops: sin(2.) of a constant runs once, not again in
    the backward."""
    f = remat(lambda x, y: jnp.sin(x) * y)

    def g(y):
        return f(2.0, y)

    gr = jg.remat(jg.backward(jg.trace(g, 3.0, param_argnums=0)))
    assert sum(e.op == "sin" for e in gr.eqns) == 1
    np.testing.assert_allclose(jg.compile(gr)(3.0), jax.value_and_grad(g)(3.0), rtol=1e-6)


def test_a_constant_fill_inside_a_region_is_regenerated_not_kept():
    """A broadcast of a literal grows it: regenerating it is free, keeping it costs memory."""
    f = jax.checkpoint(lambda y: jnp.sin(y * jnp.full((64, 64), 2.0)))

    def g(y):
        return jnp.sum(f(y))

    y = jnp.ones((64, 64))
    gr = jg.remat(jg.backward(jg.trace(g, y, param_argnums=0)))
    assert sum(e.op == "broadcast_in_dim" and "recompute" in e.tags for e in gr.eqns) == 1


def test_loop_invariant_values_are_hoisted_out_of_the_scan():
    """A value a scan body computes from consts and literals alone (tanh(w), sin(2.)) is
    computed once before the loop, not per iteration in the forward and again per iteration
    in the backward; JAX hoists loop-invariant residuals alike."""
    def h(w, x):
        def body(c, _):
            return jnp.tanh(w) @ c * jnp.sin(2.0), None

        return jnp.sum(lax.scan(body, x, None, length=4)[0])

    x = jnp.ones((5,))
    gb = jg.backward(jg.trace(h, W, x, param_argnums=0))
    assert executed(gb, "tanh") == 1 and executed(gb, "sin") == 1
    assert executed(gb, "tanh", backward=True) == 0 and executed(gb, "sin", backward=True) == 0
    scan = next(e for e in gb.eqns if e.op == "scan" and "backward" not in e.tags)
    assert not {"tanh", "sin"} & {e.op for e in scan.params["body"].eqns}
    got, want = jg.compile(gb)(W, x), jax.value_and_grad(h)(W, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_remat_of_cond_recomputes_only_what_the_backward_reads():
    """RematTest.test_remat_of_cond: a cond whose branches return sin(c) twice recomputes no
    sin; with sin(sin(c)) it recomputes one."""
    def f1(x):
        return jnp.sum(jnp.stack(jax.checkpoint(lambda x: lax.cond(
            x > 0.0, lambda c: (jnp.sin(c), jnp.sin(c)), lambda c: (jnp.sin(c), jnp.sin(c)),
            x))(x)))

    def f2(x):
        return jax.checkpoint(lambda x: lax.cond(x > 0.0, lambda c: jnp.sin(jnp.sin(c)),
                                                 lambda c: c, x))(x)

    for f, want in ((f1, 0), (f2, 1)):
        gr = jg.remat(jg.backward(jg.trace(f, 3.0, param_argnums=0)))
        assert executed(gr, "sin", backward=True) == want
        np.testing.assert_allclose(jg.compile(gr)(3.0), jax.value_and_grad(f)(3.0), rtol=1e-6)
