"""Properties of the training transforms over random graphs (`jg.testing.graphs()`):

- `accumulate` over k micro-batches equals the full batch: the drawn graph is the per-example
  loss, vmapped over a batch of examples and reduced by mean or sum, traced at the micro-batch
  size; k micro-steps of the accumulate graph give the loss and gradient `jax.value_and_grad`
  gives on the whole batch;
- `reset` gives the state `tx.init` gives (and zero accumulators, counter 0);
- `optimizer_step` equals optax applied by hand to the grads of the backward graph.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from properties import (
    argnums,
    assert_bitwise,
    assert_close,
    examples,
    jitted,
    params_of,
    tolerance,
)

import jgraph as jg
from jgraph.testing.build import example_args, to_graph

BATCH = 4
OPTIMIZERS = {"sgd": optax.sgd(0.1), "momentum": optax.sgd(0.1, momentum=0.9),
              "adam": optax.adam(1e-2), "adamw": optax.adamw(1e-2, weight_decay=1e-3),
              "clipped_adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
              "rmsprop": optax.rmsprop(1e-2)}


def _batched(g, reduce, size):
    """`loss(*args)` of the graph's arguments with a leading batch axis of `size` on every data
    argument: the per-example losses of `g`, vmapped, reduced by `reduce` (a graph with no data
    argument has `size` identical examples)."""
    params = argnums(g)
    axes = tuple(None if i in params else 0 for i in range(len(g.in_tree.children())))

    def one(*a):
        out = jg.evaluate(g, *a)
        return out[0] if g.has_aux else out

    return lambda *args: reduce(jax.vmap(one, in_axes=axes, axis_size=size)(*args))


def _batch_of_examples(recipe, g):
    """Arguments with BATCH examples stacked on every data argument (params as drawn)."""
    per_example = [example_args(recipe, seed=recipe.seed + b) for b in range(BATCH)]
    return tuple(per_example[0][i] if i in argnums(g) else
                 jax.tree.map(lambda *xs: np.stack(xs), *(ex[i] for ex in per_example))
                 for i in range(len(per_example[0])))


def _micro_batch(args, g, k, m):
    return tuple(a if i in argnums(g) else jax.tree.map(lambda x: x[k * m:(k + 1) * m], a)
                 for i, a in enumerate(args))


PERIODS_AND_LOSSES = (st.sampled_from([1, 2, 4]), st.sampled_from(["mean", "sum"]))


def _accumulate_equals_the_full_batch(recipe, period, loss):
    g = to_graph(recipe)
    reduce = jnp.mean if loss == "mean" else jnp.sum
    batch = _batch_of_examples(recipe, g)
    full = jax.value_and_grad(_batched(g, reduce, BATCH), argnums=g.param_argnums)
    want_value, want_grads = jitted(full, *batch)(*batch)
    m = BATCH // period
    micro = _micro_batch(batch, g, 0, m)
    traced = jg.trace(_batched(g, reduce, m), *micro, param_argnums=g.param_argnums)
    ga = jg.accumulate(jg.backward(traced), period, loss)
    step = jg.compile(ga)
    accs = jax.tree.map(jnp.zeros_like, params_of(g, batch))
    counter, value = np.int32(0), 0.0
    for k in range(period):
        v, accs, counter = step(*_micro_batch(batch, g, k, m), accs, counter)
        value = value + v
    assert int(counter) == 0
    tol = 5 * tolerance(g.inputs[0].aval.dtype)
    assert_close(value, want_value, tol)
    assert_close(accs, want_grads, tol)


@examples(5)
@given(jg.testing.recipes(aux=False), *PERIODS_AND_LOSSES)
def test_accumulate_over_k_micro_batches_equals_the_full_batch(recipe, period, loss):
    _accumulate_equals_the_full_batch(recipe, period, loss)


@pytest.mark.f64  # the float32 test's check in float64: a few examples in the ci run
@examples(2)
@given(jg.testing.recipes(aux=False), *PERIODS_AND_LOSSES)
def test_accumulate_over_k_micro_batches_equals_the_full_batch_f64(recipe, period, loss):
    _accumulate_equals_the_full_batch(recipe, period, loss)


def _state_graphs(g, tx, period):
    gb = jg.backward(g)
    ga = jg.accumulate(gb, period, "mean") if period else gb
    return ga, jg.optimizer_step(ga, tx)


STATES = (st.sampled_from(sorted(OPTIMIZERS)), st.sampled_from([None, 1, 3]))


def _reset_gives_the_state_init_gives(drawn, name, period):
    g, args = drawn
    tx = OPTIMIZERS[name]
    ga, go = _state_graphs(g, tx, period)
    params = params_of(g, args)
    got = jg.evaluate(jg.reset(go), params)
    assert_bitwise(got["opt_state"], tx.init(params))
    if period:
        assert_bitwise(got["grad_acc"], jax.tree.map(jnp.zeros_like, params))
        assert_bitwise(got["counter"], jnp.int32(0))
        assert_bitwise(jg.evaluate(jg.reset(ga), params),
                       {"counter": jnp.int32(0), "grad_acc": got["grad_acc"]})


@examples(10)
@given(jg.testing.graphs(), *STATES)
def test_reset_gives_the_state_init_gives(drawn, name, period):
    _reset_gives_the_state_init_gives(drawn, name, period)


@pytest.mark.f64  # the float32 test's check in float64: a few examples in the ci run
@examples(3)
@given(jg.testing.graphs(), *STATES)
def test_reset_gives_the_state_init_gives_f64(drawn, name, period):
    _reset_gives_the_state_init_gives(drawn, name, period)


def _optimizer_step_is_optax(drawn, name):
    g, args = drawn
    tx = OPTIMIZERS[name]
    gb = jg.backward(g)
    go = jg.optimizer_step(gb, tx)
    params = params_of(g, args)
    state = tx.init(params)
    value, grads, new_params, new_state = jg.evaluate(go, *args, state)
    want_value, want_grads = jg.evaluate(gb, *args)
    updates, want_state = tx.update(want_grads, state, params)
    assert_bitwise((value, grads), (want_value, want_grads))
    tol = tolerance(g.inputs[0].aval.dtype)
    assert_close(new_params, optax.apply_updates(params, updates), tol)
    assert_close(new_state, want_state, tol)


@examples(8)
@given(jg.testing.graphs(), st.sampled_from(sorted(OPTIMIZERS)))
def test_optimizer_step_equals_optax_by_hand(drawn, name):
    _optimizer_step_is_optax(drawn, name)


@pytest.mark.f64
@examples(3)
@given(jg.testing.graphs(), st.sampled_from(sorted(OPTIMIZERS)))
def test_optimizer_step_equals_optax_by_hand_f64(drawn, name):
    _optimizer_step_is_optax(drawn, name)
