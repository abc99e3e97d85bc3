"""`jg.trace`: pytrees, roles, and how each kind of JAX primitive is rewritten or refused."""

import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

import jgraph as jg

f32 = jnp.float32


def ops_of(graph):
    return [eqn.op for eqn in graph.eqns]


def assert_tree_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


# -- pytrees and roles ----------------------------------------------------------------------------
class Pair(NamedTuple):
    w: jax.Array
    b: jax.Array


def tree_fn(params, batch, scale):
    h = batch["x"] @ params["dense"].w + params["dense"].b
    h = h * params["gains"][0] + params["gains"][1]
    return {"loss": jnp.sum(h) * scale, "parts": (h, [jnp.max(h)])}


def tree_args():
    params = {"dense": Pair(jnp.ones((3, 2), f32), jnp.arange(2, dtype=f32)),
              "gains": [jnp.full((2,), 2.0, f32), jnp.ones((2,), f32)]}
    return params, {"x": jnp.arange(12, dtype=f32).reshape(4, 3)}, f32(0.5)


def test_pytrees_in_and_out():
    args = tree_args()
    g = jg.check(jg.trace(tree_fn, *args, param_argnums=0))
    assert g.in_tree == jax.tree.structure(args)
    assert g.out_tree == jax.tree.structure(tree_fn(*args))
    assert g.input_roles == ("param",) * 4 + ("data",) * 2
    assert g.output_roles == ("aux",) * 3  # a dict is not a scalar loss
    assert_tree_equal(jg.compile(g)(*args), jax.jit(tree_fn)(*args))
    assert_tree_equal(jg.evaluate(g, *args), tree_fn(*args))


@pytest.mark.parametrize("argnums, roles", [
    (None, ("data",) * 6),
    (0, ("param",) * 4 + ("data",) * 2),
    ((0, 2), ("param",) * 4 + ("data", "param")),
    (-1, ("data",) * 5 + ("param",)),
    ((1, -3), ("param",) * 5 + ("data",)),
])
def test_param_argnums(argnums, roles):
    g = jg.trace(tree_fn, *tree_args(), param_argnums=argnums)
    assert g.input_roles == roles and g.param_argnums == argnums


@pytest.mark.parametrize("argnums", [3, -4, (0, 5), "0"])
def test_param_argnums_out_of_range(argnums):
    with pytest.raises(jg.TraceError, match="param_argnums"):
        jg.trace(tree_fn, *tree_args(), param_argnums=argnums)


def aux_fn(w, x):
    y = x @ w
    return jnp.mean(y**2), {"pred": y, "count": jnp.sum(y > 0)}


def test_has_aux_roles_and_structure():
    args = (jnp.ones((3, 2), f32), jnp.ones((4, 3), f32))
    g = jg.check(jg.trace(aux_fn, *args, param_argnums=0, has_aux=True))
    assert g.has_aux and g.output_roles == ("loss", "aux", "aux")
    assert_tree_equal(jg.compile(g)(*args), jax.jit(aux_fn)(*args))


def test_has_aux_needs_a_pair():
    with pytest.raises(jg.TraceError, match=r"has_aux=True needs .*\(loss, aux\)"):
        jg.trace(lambda x: jnp.sum(x), jnp.ones(3, f32), has_aux=True)


def test_non_scalar_or_integer_result_is_not_a_loss():
    assert jg.trace(lambda x: x * 2, jnp.ones(3, f32)).output_roles == ("aux",)
    assert jg.trace(lambda x: jnp.sum(x), jnp.ones(3, jnp.int32)).output_roles == ("aux",)
    assert jg.trace(lambda x: (jnp.sum(x), x), jnp.ones(3, f32)).output_roles == ("aux", "aux")


def test_python_scalars_and_closed_over_constants():
    table = np.arange(3.0, dtype=np.float32)

    def f(x, s):
        return jnp.sum(x * table) * s

    g = jg.trace(f, jnp.ones(3, f32), 2.0)
    assert any(isinstance(a, jg.Literal) and a.aval.shape == (3,)
               for eqn in g.eqns for a in eqn.inputs)
    x = jnp.arange(3, dtype=f32)
    np.testing.assert_array_equal(jg.compile(g)(x, 3.0), jax.jit(f)(x, 3.0))
    np.testing.assert_array_equal(jg.evaluate(g, x, 3.0), f(x, 3.0))


# -- calls with the wrong signature ---------------------------------------------------------------
@pytest.mark.parametrize("run", [lambda g, *a: jg.compile(g)(*a), jg.evaluate],
                         ids=["compile", "evaluate"])
