"""Every failure the random-graph properties found, kept as an explicit regression test.

Each test is the shrunk counterexample written as a plain program, checked against an independent
reference. Tests of bugs in modules being rewritten elsewhere are marked `xfail(strict=True)` with
the cause, so that they flip when the fix lands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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
