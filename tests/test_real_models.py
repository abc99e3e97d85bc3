"""Models from flax (linen, nnx), haiku and equinox, written as their users write them.

One row per model (`tests/real_models.py`) and one test per stage, so the pytest ids are the
report table: `test_trace[model]`, `test_check[model]`, `test_grads[model]`, `test_remat[model]`,
`test_optimizer[model]`. References: `jax.eval_shape` of the function, `jax.value_and_grad`
(<= 1e-5 relative, float32), the un-rematerialized graph (the same ops on the same values, and
compiled to 1e-6), and a hand-written optax loop.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg
from tests.real_models import MODELS

BY_NAME = {m.name: m for m in MODELS}
ROWS = pytest.mark.parametrize("name", list(BY_NAME))


@functools.cache
def forward(name):
    model = BY_NAME[name]
    fn, args = model.built
    return jg.trace(fn, *args, param_argnums=0, has_aux=model.has_aux)


@functools.cache
def joint(name):
    return jg.backward(forward(name))


@functools.cache
def compiled_joint(name):
    return jg.compile(joint(name))(*BY_NAME[name].built[1])


@functools.cache
def value_and_grad(name):
    """`jax.value_and_grad` of the model's loss, jitted (and compiled once for the file)."""
    model = BY_NAME[name]
    return jax.jit(jax.value_and_grad(model.built[0], has_aux=model.has_aux))


@functools.cache
def reference(name):
    return value_and_grad(name)(*BY_NAME[name].built[1])


def as_numpy(x):
    """`x` as a numpy array; a PRNG key array as its key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def assert_close(got, want, rtol=1e-5):
    """Leaf by leaf, the largest error within `rtol` of the leaf's largest magnitude, or of 1% of
    the whole tree's for a leaf that is nearly zero: the gradient of an attention key bias is
    analytically zero, so both sides hold rounding noise there."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    floor = 0.01 * max((float(np.max(np.abs(as_numpy(b)), initial=0.0))
                        for b in jax.tree.leaves(want) if jnp.issubdtype(b.dtype, jnp.inexact)),
                       default=0.0)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):
        a, b = as_numpy(a), as_numpy(b)
        assert a.shape == b.shape and a.dtype == b.dtype, jax.tree_util.keystr(path)
        if np.issubdtype(a.dtype, np.inexact):
            scale = max(float(np.max(np.abs(b), initial=0.0)), floor, 1e-30)
            error = float(np.max(np.abs(a - b), initial=0.0))
            assert error <= rtol * scale, f"{jax.tree_util.keystr(path)}: {error} vs {scale}"
        else:
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def as_f64(tree):
    return jax.tree.map(lambda a: a.astype(np.float64) if jnp.issubdtype(a.dtype, jnp.floating)
                        else a, tree)


def value_numbers(graph):
    """Each output of `graph` as a number naming the expression that computes it from the
    inputs: op, params and the numbers of its operands. Two graphs whose outputs get the same
    numbers compute them with the same ops on the same values, so bit for bit the same."""
    numbers, env = {}, {v: ("input", k) for k, v in enumerate(graph.inputs)}

    def number(key):
        return numbers.setdefault(key, len(numbers))

    def read(a):
        if isinstance(a, jg.Var):
            return env[a]
        value = np.asarray(a.value)
        return number(("literal", value.dtype.str, value.shape, value.tobytes()))

    for eqn in graph.eqns:
        params = tuple(sorted((k, _hashable(v)) for k, v in eqn.params.items()))
        inputs = tuple(read(a) for a in eqn.inputs)
        for k, v in enumerate(eqn.outputs):
            env[v] = number((eqn.op, params, inputs, k))
    return [read(a) for a in graph.outputs]


def _hashable(value):
    try:
        hash(value)
        return value
    except TypeError:  # arrays, sub-graph lists: the same object in an eqn and its copies
        return ("object", id(value))


@ROWS
def test_trace(name):
    """The traced graph has the function's signature: a loss, and the aux's avals."""
    model = BY_NAME[name]
    fn, args = model.built
    g = forward(name)
    assert g.output_roles[0] == "loss"
    want = jax.eval_shape(fn, *args)
    got = jax.tree.unflatten(g.out_tree, [v.aval for v in g.outputs])
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)


@ROWS
def test_check(name):
    """`jg.check` accepts the forward and the joint graph, with x64 off (JAX's default) and on
    (the model traced in float64)."""
    jg.check(forward(name))
    jg.check(joint(name))
    model = BY_NAME[name]
    fn, args = model.built
    with jax.enable_x64(True):
        g = jg.trace(fn, *as_f64(args), param_argnums=0, has_aux=model.has_aux)
        jg.check(g)
        jg.check(jg.backward(g))


@ROWS
def test_grads(name):
    """`jg.backward`, compiled, equals `jax.value_and_grad` (with the aux, if the model has one)."""
    assert_close(compiled_joint(name), reference(name))


@ROWS
def test_remat(name):
    """Recorded regions, a policy and a budget: each plan checks and computes every output with
    the ops of no remat on the same values (bit for bit); compiled, a plan agrees with the
    compiled joint graph (XLA:CPU may fuse a reduction of a recomputed value differently, and
    round it differently, so not bitwise)."""
    args = BY_NAME[name].built[1]
    gb = joint(name)
    # A budget is on the compiled step's temp; these models are too small for remat to lower it
    # much (tests/test_planner.py plans them under budgets, in the slow suite): all of it.
    plans = {"regions": jg.remat(gb),
             "dots_saveable": jg.remat(gb, policy=jg.policies.dots_saveable),
             "budget": jg.remat(gb, budget="100%")}
    want = value_numbers(gb)
    loops = any(e.op in ("scan", "cond", "while") for e in gb.eqns)
    for label, gr in plans.items():
        jg.check(gr)
        if loops:  # a policy re-derives the loops' bodies: compare values, op by op
            assert_close(jg.evaluate(gr, *args), jg.evaluate(gb, *args), rtol=0)
        else:
            assert value_numbers(gr) == want, label
    assert plans["budget"].info["remat"]["plan"] == "no remat"
    assert_close(jg.compile(plans["dots_saveable"])(*args), compiled_joint(name), rtol=1e-6)


STEPS = 5
# Adam moves each element by about lr * g / (|g| + eps): an element whose gradient is rounding
# noise (an attention key bias, whose gradient is analytically zero) makes a whole step, in a
# direction that differs between any two programs, with optax's eps=1e-8. With eps=1e-3 an update
# moves by at most lr / eps = 10 times the gradient's rounding error, so the runs can be compared.
TX = optax.adamw(1e-2, eps=1e-3, weight_decay=1e-2)


@jax.jit
def optax_update(grads, opt_state, params):
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@ROWS
def test_optimizer(name):
    """Five `jg.Optimizer` steps with adamw equal five steps of a hand-written optax loop."""
    model = BY_NAME[name]
    fn, (params, *rest) = model.built

    def loss(params, inputs):  # mutable state (BatchNorm statistics) stays as it was given
        value = fn(params, *inputs)
        return value[0] if model.has_aux else value

    opt = jg.Optimizer(loss, TX, loss="sum")
    state = opt.init(params, tuple(rest))
    for _ in range(STEPS):
        state, _ = opt.step(state, tuple(rest))

    want, opt_state = params, TX.init(params)
    for _ in range(STEPS):
        _, grads = value_and_grad(name)(want, *rest)
        want, opt_state = optax_update(grads, opt_state, want)
    assert_close(state.params, want, rtol=1e-5)
