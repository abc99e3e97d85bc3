"""`jg.value_and_grad` / `jg.grad`: JAX's results, structures and errors; one trace per signature;
`.graph(*args)`; remat of `jax.checkpoint` regions, `policy=` and `budget=`.

References: `jax.value_and_grad` / `jax.grad` on the same function and arguments. Errors are
compared with JAX's: the same condition raises the same builtin type (TypeError, ValueError),
and jgraph's error is also a `jg.JGraphError` whose message names the argument.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgraph as jg
from jgraph.dropin import transform as dropin_vg

f32 = jnp.float32


def assert_trees_close(got, want, rtol=1e-6, atol=1e-6):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.shape(a) == np.shape(b) and jnp.result_type(a) == jnp.result_type(b), (a, b)
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=rtol, atol=atol)


class Dense(NamedTuple):
    w: jax.Array
    b: jax.Array


def tree_loss(params, batch, scale):
    h = jnp.tanh(batch["x"] @ params["dense"].w + params["dense"].b)
    h = h * params["gains"][0] + params["gains"][1]
    return jnp.mean((h - batch["y"]) ** 2) * scale


def tree_args():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"dense": Dense(jax.random.normal(k[0], (3, 4), f32), jnp.arange(4, dtype=f32)),
              "gains": [jnp.full((4,), 1.5, f32), jax.random.normal(k[1], (4,), f32)]}
    batch = {"x": jax.random.normal(k[2], (5, 3), f32), "y": jax.random.normal(k[3], (5, 4), f32)}
    return params, batch, f32(0.5)


# -- results and structures, as JAX's -------------------------------------------------------------
@pytest.mark.parametrize("argnums", [0, 1, 2, -1, (0,), (0, 2), (2, 0), (1, 0, 2)])
def test_value_and_grad_matches_jax(argnums):
    args = tree_args()
    got = jg.value_and_grad(tree_loss, argnums)(*args)
    assert_trees_close(got, jax.value_and_grad(tree_loss, argnums)(*args))
    assert_trees_close(jg.grad(tree_loss, argnums)(*args), jax.grad(tree_loss, argnums)(*args))


def aux_loss(p, x):
    y = jnp.sin(x @ p["w"])
    return jnp.sum(y ** 2), {"y": y, "count": 3, "tag": "train", "mean": [jnp.mean(y)]}


def test_has_aux_returns_aux_as_jax_does():
    p, x = {"w": jnp.ones((3, 2), f32) * 0.3}, jnp.arange(6, dtype=f32).reshape(2, 3)
    (loss, aux), grads = jg.value_and_grad(aux_loss, has_aux=True)(p, x)
    (jloss, jaux), jgrads = jax.value_and_grad(aux_loss, has_aux=True)(p, x)
    assert_trees_close((loss, grads), (jloss, jgrads))
    assert aux["count"] == 3 and aux["tag"] == "train"  # not traced: returned as they are
    assert_trees_close((aux["y"], aux["mean"]), (jaux["y"], jaux["mean"]))
    g, aux2 = jg.grad(aux_loss, has_aux=True)(p, x)
    assert_trees_close(g, jgrads)
    assert aux2["tag"] == "train"
    # A list (loss, aux) pair is read as JAX reads it: value is a tuple.
    value, _ = jg.value_and_grad(lambda p, x: list(aux_loss(p, x)), has_aux=True)(p, x)
    assert isinstance(value, tuple)


def test_keyword_and_static_arguments():
    def loss(p, x, n_layers, *, act="tanh", scale=1.0, bias=None):
        fn = {"tanh": jnp.tanh, "sin": jnp.sin}[act]
        for _ in range(n_layers):  # Python control flow on a static argument, as JAX allows
            x = fn(x @ p)
        return jnp.sum(x) * scale + (0.0 if bias is None else jnp.sum(bias))

    p, x = jnp.eye(3, dtype=f32) * 0.7, jnp.ones((2, 3), f32)
    for kwargs in ({}, {"act": "sin", "scale": 2.0}, {"bias": jnp.ones(3, f32)}):
        assert_trees_close(jg.value_and_grad(loss)(p, x, 3, **kwargs),
                           jax.value_and_grad(loss)(p, x, 3, **kwargs))


def test_python_scalars_and_weak_types():
    f = lambda x, y: jnp.sin(x) * y ** 2
    assert_trees_close(jg.grad(f, (0, 1))(1.5, 2.0), jax.grad(f, (0, 1))(1.5, 2.0))
    assert_trees_close(jg.grad(f)(jnp.float16(1.5), 2), jax.grad(f)(jnp.float16(1.5), 2))


def test_allow_int_gives_float0_zeros_as_jax():
    def loss(p, n):
        return jnp.sum(p["w"] * p["k"]) + n.astype(f32)

    p, n = {"w": jnp.ones(3, f32), "k": jnp.arange(3)}, jnp.int32(4)
    got = jg.value_and_grad(loss, (0, 1), allow_int=True)(p, n)
    want = jax.value_and_grad(loss, (0, 1), allow_int=True)(p, n)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert got[1][0]["k"].dtype == want[1][0]["k"].dtype == jax.dtypes.float0
    assert got[1][1].shape == want[1][1].shape == ()
    np.testing.assert_array_equal(got[1][0]["w"], want[1][0]["w"])


def test_nothing_to_differentiate():
    f = lambda p, n: jnp.sum(n).astype(f32) * 2.0 + sum(jnp.sum(v) for v in p.values())
    for args, argnums in [(({}, jnp.arange(3)), 0), (({}, jnp.arange(3)), (0, 1))]:
        got = jg.value_and_grad(f, argnums, allow_int=True)(*args)
        want = jax.value_and_grad(f, argnums, allow_int=True)(*args)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        assert_trees_close(got[0], want[0])
    assert jg.filter_grad(lambda m, x: jnp.sum(x) * m[1])((jnp.arange(2), 2), X3) == (None, None)


# -- errors: where JAX raises, the same type ------------------------------------------------------
X3 = jnp.ones(3, f32)
ERRORS = {  # name -> (call taking the transform, text jgraph's message contains)
    "integer input": (lambda vg: vg(lambda x: jnp.sum(x))(jnp.arange(3)), "args[0]"),
    "integer leaf in a tree": (
        lambda vg: vg(lambda p: jnp.sum(p["w"]))({"w": X3, "n": jnp.int32(2)}), "args[0]['n']"),
    "python int input": (lambda vg: vg(lambda x: x * 2.0)(3), "args[0]"),
    "boolean input": (lambda vg: vg(lambda x: jnp.sum(x))(jnp.ones(3, bool)), "bool"),
    "key input": (lambda vg: vg(lambda k: 1.0)(jax.random.key(0)), "key"),
    "string leaf": (lambda vg: vg(lambda p: jnp.sum(p["w"]))({"w": X3, "name": "a"}),
                    "args[0]['name']"),
    "function leaf": (lambda vg: vg(lambda p: jnp.sum(p[0]))((X3, jnp.tanh)), "args[0][1]"),
    "vector output": (lambda vg: vg(lambda x: x * 2)(X3), "f32[3]"),
    "integer output": (lambda vg: vg(lambda x: jnp.sum(x).astype(jnp.int32))(X3), "i32[]"),
    "complex output": (lambda vg: vg(lambda x: jnp.sum(x) * 1j)(X3), "c64[]"),
    "list output": (lambda vg: vg(lambda x: [jnp.sum(x)])(X3), "list"),
    "aux not a pair": (lambda vg: vg(lambda x: jnp.sum(x), has_aux=True)(X3), "has_aux"),
    "aux triple": (lambda vg: vg(lambda x: (jnp.sum(x),) * 3, has_aux=True)(X3), "pair"),
    "argnums past the arguments": (lambda vg: vg(lambda x, y: jnp.sum(x), 2)(X3, X3), "argnums"),
    "negative argnums out of range": (lambda vg: vg(lambda x: jnp.sum(x), -2)(X3), "argnums"),
    "argnums not an int": (lambda vg: vg(lambda x: jnp.sum(x), 1.5)(X3), "argnums"),
    "not callable": (lambda vg: vg(3)(X3), "callable"),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_are_jaxs(name):
    call, text = ERRORS[name]
    with pytest.raises(Exception) as jax_error:
        call(jax.value_and_grad)
    with pytest.raises(jg.JGraphError, match=None) as ours:
        call(jg.value_and_grad)
    builtin = next(t for t in (TypeError, ValueError) if isinstance(jax_error.value, t))
    assert isinstance(ours.value, builtin), (jax_error.value, ours.value)
    assert text in str(ours.value), str(ours.value)


def test_unsupported_options_are_clear_errors():
    with pytest.raises(jg.TransformError, match="holomorphic"):
        jg.value_and_grad(jnp.sin, holomorphic=True)
    with pytest.raises(jg.TransformError, match="holomorphic"):
        jg.grad(jnp.sin, holomorphic=True)
    with pytest.raises(jg.TransformError, match="reduce_axes"):
        jg.grad(jnp.sin, reduce_axes=("batch",))


def test_loss_error_raised_inside_jit_too():
    with pytest.raises(TypeError, match="scalar"):
        jax.jit(jg.grad(lambda x: x * 2))(X3)


# -- one trace per abstract signature -------------------------------------------------------------
def test_one_trace_per_signature():
    calls = []

    def reference(p, x, mode):
        w = p["w"] if isinstance(p, dict) else p
        return jnp.sum(jnp.tanh(x @ w)) * (2.0 if mode == "double" else 1.0)

    def loss(p, x, mode):
        calls.append(1)
        return reference(p, x, mode)

    vg = jg.value_and_grad(loss)
    p, x = jnp.ones((3, 2), f32), jnp.ones((4, 3), f32)
    vg(p, x, "single")
    vg(p, x * 2, "single")  # new values, same signature
    vg(p, x + 1, "single")  # the jitted path from the second eager call on
    assert len(calls) == 1
    jax.jit(vg, static_argnums=2)(p, x, "single")  # tracers with the same avals
    assert len(calls) == 1
    expected = 1
    for changed in [(p, jnp.ones((5, 3), f32), "single"),  # shape
                    (p, jnp.ones((4, 3), jnp.float16), "single"),  # dtype
                    (p.astype(jnp.float16), x, "single"),  # param dtype
                    (p, x, "double"),  # static value
                    ({"w": p}, x, "single")]:  # tree structure
        got = vg(*changed)
        expected += 1
        assert len(calls) == expected
        vg(*changed)
        assert len(calls) == expected
        assert_trees_close(got, jax.value_and_grad(reference)(*changed), rtol=2e-3,
                           atol=2e-3)
    vg(1.0 * jnp.ones((3, 2)), x, "single")  # back to the first signature: cached
    assert len(calls) == expected


def test_weak_type_is_part_of_the_signature():
    calls = []
    vg = jg.grad(lambda x: calls.append(1) or jnp.sin(x) * x)
    assert_trees_close(vg(2.0), jax.grad(lambda x: jnp.sin(x) * x)(2.0))  # weak f32
    vg(3.0)
    assert len(calls) == 1
    assert_trees_close(vg(f32(2.0)), jax.grad(lambda x: jnp.sin(x) * x)(f32(2.0)))  # strong
    assert len(calls) == 2


def test_eager_first_call_and_jitted_later_calls_agree():
    args = tree_args()
    vg = jg.value_and_grad(tree_loss)
    want = jax.value_and_grad(tree_loss)(*args)
    for _ in range(3):
        assert_trees_close(vg(*args), want)


def test_loss_closing_over_the_callers_tracers():
    """The flax pattern: a loss defined inside the user's jit, reading its batch."""
    calls = []

    @jax.jit
    def step(params, batch, scale):
        def loss_fn(p):
            calls.append(1)
            return tree_loss(p, batch, scale)
        return jg.value_and_grad(loss_fn)(params)

    args = tree_args()
    assert_trees_close(step(*args), jax.value_and_grad(tree_loss)(*args))
    step(*args)
    assert len(calls) == 1  # traced with the step: the user's jit caches it


