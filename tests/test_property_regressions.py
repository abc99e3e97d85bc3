"""Every failure the random-graph properties found, kept as an explicit regression test.

Each test is the shrunk counterexample written as a plain program, checked against an independent
reference. Tests of bugs in modules being rewritten elsewhere are marked `xfail(strict=True)` with
the cause, so that they flip when the fix lands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgraph as jg

F32 = np.float32


def test_remat_accepts_a_joint_graph_whose_backward_has_no_eqns():
    # loss = p: the gradient is the constant 1, so the backward emits no eqn; remat said
    # "apply jg.backward first" (it looked for eqns tagged backward, not for grad outputs).
    gb = jg.backward(jg.trace(lambda p: p, F32(0.5), param_argnums=0))
    assert not any("backward" in e.tags for e in gb.eqns)
    for gr in (jg.remat(gb), jg.remat(gb, policy=jg.policies.nothing_saveable),
               jg.remat(gb, budget=0)):
        jg.check(gr)
        assert [float(x) for x in jax.tree.leaves(jg.evaluate(gr, F32(0.5)))] == [0.5, 1.0]


def test_first_micro_step_does_not_fold_a_reduction_of_a_broadcast_constant():
    # sum(broadcast(tanh(p), (2,))): the backward sums a broadcast of the seed 1.0 (to 2.0).
    # first_micro_step knew the broadcast as "1.0 everywhere" and folded the sum as if it were
    # elementwise: a crash (axes out of range), and a wrong gradient had it not crashed.
    def f(p):
        return jnp.sum(jnp.broadcast_to(jnp.tanh(p), (2,)))

    p = F32(0.3)
    ga = jg.accumulate(jg.backward(jg.trace(f, p, param_argnums=0)), period=3, loss="sum")
    first = jg.check(jg.first_micro_step(ga))
    value, acc, counter = jg.evaluate(first, p, F32(7.0), np.int32(0))
    loss, grad = jax.value_and_grad(f)(p)
    np.testing.assert_allclose(value, loss, rtol=1e-6)
    np.testing.assert_allclose(acc, grad, rtol=1e-6)
    assert int(counter) == 1


def test_remat_with_a_policy_of_a_cond_whose_branch_recomputes_from_its_operands():
    # loss = sum(cond(x > 0, tanh, sin)(p)) under remat(policy=...): the branches' backward copied
    # the forward eqns it recomputes with their checkpoint region still on them, a region the
    # branch graph does not have (check: "refers to unknown checkpoint region 0").
    def f(p, x):
        return jnp.sum(jax.lax.cond(jnp.sum(x) > 0, jnp.tanh, jnp.sin, p))

    p, x = F32(0.7), F32(-0.2)
    gb = jg.backward(jg.trace(f, p, x, param_argnums=0))
    want = jax.value_and_grad(f)(p, x)
    for policy in (jg.policies.nothing_saveable, jg.policies.everything_saveable):
        gr = jg.check(jg.remat(gb, policy=policy))
        np.testing.assert_allclose(jg.evaluate(gr, p, x), want, rtol=1e-6)


def test_a_vmapped_while_loop_runs_each_example_its_own_number_of_times():
    # jax.vmap of a while_loop with a per-example trip count: the predicate is bool[B], which
    # check rejected ("cond_graph outputs: ['bool[4]'], expected ['bool[]']") and lax.while_loop
    # could not lower; the loop runs while any predicate holds and moves only those examples.
    def f(p, n):
        def one(k):
            return jax.lax.while_loop(lambda c: c[0] < k, lambda c: (c[0] + 1, c[1] * p),
                                      (0, jnp.float32(1.0)))[1]
        return jnp.sum(jax.vmap(one)(n))

    p, n = F32(1.5), np.array([0, 1, 3, 2], np.int32)
    g = jg.check(jg.trace(f, p, n))
    assert float(jg.evaluate(g, p, n)) == float(f(p, n)) == 1 + 1.5 + 1.5**3 + 1.5**2
    assert float(jg.compile(g)(p, n)) == float(f(p, n))


@pytest.mark.f64
def test_finite_differences_of_a_fast_oscillating_loss_need_a_small_step():
    # loss = v + sin(v), v = 32 * sum(tanh(w))**2 (about 146 here): jgraph's gradient was right
    # (equal to jax.grad), but central differences with the default step 1e-4 were 5e-5 off
    # (truncation error ~ eps**2 * f'''); the finite-difference property now uses eps=1e-6.
    def f(w):
        s = jnp.broadcast_to(jnp.sum(jnp.tanh(w)), (2,))
        v = jnp.dot(4 * s, 4 * s)
        return v + jnp.sin(v)

    w = np.array([1.0, 0.8, 0.9])
    g = jg.trace(f, w, param_argnums=0)
    _, grad = jg.evaluate(jg.backward(g), w)
    np.testing.assert_allclose(grad, jax.grad(f)(w), rtol=1e-12)
    jg.testing.check_grads(lambda x: jg.evaluate(g, x), (w,), order=2, eps=1e-6, rtol=1e-5,
                           atol=1e-5)
    with pytest.raises(AssertionError, match="central finite differences"):
        jg.testing.check_grads(lambda x: jg.evaluate(g, x), (w,), order=1, rtol=1e-5, atol=1e-5)


def test_builder_templates_are_not_shared_across_x64_settings():
    # A template (`Builder.call`'s cached trace of a JAX function) traced inside
    # `jax.enable_x64(True)` was reused outside it: jnp.sum of an int32 is int64 under x64, so the
    # graph built later compared an int64 with an int32 carry ("lax.lt requires arguments to have
    # the same dtypes"). The suite's f64 tests drew such a template first.
    from jgraph.builder import Builder
    from jgraph.ir import ShapedArray, Var

    def more(k, v):
        return (k < 4) & (jnp.sum(v) < 20)

    k, v = Var(ShapedArray((), np.int32)), Var(ShapedArray((3,), np.int32))
    with jax.enable_x64(True):
        b64 = Builder()
        b64.call(more, k, v)
    b32 = Builder()
    (out,) = b32.call(more, k, v)
    g = jg.check(jg.ir.Graph((k, v), tuple(b32.eqns), (out,), ("data", "data"), ("aux",)))
    assert {a.aval.dtype for e in b64.eqns for a in e.outputs} >= {np.dtype(np.int64)}
    assert all(a.aval.dtype != np.int64 for e in g.eqns for a in (*e.inputs, *e.outputs))
    assert bool(jg.evaluate(g, np.int32(1), np.arange(3, dtype=np.int32))) is True


def test_cse_of_a_remat_graph_keeps_recomputes_reading_merged_values():
    # Two equal forward eqns (tanh(p) twice), one read by a cond that remat keeps whole: CSE merges
    # the forward pair and renames the input of the recompute that read the second. The recompute
    # itself (no_cse) must stay, and the gradient stays bitwise (the property compared whole eqns).
    from jgraph.passes import cse

    def f(p):
        a, b = jnp.tanh(p), jnp.tanh(p)
        c = jnp.tanh(b)
        d = jax.lax.cond(jnp.sum(b) > 0, lambda u, v: jnp.tanh(u) * v, lambda u, v: jnp.sin(v) - u,
                         b, a)
        return jnp.sum(d + c)

    p = F32(0.7)
    gb = jg.backward(jg.trace(f, p, param_argnums=0))
    gr = jg.remat(gb, policy=jg.policies.nothing_saveable)
    merged = jg.check(cse(gr))
    recomputes = [(e.op, e.outputs) for e in gr.eqns if "no_cse" in e.tags]
    assert recomputes
    assert [(e.op, e.outputs) for e in merged.eqns if "no_cse" in e.tags] == recomputes
    want = jax.value_and_grad(f)(p)
    got = jg.evaluate(merged, p)
    np.testing.assert_array_equal(jax.tree.leaves(got), jax.tree.leaves(jg.evaluate(gb, p)))
    np.testing.assert_allclose(jax.tree.leaves(got), jax.tree.leaves(want), rtol=1e-6)


def test_check_grads_of_a_float32_program_whose_loop_reads_a_float_made_from_ints():
    # The README's finite-difference property drew (float32, x64 off) a scan over
    # `to_float(i + i, dtype=float32)` closing over a float param. check_grads runs programs on
    # float64 arguments, so the carry started float32 and came out float64: JAX refused the
    # scan. A program is generic in its float dtype: what it makes from ints follows its args.
    from jgraph.testing.build import Program
    from jgraph.testing.recipe import FLOAT, INT, Recipe, Slot, Step

    recipe = Recipe(
        arguments=(0, 1, 2),
        slots=(Slot((), FLOAT, 1.0), Slot((1,), FLOAT, 1.0), Slot((1,), INT, 4.0),
               Slot((1,), INT, 8.0), Slot((1,), FLOAT, 8.0), Slot((), FLOAT, 1.0),
               Slot((1,), FLOAT, 8.0)),
        steps=(Step("int_arith", (2, 2), (("c", 2), ("op", "add")), (3,)),
               Step("to_float", (3,), (("dtype", "float32"),), (4,)),
               Step("scan", (4, 0), (("remat", False), ("reverse", False)), (5, 6))),
        spans=(), loss_terms=(5,), aux=(), has_aux=False, param_argnums=(0, 1),
        dtype="float32", seed=1232)
    program = Program(recipe)
    args = (F32(0.3), np.array([0.2], F32), np.array([1], np.int32))
    assert program(*args).dtype == np.float32  # as drawn
    jg.testing.check_grads(program, args)  # float64 arguments: float64 throughout