def test_arguments_must_match_the_traced_signature(run):
    params, batch, scale = tree_args()
    g = jg.trace(tree_fn, params, batch, scale, param_argnums=0)
    with pytest.raises(jg.JGraphError, match="do not match the traced signature"):
        run(g, params, {"x": batch["x"], "y": batch["x"]}, scale)
    with pytest.raises(jg.JGraphError, match=r"args\[1\]\['x'\] is f32\[5,3\] but the traced "
                                             r"signature has f32\[4,3\]"):
        run(g, params, {"x": jnp.ones((5, 3), f32)}, scale)
    with pytest.raises(jg.JGraphError, match=r"args\[2\] is i32\[\] .* has f32\[\]"):
        run(g, params, batch, jnp.int32(1))
    with pytest.raises(jg.JGraphError):
        run(g, params, batch)


def test_compiled_graph_composes_with_vmap():
    g = jg.trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((3, 2), f32), jnp.ones(3, f32))
    w, xs = jnp.full((3, 2), 0.1, f32), jnp.arange(12, dtype=f32).reshape(4, 3)
    got = jax.vmap(jg.compile(g), in_axes=(None, 0))(w, xs)
    np.testing.assert_allclose(got, jnp.sum(jnp.tanh(xs @ w), axis=1), rtol=1e-6)


# -- nested jit, custom_jvp, checkpoint, checkpoint_name ------------------------------------------
def test_nested_jit_is_inlined():
    inner = jax.jit(lambda x: jnp.sin(x) * 2.0)
    outer = jax.jit(lambda x: inner(inner(x)) + 1.0)
    g = jg.trace(lambda x: jnp.sum(outer(x)), jnp.ones(3, f32))
    assert ops_of(g) == ["sin", "mul", "sin", "mul", "add", "reduce_sum"]
    x = jnp.arange(3, dtype=f32)
    np.testing.assert_array_equal(jg.compile(g)(x), jnp.sum(outer(x)))


@jax.custom_jvp
def odd_sin(x):
    return jnp.sin(x)


odd_sin.defjvp(lambda primals, tangents: (odd_sin(primals[0]), 100.0 * tangents[0]))


def test_custom_jvp_is_its_primal_body_and_an_op_with_the_users_rule():
    g = jg.trace(lambda x: jnp.sum(odd_sin(jax.nn.relu(x))), jnp.ones(3, f32), param_argnums=0)
    assert ops_of(g) == ["max", "custom_jvp_call", "sin", "custom_jvp_call", "reduce_sum"]
    x = jnp.array([-1.0, 0.5, 2.0], f32)
    np.testing.assert_array_equal(jg.evaluate(g, x), jnp.sum(jnp.sin(jnp.maximum(x, 0.0))))
    grad = jg.compile(jg.backward(g))(x)[1]  # odd_sin's rule: 100 * t; relu'(x) = x > 0
    np.testing.assert_array_equal(grad, [0.0, 100.0, 100.0])
    np.testing.assert_array_equal(grad, jax.grad(lambda x: jnp.sum(odd_sin(jax.nn.relu(x))))(x))


def block(x):
    return jnp.tanh(x) * 3.0


def checkpointed(x):
    policy = jax.checkpoint_policies.dots_saveable

    def outer(y):
        y = jax.checkpoint(block)(y)
        return checkpoint_name(jnp.sin(y), "after_sin")

    y = jax.checkpoint(outer, policy=policy)(x)
    y = jax.checkpoint(block, prevent_cse=False)(y)
    return jnp.sum(jnp.exp(y))


def test_checkpoint_regions_are_recorded_nested_with_policy():
    g = jg.check(jg.trace(checkpointed, jnp.ones(4, f32)))
    outer, inner, last = g.regions
    assert (outer.id, outer.parent, outer.name) == (0, None, "outer")
    assert outer.policy is jax.checkpoint_policies.dots_saveable and outer.prevent_cse
    assert (inner.parent, inner.name, inner.policy) == (0, "block", None)
    assert (last.parent, last.name, last.prevent_cse) == (None, "block", False)
    assert [(e.op, e.regions) for e in g.eqns] == [
        ("tanh", (0, 1)), ("mul", (0, 1)), ("sin", (0,)), ("name", (0,)),
        ("tanh", (2,)), ("mul", (2,)), ("exp", ()), ("reduce_sum", ())]
    assert g.eqns[3].params == {"name": "after_sin"}
    assert "test_trace.py" in outer.source