def test_jg_trace_names_closed_over_tracers():
    with pytest.raises(jg.TraceError, match="closes over 1 traced value"):
        jax.jit(lambda x: jg.trace(lambda p: jnp.sum(p * x), x) and 0.0)(X3)


def test_a_decorated_method_binds_self_as_jaxs_does():
    def model(transform):
        class Model:
            scale = 3.0

            @functools.partial(transform, argnums=1)
            def loss(self, x):
                return jnp.sum(jnp.sin(x)) * self.scale

        return Model()

    assert_trees_close(model(jg.grad).loss(X3), model(jax.grad).loss(X3))


# -- the graph a call runs ------------------------------------------------------------------------
def test_graph_is_the_joint_graph_a_call_runs():
    args = tree_args()
    vg = jg.value_and_grad(tree_loss)
    graph = vg.graph(*args)
    assert isinstance(graph, jg.Graph)
    jg.check(graph)
    text = str(graph)
    assert "@loss" in text and "@grad" in text and "tanh" in text
    assert jg.memory(graph).peak_bytes > 0
    assert_trees_close(jg.compile(graph)(*args), jax.value_and_grad(tree_loss)(*args))
    assert vg.graph(*args) is graph  # the cached one, which calls run


def test_graph_with_static_arguments_has_holes():
    def loss(p, x, act):
        return jnp.sum(act(x @ p))

    p, x = jnp.ones((3, 2), f32), jnp.ones((4, 3), f32)
    graph = jg.grad(loss).graph(p, x, jnp.tanh)
    assert graph.input_roles == ("param", "data")
    assert_trees_close(jg.compile(graph)(p, x, None)[1], jax.grad(loss)(p, x, jnp.tanh))


