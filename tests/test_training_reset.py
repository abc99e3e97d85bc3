"""`jg.first_micro_step`: the micro-step graph specialised to the first micro-step of a period.

References: the general graph at counter 0 (bitwise), jax.value_and_grad and a plain optax update.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg
from jgraph.ir import Var

F32 = jnp.float32


def mlp_loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]) ** 2)


def make_params():
    kw, kv, kx = jax.random.split(jax.random.PRNGKey(1), 3)
    p = {"w": jax.random.normal(kw, (6, 5), F32), "b": jnp.full(5, 0.1, F32),
         "v": jax.random.normal(kv, (5, 3), F32)}
    return p, jax.random.normal(kx, (4, 6), F32)


def reads(graph, role):
    ins = set(graph.inputs_with_role(role))
    return [e for e in graph.eqns for a in e.inputs if isinstance(a, Var) and a in ins]


def flat_call(graph, *flat):
    return jax.jit(lambda *a: jg.Interpreter().run(graph, *a))(*flat)


@pytest.mark.parametrize("with_step", [False, True])
def test_first_micro_step_reads_no_accumulator_and_matches_counter_zero(with_step):
    p, x = make_params()
    period, tx = 4, optax.adam(1e-2)
    g = jg.accumulate(jg.backward(jg.trace(mlp_loss, p, x, param_argnums=0)), period, "mean")
    if with_step:
        g = jg.optimizer_step(g, tx)
    first = jg.check(jg.first_micro_step(g))
    assert reads(g, "accumulator") and reads(g, "counter")  # the general graph does read them
    assert reads(first, "accumulator") == [] and reads(first, "counter") == []
    assert first.inputs == g.inputs and first.output_roles == g.output_roles  # same signature

    # Garbage accumulators: at counter 0 the general graph ignores them, and so does `first`.
    leaves, tree = jax.tree.flatten(p)
    accs = [jnp.full(a.shape, 7.5, a.dtype) for a in leaves]
    state = jax.tree.leaves(tx.init(p)) if with_step else []
    args = [*leaves, x, *accs, jnp.int32(0), *state]
    want = flat_call(g, *args)
    got = flat_call(first, *args)
    for u, v in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))

    # And against independent references: grads / period, and one adam step on them.
    loss, grads = jax.jit(jax.value_and_grad(mlp_loss))(p, x)
    n = len(leaves)
    np.testing.assert_allclose(got[0], loss / period, rtol=1e-6)
    new_acc = jax.tree.unflatten(tree, got[1:1 + n])
    for u, v in zip(jax.tree.leaves(new_acc), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(u, v / period, rtol=1e-5, atol=1e-7)
    assert int(got[1 + n]) == 1  # the next micro-step
    if with_step:
        updates, _ = tx.update(new_acc, tx.init(p), p)
        ref = optax.apply_updates(p, updates)
        for u, v in zip(got[2 + n:2 + 2 * n], jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7)


def test_first_micro_step_of_period_one_writes_the_counter_back_to_zero():
    p, x = make_params()
    g = jg.accumulate(jg.backward(jg.trace(mlp_loss, p, x, param_argnums=0)), 1, "sum")
    first = jg.first_micro_step(g)
    assert reads(first, "accumulator") == []
    out = flat_call(first, *jax.tree.leaves(p), x, *[jnp.ones_like(a) for a in
                                                     jax.tree.leaves(p)], jnp.int32(0))
    assert int(out[-1]) == 0


def test_first_micro_step_needs_an_accumulating_graph():
    p, x = make_params()
    gb = jg.backward(jg.trace(mlp_loss, p, x, param_argnums=0))
    with pytest.raises(jg.TransformError, match="first_micro_step: .*accumulate"):
        jg.first_micro_step(gb)