def test_checkpoint_name_is_a_named_identity():
    g = jg.trace(lambda x: jnp.sum(checkpoint_name(x * 2.0, "twice")), jnp.ones(3, f32))
    (named,) = [e for e in g.eqns if e.op == "name"]
    assert named.params["name"] == "twice" and named.outputs[0].aval == named.inputs[0].aval
    x = jnp.arange(3, dtype=f32)
    np.testing.assert_array_equal(jg.compile(g)(x), jnp.sum(x * 2.0))


# -- scan, while, cond, RNG -----------------------------------------------------------------------
def scan_fn(ws, x, reverse=False):
    def step(h, w):
        h = jnp.tanh(h @ w)
        return h, jnp.sum(h)

    h, ys = jax.lax.scan(step, x, ws, reverse=reverse)
    return jnp.sum(h) + jnp.sum(ys * jnp.arange(ys.shape[0], dtype=ys.dtype))


def body_ops(eqn, key="body"):
    return [e.op for e in eqn.params[key].eqns]


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("length", [0, 1, 3])
def test_scan_is_an_op_with_its_body_as_a_graph(length, reverse):
    ws = jnp.linspace(-1.0, 1.0, length * 9, dtype=f32).reshape(length, 3, 3)
    x = jnp.array([0.3, -0.2, 0.9], f32)
    g = jg.check(jg.trace(lambda w, v: scan_fn(w, v, reverse), ws, x, param_argnums=0))
    (scan,) = [e for e in g.eqns if e.op == "scan"]
    assert body_ops(scan) == ["dot_general", "tanh", "reduce_sum"]
    assert scan.params["length"] == length and scan.params["reverse"] == reverse
    want = jax.jit(scan_fn, static_argnums=2)(ws, x, reverse)
    np.testing.assert_array_equal(jg.compile(g)(ws, x), want)  # same loop, same XLA program
    if length:  # disable_jit cannot run an empty scan
        with jax.disable_jit():  # op by op, as the reference interpreter runs the loop
            np.testing.assert_array_equal(jg.evaluate(g, ws, x), scan_fn(ws, x, reverse))


def test_scan_with_consts_and_no_xs():
    def f(a, x):
        h, _ = jax.lax.scan(lambda c, _: (c * a + 1.0, None), x, None, length=4)
        return jnp.sum(h)

    g = jg.check(jg.trace(f, f32(0.5), jnp.ones(2, f32)))
    (scan,) = g.eqns[:1]
    assert scan.op == "scan" and scan.params["num_consts"] == 1 and body_ops(scan) == [
        "mul", "add"]
    np.testing.assert_array_equal(jg.evaluate(g, f32(0.5), jnp.ones(2, f32)), 2 * 1.9375)


def test_loops_print_their_bodies_nested():
    g = jg.trace(lambda a, x: jax.lax.scan(lambda c, _: (c * a, None), x, None, length=2)[0],
                 f32(0.5), f32(1.0))
    assert str(g) == """{ lambda a:f32[]@data b:f32[]@data .
  let c:f32[] = scan[length=2 num_consts=1 num_carry=1
        body={ lambda d:f32[] e:f32[] .
                let f:f32[] = mul e d
                in ( f ) }
      ] a b
  in ( c@loss ) }"""


def loops(x, i):
    _, y = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))
    z = jax.lax.cond(i > 0, lambda v: v * 2.0, lambda v: v + 1.0, y)
    return jnp.sum(jax.lax.switch(i, [jnp.sin, jnp.cos, jnp.exp], z))


def test_while_and_cond_are_ops_with_sub_graphs():
    x = jnp.array([0.1, 0.2], f32)
    g = jg.check(jg.trace(loops, x, 1))
    assert ops_of(g).count("while") == 1 and ops_of(g).count("cond") == 2
    (loop,) = [e for e in g.eqns if e.op == "while"]
    assert body_ops(loop, "cond_graph") == ["lt"] and body_ops(loop) == ["add", "mul"]
    switch = [e for e in g.eqns if e.op == "cond"][-1]
    assert [[e.op for e in b.eqns] for b in switch.params["branches"]] == [["sin"], ["cos"],
                                                                          ["exp"]]
    for i in (0, 1, 2):
        np.testing.assert_array_equal(jg.compile(g)(x, i), jax.jit(loops)(x, i))
        np.testing.assert_array_equal(jg.evaluate(g, x, i), loops(x, i))


def noisy(x, key):
    return jnp.sum(x * jax.random.normal(key, x.shape, x.dtype))