# -- remat: checkpoint regions, policy=, budget= --------------------------------------------------
def chain(ws, x):
    for w in ws:
        x = jax.checkpoint(lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w))(w, x)
    return jnp.sum(x ** 2)


def chain_args():
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    return [jax.random.normal(k, (16, 16), f32) * 0.25 for k in keys[:4]], \
        jax.random.normal(keys[4], (8, 16), f32)


def recomputed(graph):
    return sum("recompute" in e.tags for e in graph.eqns)


def test_checkpoint_regions_are_rematerialized():
    args = chain_args()
    vg = jg.value_and_grad(chain)
    assert recomputed(vg.graph(*args)) > 0
    assert_trees_close(vg(*args), jax.value_and_grad(chain)(*args), rtol=1e-5)
    assert_trees_close(jax.jit(vg)(*args), jax.value_and_grad(chain)(*args), rtol=1e-5)


def test_policy_and_budget_apply_remat():
    def plain(ws, x):
        for w in ws:
            x = jnp.tanh(jnp.tanh(x @ w) @ w)
        return jnp.sum(x ** 2)

    args = chain_args()
    want = jax.value_and_grad(plain)(*args)
    none = jg.value_and_grad(plain).graph(*args)
    assert recomputed(none) == 0
    vg = jg.value_and_grad(plain, policy=jg.policies.dots_saveable)
    assert recomputed(vg.graph(*args)) > 0
    assert_trees_close(vg(*args), want, rtol=1e-5)
    budget = jg.memory(none).peak_bytes * 3 // 4
    vg = jg.value_and_grad(plain, budget=budget)
    graph = vg.graph(*args)
    assert graph.info["remat"]["budget"] == budget
    assert jg.memory(graph).peak_bytes <= budget < jg.memory(none).peak_bytes
    assert_trees_close(vg(*args), want, rtol=1e-5)


def test_budget_is_passed_to_remat_unchanged(monkeypatch):
    seen = []
    monkeypatch.setattr(dropin_vg, "remat", lambda g, policy, budget, target: seen.append(
        (budget, target)) or g)
    args = chain_args()
    jg.grad(chain, budget="50%").graph(*args)
    jg.grad(chain, budget=1 << 20, target="cpu").graph(*args)
    assert seen == [("50%", None), (1 << 20, "cpu")]
