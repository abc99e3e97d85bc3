"""`jg.backward`, `jg.to_jax`, custom_vjp and `jg.testing.check_grads`.

Every model of the corpus: gradients equal `jax.value_and_grad` (bitwise where jgraph's rules use
JAX's formulas; relative error <= 1e-6 in float32 everywhere) and pass `check_grads(order=2)` in
float64. Then ggml semantics (loss seed, accumulators, fan-out, zero gradients, cuts), errors, the
golden string of a 2-layer MLP's backward graph, and checks that can catch a wrong rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from models import BY_NAME, MODELS

import jgraph as jg
from jgraph import vjp_rules
from jgraph.lower import as_function

# Models whose gradients are not bitwise JAX's, and why (none: loops stay loops, as in JAX).
NOT_BITWISE: dict[str, str] = {}
QUICK = {"xla_backend_optimization_level": 0}  # compile options: 18 models, compiled once each


def _trace(spec, dtype):
    args = spec.args(seed=0, dtype=dtype)
    return jg.trace(spec.fn, *args, param_argnums=spec.param_argnums, has_aux=spec.has_aux), args


def _max_rel_err(got, want):
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) /
                 max(float(np.max(np.abs(want))), 1e-30))


@pytest.mark.parametrize("spec", MODELS, ids=lambda s: s.name)
def test_corpus_gradients_equal_value_and_grad(spec):
    g, args = _trace(spec, jnp.float32)
    gb = jg.backward(g)
    jg.check(gb)
    reference = jax.value_and_grad(spec.fn, argnums=spec.param_argnums, has_aux=spec.has_aux)
    # One program computes both, compiled quickly (XLA may share identical subcomputations: where
    # it does, the HLO was the same). bench_backward compares separately compiled default steps.
    both = jax.jit(lambda *a: (as_function(gb)(*a), reference(*a)))
    got, want = both.lower(*args).compile(QUICK)(*args)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        if jnp.issubdtype(b.dtype, jnp.floating):
            assert _max_rel_err(a, b) <= 1e-6
        if spec.name not in NOT_BITWISE:
            np.testing.assert_array_equal(a, b)


def _loss_only(spec):
    return (lambda *a: spec.fn(*a)[0]) if spec.has_aux else spec.fn


@pytest.mark.f64
@pytest.mark.parametrize("spec", MODELS, ids=lambda s: s.name)
def test_corpus_check_grads_order2_float64(spec):
    jg.testing.check_grads(_loss_only(spec), spec.args(seed=1, dtype=jnp.float64), order=2)


@pytest.mark.parametrize("name", ["mlp", "cnn_pool_window"])
def test_to_jax_grad_uses_jgraph_rules_and_matches_backward(name):
    spec = BY_NAME[name]
    g, args = _trace(spec, jnp.float32)
    want = jg.compile(jg.backward(g))(*args)[1]
    got = jax.jit(jax.grad(jg.to_jax(g), argnums=spec.param_argnums, has_aux=spec.has_aux))(*args)
    got = got[0] if spec.has_aux else got
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _wrong_sin_rule(cts, ins, outs, **_):
    return [cts[0] * jnp.cos(ins[0]) * 1.5]


def test_a_wrong_rule_is_caught_by_check_grads_and_seen_by_to_jax(monkeypatch):
    def f(x):
        return jnp.sum(jnp.sin(x) ** 2)

    x = jnp.linspace(0.1, 1.0, 5)
    jg.testing.check_grads(f, (x,), order=2)
    monkeypatch.setitem(vjp_rules.vjp_rules, "sin", _wrong_sin_rule)
    with pytest.raises(AssertionError, match="order-1 derivative"):
        jg.testing.check_grads(f, (x,), order=1)
    g = jg.trace(f, x)
    np.testing.assert_allclose(jax.grad(jg.to_jax(g))(x), 1.5 * jax.grad(f)(x), rtol=1e-12)


# -- ggml semantics --------------------------------------------------------------------------------
def _mlp2(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean(h @ p["w2"])


P = {"w1": jnp.full((3, 4), 0.1, jnp.float32), "b1": jnp.zeros((4,), jnp.float32),
     "w2": jnp.full((4, 2), 0.2, jnp.float32)}
X = (jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 6)


def test_loss_seed_scales_the_gradient():
    g = jg.trace(lambda p, x, seed: _mlp2(p, x), P, X, jnp.float32(0.0), param_argnums=0)
    g = g.replace(input_roles=g.input_roles[:-1] + ("loss_seed",))
    loss, grads = jg.compile(jg.backward(g))(P, X, jnp.float32(0.25))
    want_loss, want = jax.value_and_grad(_mlp2)(P, X)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, 0.25 * b, rtol=1e-6)


def test_accumulation_belongs_to_accumulate_not_backward():
    acc = jax.tree.map(lambda a: jnp.full_like(a, 3.0), P)
    g = jg.trace(lambda p, x, acc: _mlp2(p, x), P, X, acc, param_argnums=0)
    n = len(jax.tree.leaves(P))
    g = g.replace(input_roles=g.input_roles[:-n] + ("accumulator",) * n)
    with pytest.raises(jg.TransformError, match=r"jg\.accumulate"):
        jg.backward(g)


def test_backward_records_its_loss_seed():
    gb = jg.backward(jg.trace(_mlp2, P, X, param_argnums=0))
    seed = gb.info["loss_seed"]
    assert isinstance(seed, jg.Literal) and float(seed.value) == 1.0
    assert any(a is seed for e in gb.eqns for a in e.inputs)  # the backward reads it


def test_fan_out_cotangents_are_summed():
    f = lambda w, x: jnp.sum(jnp.sin(x * w) * w + w)
    w, x = jnp.float32(0.7), jnp.linspace(0, 1, 4, dtype=jnp.float32)
    np.testing.assert_allclose(jg.compile(jg.backward(jg.trace(f, w, x, param_argnums=0)))(w, x)[1],
                               jax.grad(f)(w, x), rtol=1e-6)


def test_param_not_reaching_the_loss_gets_zeros():
    f = lambda p, x: jnp.sum(x @ p["used"])
    p = {"used": jnp.ones((3, 2), jnp.float32), "unused": jnp.ones((5,), jnp.float32)}
    _, grads = jg.compile(jg.backward(jg.trace(f, p, X, param_argnums=0)))(p, X)
    np.testing.assert_array_equal(grads["unused"], np.zeros(5, np.float32))
    assert grads["unused"].dtype == jnp.float32


def test_stop_gradient_and_integer_paths_cut():
    def f(w, x):
        frozen = lax.stop_gradient(w) * x  # no gradient through here
        idx = jnp.floor(w * 3).astype(jnp.int32)  # nor through an integer
        return jnp.sum(frozen) + jnp.sum(idx.astype(jnp.float32)) + jnp.sum(w * w)

    w = jnp.linspace(0.1, 0.9, 3, dtype=jnp.float32)
    gb = jg.backward(jg.trace(f, w, w, param_argnums=0))
    np.testing.assert_array_equal(jg.compile(gb)(w, w)[1], 2 * w)
    backward_ops = {e.op for e in gb.eqns if "backward" in e.tags}
    assert "convert_element_type" not in backward_ops and "floor" not in backward_ops


def test_multiple_param_argnums_and_aux_structure():
    f = lambda a, x, b: (jnp.sum(jnp.tanh(x * a) * b), {"n": jnp.sum(x)})
    a, b = jnp.float32(0.3), jnp.ones(4, jnp.float32)
    x = jnp.linspace(0, 1, 4, dtype=jnp.float32)
    gb = jg.backward(jg.trace(f, a, x, b, param_argnums=(2, 0), has_aux=True))
    got = jg.compile(gb)(a, x, b)
    want = jax.value_and_grad(f, argnums=(2, 0), has_aux=True)(a, x, b)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(u, v)


# -- custom_vjp ------------------------------------------------------------------------------------
@jax.custom_vjp
def _clip_gradient(x):
    return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))


def test_custom_vjp_uses_the_users_bwd():
    f = lambda w, x: jnp.sum(_clip_gradient(w * x) ** 2)
    w, x = jnp.float32(2.0), jnp.linspace(-1, 1, 5, dtype=jnp.float32)
    g = jg.trace(f, w, x, param_argnums=0)
    assert [e.op for e in g.eqns].count("custom_vjp_call") == 1
    got = jg.compile(jg.backward(g))(w, x)[1]
    np.testing.assert_array_equal(got, jax.grad(f)(w, x))
    assert not np.allclose(got, jax.grad(lambda w, x: jnp.sum((w * x) ** 2))(w, x))
    np.testing.assert_array_equal(jax.grad(jg.to_jax(g))(w, x), got)  # to_jax: the same bwd


# -- errors ----------------------------------------------------------------------------------------
def test_error_non_scalar_loss():
    g = jg.trace(lambda w: w * 2, jnp.ones(3), param_argnums=0)
    with pytest.raises(jg.TransformError, match="floating scalar"):
        jg.backward(g)


def test_error_integer_loss():
    g = jg.trace(lambda w: jnp.sum(w).astype(jnp.int32), jnp.ones(3), param_argnums=0)
    with pytest.raises(jg.TransformError, match=r"floating scalar.*i32\[\]"):
        jg.backward(g)


def test_error_no_param():
    with pytest.raises(jg.TransformError, match="no 'param' input"):
        jg.backward(jg.trace(lambda w: jnp.sum(w), jnp.ones(3)))


@pytest.mark.parametrize("fn, op", [
    (lambda w: jnp.sum(lax.igamma(w, w + 1.0)), "igamma"),
    (lambda w: jnp.sum(lax.igammac(w, w + 1.0)), "igammac"),
])
def test_error_missing_rule_names_op_and_user_line(fn, op):
    g = jg.trace(fn, jnp.linspace(1, 2, 3), param_argnums=0)
    with pytest.raises(jg.TransformError, match=rf"no VJP rule for op '{op}'.*test_backward.py:"):
        jg.backward(g)


def test_missing_rule_off_the_gradient_path_is_fine():
    f = lambda w, x: jnp.sum(w * lax.cumlogsumexp(x))
    x = jnp.linspace(1, 2, 3)
    np.testing.assert_allclose(jg.compile(jg.backward(jg.trace(f, x, x, param_argnums=0)))(x, x)[1],
                               lax.cumlogsumexp(x))


# -- structure -------------------------------------------------------------------------------------
GOLDEN_MLP2 = """\
{ lambda a:f32[4]@param b:f32[3,4]@param c:f32[4,2]@param d:f32[2,3]@data .
  let e:f32[2,4] = dot_general[contract=[1]x[0]] d b
      f:f32[1,4] = broadcast_in_dim[dims=(1,)] a
      g:f32[2,4] = add e f
      h:f32[2,4] = tanh g
      i:f32[2,2] = dot_general[contract=[1]x[0]] h c
      j:f32[] = reduce_sum[axes=(0, 1)] i
      k:f32[] = div j 4.0:f32[]
      l:f32[] = div 1.0:f32[] 4.0:f32[]               # backward
      m:f32[2,2] = broadcast_in_dim[dims=()] l        # backward
      n:f32[2,4] = dot_general[contract=[1]x[1]] m c  # backward
      o:f32[2,4] = dot_general[contract=[0]x[0]] m h  # backward
      p:f32[4,2] = transpose[permutation=(1, 0)] o    # backward
      q:f32[2,4] = sub 1.0:f32[] h                    # backward
      r:f32[2,4] = mul n q                            # backward
      s:f32[2,4] = mul r h                            # backward
      t:f32[2,4] = add r s                            # backward
      u:f32[4] = reduce_sum[axes=(0,)] t              # backward
      v:f32[1,4] = reshape u                          # backward
      w:f32[4] = reduce_sum[axes=(0,)] v              # backward
      x:f32[4,3] = dot_general[contract=[0]x[0]] t d  # backward
      y:f32[3,4] = transpose[permutation=(1, 0)] x    # backward
  in ( k@loss w@grad y@grad p@grad ) }"""


def test_golden_backward_of_a_two_layer_mlp():
    gb = jg.backward(jg.trace(_mlp2, P, X, param_argnums=0))
    assert str(gb) == GOLDEN_MLP2


def test_backward_is_pure_and_its_size_linear():
    def chain(n):
        def f(ws, x):
            for w in ws:
                x = jnp.tanh(x @ w + 1.0)
            return jnp.mean(x)
        return jg.trace(f, [jnp.ones((2, 2), jnp.float32)] * n, jnp.ones((1, 2), jnp.float32),
                        param_argnums=0)

    graphs = {n: chain(n) for n in (10, 20, 40)}
    before = {n: str(g) for n, g in graphs.items()}
    size = {n: len(jg.backward(g).eqns) for n, g in graphs.items()}
    assert all(str(graphs[n]) == before[n] for n in graphs)  # the input graph is untouched
    assert size[40] - size[10] == 3 * (size[20] - size[10])  # a constant number of eqns per layer


def _closing_custom_vjp_loss(w, x):
    @jax.custom_vjp
    def f(a):
        return jnp.sin(a) * w

    f.defvjp(lambda a: (f(a), a), lambda a, g: (g * jnp.cos(a) * 2.0,))
    return jnp.sum(f(x))


def test_custom_vjp_closing_over_a_value_differentiates_its_argument():
    w, x = jnp.float32(2.0), jnp.linspace(0.0, 1.0, 3, dtype=jnp.float32)
    g = jg.backward(jg.trace(_closing_custom_vjp_loss, w, x, param_argnums=1))
    got = jg.compile(g)(w, x)
    want = jax.value_and_grad(_closing_custom_vjp_loss, 1)(w, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_custom_vjp_closed_over_param_is_an_error_not_a_zero_gradient():
    w, x = jnp.float32(2.0), jnp.ones(3, jnp.float32)
    g = jg.trace(_closing_custom_vjp_loss, w, x, param_argnums=0)
    with pytest.raises(jg.TransformError, match="closed-over value"):
        jg.backward(g)


# -- custom_jvp: the user's JVP rule, linearized and transposed ------------------------------------
_AT_ZERO = {  # functions whose custom_jvp rule differs from their primal body's derivative at 0
    "relu": lambda w: jnp.sum(jax.nn.relu(w) * jnp.array([1.0, 2.0, 3.0])),
    "softplus": lambda w: jnp.sum(jax.nn.softplus(w)),
    "log_sigmoid": lambda w: jnp.sum(jax.nn.log_sigmoid(w)),
    "sigmoid_bce": lambda w: jnp.sum(optax.sigmoid_binary_cross_entropy(
        w, jnp.array([1.0, 0.0, 1.0]))),
    "logaddexp": lambda w: jnp.sum(jnp.logaddexp(w, jnp.zeros(3))),
    "sinc": lambda w: jnp.sum(jnp.sinc(w)),
}
_EXPECTED_AT_ZERO = {"relu": [0.0, 0.0, 0.0], "softplus": [0.5] * 3, "log_sigmoid": [0.5] * 3,
                     "sigmoid_bce": [-0.5, 0.5, -0.5], "logaddexp": [0.5] * 3,
                     "sinc": [0.0] * 3}


@pytest.mark.parametrize("name", sorted(_AT_ZERO))
def test_custom_jvp_rule_is_honoured_at_zero(name):
    f, w = _AT_ZERO[name], jnp.zeros(3)
    g = jg.check(jg.trace(f, w, param_argnums=0))
    assert "custom_jvp_call" in {e.op for e in g.eqns}
    value, grad = jg.compile(jg.check(jg.backward(g)))(w)
    want_value, want_grad = jax.value_and_grad(f)(w)
    np.testing.assert_array_equal(value, want_value)
    np.testing.assert_array_equal(grad, want_grad)
    np.testing.assert_allclose(grad, _EXPECTED_AT_ZERO[name], atol=1e-7)  # by hand


def test_custom_jvp_forward_is_the_primal_body_bitwise():
    x = jnp.linspace(-3.0, 3.0, 11)
    f = lambda x: jnp.sum(jax.nn.gelu(x) + jax.nn.softplus(x))
    g = jg.trace(f, x, param_argnums=0)
    np.testing.assert_array_equal(jg.compile(g)(x), jax.jit(f)(x))


@jax.custom_jvp
def _clipped_identity(x, n):  # an integer argument, and a rule unlike the body's derivative
    return jnp.clip(x, -1.0, 1.0) * n


_clipped_identity.defjvp(lambda primals, tangents: (
    _clipped_identity(*primals), tangents[0] * 2.0 * primals[1]))


@pytest.mark.f64
def test_custom_jvp_with_integer_argument_and_second_order():
    f = lambda x: jnp.sum(jnp.sin(_clipped_identity(x, 3)) ** 2)
    x = jnp.array([0.3, -2.0, 5.0])
    value, grad = jg.compile(jg.backward(jg.trace(f, x, param_argnums=0)))(x)
    want_value, want_grad = jax.value_and_grad(f)(x)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-12)
    jg.testing.check_grads(lambda x: jnp.sum(jax.nn.gelu(x) * jnp.tanh(x)), (x,), order=2)


def test_custom_jvp_closing_over_a_param_is_an_error():
    def f(w, x):
        @jax.custom_jvp
        def scale(x):
            return x * w

        scale.defjvp(lambda p, t: (scale(*p), t[0] * w))
        return jnp.sum(scale(x))

    with pytest.raises(jg.TransformError, match="closed-over"):
        jg.backward(jg.trace(f, jnp.ones(2), jnp.ones(2), param_argnums=0))