@pytest.mark.parametrize("make_key", [jax.random.PRNGKey, jax.random.key], ids=["raw", "typed"])
def test_rng_ops_are_opaque_and_bitwise(make_key):
    x, key = jnp.ones(5, f32), make_key(3)
    g = jg.check(jg.trace(noisy, x, key))
    assert "random_bits" in ops_of(g)
    np.testing.assert_array_equal(jg.compile(g)(x, make_key(4)), jax.jit(noisy)(x, make_key(4)))
    with jax.disable_jit():
        np.testing.assert_array_equal(jg.evaluate(g, x, key), noisy(x, key))


# -- what jgraph refuses, and where ---------------------------------------------------------------
def test_effects_are_refused_naming_primitive_and_line():
    def f(x):
        line = inspect.currentframe().f_lineno + 1
        jax.debug.callback(print, x)
        f.line = line
        return jnp.sum(x)

    with pytest.raises(jg.TraceError) as err:
        jg.trace(f, jnp.ones(2, f32))
    assert "'debug_callback'" in str(err.value) and "side effects" in str(err.value)
    assert f"test_trace.py:{f.line}:" in str(err.value)


def test_unsupported_higher_order_primitive_names_primitive_and_line():
    mesh = jax.make_mesh((1,), ("i",))
    spec = jax.sharding.PartitionSpec()

    def f(x):
        line = inspect.currentframe().f_lineno + 1
        y = jax.shard_map(lambda a: a * 2.0, mesh=mesh, in_specs=spec, out_specs=spec)(x)
        f.line = line
        return jnp.sum(y)

    with pytest.raises(jg.TraceError) as err:
        jg.trace(f, jnp.ones(2, f32))
    assert "higher-order primitive 'shard_map' is not supported" in str(err.value)
    assert f"test_trace.py:{f.line}:" in str(err.value)


def test_builder_call_stamps_the_builders_source_and_tags():
    from jgraph.builder import Builder

    x = jg.Var(jax.core.ShapedArray((3,), np.dtype("float32")))
    b = Builder(tags={"backward"}, source="user.py:7:1 (loss)")
    (y,) = b.call(jax.nn.gelu, x)  # gelu is a nested jit: its eqns are inlined too
    assert len(b.eqns) > 3 and b.eqns[-1].outputs == (y,)
    assert {(e.source, e.tags) for e in b.eqns} == {("user.py:7:1 (loss)", frozenset({"backward"}))}


def test_outputs_may_be_inputs_or_constants():
    def f(x):
        return x, 1.5, jnp.zeros(2, f32)

    g = jg.check(jg.trace(f, jnp.ones(3, f32)))
    assert g.outputs[0] is g.inputs[0] and isinstance(g.outputs[1], jg.Literal)
    x = jnp.arange(3, dtype=f32)
    want = jax.jit(f)(x)
    for got in (jg.compile(g)(x), jg.evaluate(g, x)):
        assert_tree_equal(got, want)
        assert got[1].dtype == want[1].dtype and got[1].shape == ()


# -- JAX's defaults (x64 off): typed Python-scalar literals ------------------------------------
def _dropout(p, x):
    keep = jax.random.bernoulli(jax.random.PRNGKey(0), 0.5, (x.shape[0], p.shape[1]))
    return jnp.mean(jnp.where(keep, (x @ p) / 0.5, 0.0))


def _adam_step(p, x):
    tx = optax.adam(1e-3)
    grads = jax.grad(lambda p: jnp.sum((x @ p) ** 2))(p)
    updates, _ = tx.update(grads, tx.init(p), p)
    return jnp.sum(optax.apply_updates(p, updates))


X64_OFF_CASES = {
    "attention_mask": lambda p, x: jnp.mean(jnp.where(x @ p > 0, x @ p, -1e9)),
    "xent_integer_labels": lambda p, x: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(x @ p, jnp.array([0, 2]))),
    "dropout_where": _dropout,
    "add_int_literal": lambda p, x: jnp.sum(x @ p + 2),
    "adam_step": _adam_step,
}


@pytest.mark.parametrize("name", sorted(X64_OFF_CASES))
def test_check_accepts_typed_scalar_literals_with_x64_off(name):
    assert not jax.config.jax_enable_x64
    fn = X64_OFF_CASES[name]
    p, x = jnp.full((3, 4), 0.1), jnp.arange(6.0).reshape(2, 3)
    g = jg.check(jg.trace(fn, p, x, param_argnums=0))
    for eqn in g.eqns:  # every literal holds a numpy value of exactly its aval's dtype
        for a in eqn.inputs:
            if isinstance(a, jg.Literal):
                assert np.asarray(a.value).dtype == a.aval.dtype, (eqn.op, a)
    gb = jg.check(jg.backward(g))
    value, grad = jg.compile(gb)(p, x)
    want_value, want_grad = jax.value_and_grad(fn)(p, x)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)


# -- call-time checks ---------------------------------------------------------------------------
def _signature_graph():
    f = lambda p, x, n: jnp.sum(x @ p["w"]) * n
    return jg.trace(f, {"w": jnp.ones((3, 2))}, jnp.ones((2, 3)), jnp.int32(2), param_argnums=0)


@pytest.mark.parametrize("run", ["evaluate", "compile"])
@pytest.mark.parametrize("args, message", [
    (({"v": jnp.ones((3, 2))}, jnp.ones((2, 3)), 3),
     r"(?s)do not match the traced signature.*missing    args\[0\]\['w'\]: expected f32\[3,2\]"
     r".*unexpected args\[0\]\['v'\]: f32\[3,2\]"),
    (({"w": jnp.ones((3, 2))}, jnp.ones((2, 4)), 2),
     r"argument args\[1\] is f32\[2,4\] but the traced signature has f32\[2,3\] there"),
    (({"w": jnp.ones((3, 2), jnp.int32)}, jnp.ones((2, 3)), 2),
     r"argument args\[0\]\['w'\] is i32\[3,2\] but the traced signature has f32\[3,2\]"),
    (({"w": jnp.ones((3, 2))}, jnp.ones((2, 3)), 2.5), r"argument args\[2\] is .*i32\[\]"),
    (({"w": jnp.ones((3, 2))}, jnp.ones((2, 3)), 1j), r"argument args\[2\] is .*i32\[\]"),
    # values jax.jit itself cannot abstract: the call names them, not only JAX's message
    (({"w": jnp.ones((3, 2))}, "abc", 2), r"argument args\[1\] is a str \('abc'\), not an array"),
    (({"w": object()}, jnp.ones((2, 3)), 2), r"argument args\[0\]\['w'\] is a object"),
    (({"w": jnp.ones((3, 2))}, jnp.ones((2, 3)), 2**40), r"args\[2\] is 1099511627776, out of"),
])
def test_calls_with_another_signature_are_named_errors(run, args, message):
    g = _signature_graph()
    call = jg.evaluate if run == "evaluate" else lambda g, *a: jg.compile(g)(*a)
    with pytest.raises(jg.JGraphError, match=message):
        call(g, *args)


def test_python_scalars_that_fit_are_converted():
    g = _signature_graph()
    args = ({"w": jnp.ones((3, 2))}, jnp.ones((2, 3)))
    assert float(jg.evaluate(g, *args, 3)) == float(jg.compile(g)(*args, 3)) == 36.0
    with pytest.raises(jg.JGraphError, match=r"out of the range of i32\[\]"):
        jg.evaluate(g, *args, 2**40)
    # an int beyond int32 is a float input's value as jax.jit would refuse to abstract it
    h = jg.trace(lambda p, x: p * x, jnp.ones(()), jnp.ones(()))
    assert float(jg.compile(h)(1.0, 2**40)) == float(jg.evaluate(h, 1.0, 2**40)) == 2.0**40


def test_integer_params_are_an_error_naming_the_param():
    def f(p, x):
        return jnp.sum(x * p["w"]) + p["n"]

    g = jg.trace(f, {"w": jnp.ones(3), "n": jnp.int32(2)}, jnp.ones(3), param_argnums=0)
    with pytest.raises(jg.TransformError, match=r"param args\[0\]\['n'\] is i32\[\]"):
        jg.backward(g)
    with pytest.raises(TypeError):  # as jax.grad refuses
        jax.grad(f)({"w": jnp.ones(3), "n": jnp.int32(2)}, jnp.ones(3))


def test_errors_inside_rules_and_lowerings_name_the_eqn_and_line(monkeypatch):
    import dataclasses

    monkeypatch.setattr(jg.config, "check_graphs", False)  # reach the rule and the lowering

    g = jg.trace(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(3), param_argnums=0)
    bad = dataclasses.replace(g.eqns[0], params={"accuracy": "bogus"})
    g = g.replace(eqns=(bad,) + g.eqns[1:])
    with pytest.raises(jg.JGraphError, match=r"while evaluating eqn `b:f32\[3\] = "
                                             r"sin\[accuracy=bogus\] a` \(.*test_trace.py:\d+"):
        jg.evaluate(g, jnp.ones(3))
    g = jg.trace(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(3), param_argnums=0)
    bad = dataclasses.replace(g.eqns[1], params=dict(g.eqns[1].params, axes=(3,)))
    with pytest.raises(jg.TransformError, match=r"while differentiating eqn `c:f32\[\] = "
                                                r"reduce_sum\[axes=\(3,\)"):
        jg.backward(g.replace(eqns=(g.eqns[0], bad)))
