"""`jg.vjp` against `jax.vjp`, and `jg.filter_value_and_grad` / `jg.filter_grad` against
equinox's (the same models, the same None leaves)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jgraph as jg
from tests.real_models import MODELS
from tests.test_dropin import assert_trees_close

f32 = jnp.float32


def tree_fn(p, x, n):
    h = jnp.tanh(x @ p["w"]) * p["s"]
    return {"h": h, "sums": (jnp.sum(h, 0), jnp.sum(h).astype(jnp.int32)), "n": n * 2}


def tree_primals():
    k = jax.random.split(jax.random.PRNGKey(3), 2)
    return ({"w": jax.random.normal(k[0], (3, 4), f32), "s": f32(1.5)},
            jax.random.normal(k[1], (5, 3), f32), jnp.int32(3))


def cotangent_like(out, seed=0):
    """Random cotangents for the floating outputs, float0 zeros for the integer ones."""
    leaves, tree = jax.tree.flatten(out)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(tree, [
        jax.random.normal(k, x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else np.zeros(x.shape, jax.dtypes.float0) for k, x in zip(keys, leaves, strict=True)])


def test_vjp_matches_jax():
    primals = tree_primals()
    out, vjp_fn = jg.vjp(tree_fn, *primals)
    jout, jvjp_fn = jax.vjp(tree_fn, *primals)
    assert_trees_close(out, jout)
    ct = cotangent_like(jout)
    got, want = vjp_fn(ct), jvjp_fn(ct)
    assert isinstance(got, tuple) and len(got) == 3
    assert got[2].dtype == want[2].dtype == jax.dtypes.float0  # the integer primal
    assert_trees_close(got[:2], want[:2], rtol=1e-5)
    assert_trees_close(vjp_fn(cotangent_like(jout, 1))[:2], jvjp_fn(cotangent_like(jout, 1))[:2],
                       rtol=1e-5)


def test_vjp_has_aux_and_python_scalars():
    f = lambda x, y: (jnp.sin(x) * y, {"y2": y ** 2, "note": "aux"})
    out, vjp_fn, aux = jg.vjp(f, 1.5, 2.0, has_aux=True)
    jout, jvjp_fn, jaux = jax.vjp(f, 1.5, 2.0, has_aux=True)
    assert_trees_close(out, jout)
    assert aux["note"] == "aux"
    assert_trees_close(aux["y2"], jaux["y2"])
    assert_trees_close(vjp_fn(1.0), jvjp_fn(1.0))


def test_vjp_function_crosses_jit_and_runs_inside():
    primals = tree_primals()
    ct = cotangent_like(tree_fn(*primals))
    want = jax.vjp(tree_fn, *primals)[1](ct)[:2]

    @jax.jit
    def forward(p, x, n):
        return jg.vjp(tree_fn, p, x, n)  # the VJP function is a pytree of residuals

    out, vjp_fn = forward(*primals)
    assert_trees_close(vjp_fn(ct)[:2], want, rtol=1e-5)
    assert_trees_close(jax.jit(lambda f, ct: f(ct))(vjp_fn, ct)[:2], want, rtol=1e-5)
    # vmapped cotangents: rows of a Jacobian
    f = lambda v: jnp.tanh(v) * jnp.roll(v, 1)
    v = jnp.linspace(-1, 1, 4, dtype=f32)
    _, pullback = jg.vjp(f, v)
    assert_trees_close(jax.vmap(pullback)(jnp.eye(4, dtype=f32))[0], jax.jacrev(f)(v))


def test_vjp_traces_once_per_signature():
    calls = []

    def f(x):
        calls.append(1)
        return jnp.sin(x) * 2

    for x in (jnp.ones(3, f32), jnp.zeros(3, f32), jnp.ones(3, f32) * 2):
        out, pullback = jg.vjp(f, x)
        assert_trees_close(pullback(jnp.ones(3, f32)), (2 * jnp.cos(x),))
    assert len(calls) == 1
    jg.vjp(f, jnp.ones(4, f32))
    assert len(calls) == 2


def test_vjp_of_loops_and_checkpoint_regions():
    ws = jax.random.normal(jax.random.PRNGKey(5), (4, 3, 3), f32) * 0.5

    def scanned(x, ws):
        layer = lambda h, w: (jnp.tanh(jnp.tanh(h @ w) @ w), None)
        return lax.scan(layer, x, ws)[0]

    def checkpointed(x, ws):
        for w in ws:
            x = jax.checkpoint(lambda x, w: jnp.sin(jnp.sin(x @ w) @ w))(x, w)
        return x

    x, ct = jnp.ones((2, 3), f32), jnp.full((2, 3), 0.5, f32)
    for f in (scanned, checkpointed):
        out, pullback = jg.vjp(f, x, ws)
        jout, jpullback = jax.vjp(f, x, ws)
        assert_trees_close(out, jout, rtol=1e-6)
        assert_trees_close(pullback(ct), jpullback(ct), rtol=1e-5)
    # The checkpointed function keeps only the region inputs: 4 hidden states, not 4 x 3.
    saved = len(jg.vjp(checkpointed, x, ws)[1].residuals)
    unchecked = len(jg.vjp(lambda x, ws: _unchecked(x, ws), x, ws)[1].residuals)
    assert saved < unchecked


def _unchecked(x, ws):
    for w in ws:
        x = jnp.sin(jnp.sin(x @ w) @ w)
    return x


VJP_ERRORS = {  # name -> (call taking jax.vjp or jg.vjp, builtin type)
    "cotangent tree": (lambda vjp: vjp(jnp.sin, X)[1]([X]), ValueError),
    "cotangent shape": (lambda vjp: vjp(jnp.sin, X)[1](jnp.ones(4, f32)), ValueError),
    "cotangent dtype": (lambda vjp: vjp(jnp.sin, X)[1](jnp.ones(3, jnp.int32)), ValueError),
    "two cotangents": (lambda vjp: vjp(jnp.sin, X)[1](X, X), TypeError),
    "string primal": (lambda vjp: vjp(lambda s: 1.0, "a"), TypeError),
    "aux not a pair": (lambda vjp: vjp(jnp.sin, X, has_aux=True), TypeError),
}
X = jnp.ones(3, f32)


@pytest.mark.parametrize("name", sorted(VJP_ERRORS))
def test_vjp_errors_are_jaxs(name):
    call, builtin = VJP_ERRORS[name]
    with pytest.raises(builtin):
        call(jax.vjp)
    with pytest.raises(jg.JGraphError) as ours:
        call(jg.vjp)
    assert isinstance(ours.value, builtin)


def test_jg_vjp_is_the_transform_and_the_rules_live_in_vjp_rules():
    import jgraph
    from jgraph import vjp, vjp_rules

    assert vjp is jg.vjp is jgraph.dropin.vjp and "tanh" in vjp_rules.vjp_rules


# -- equinox's filter semantics ------------------------------------------------------------------
class Model(eqx.Module):
    mlp: eqx.nn.MLP
    scale: float  # a Python float field: static under the filters
    steps: jax.Array  # an integer array field: not differentiated
    name: str = "model"

    def __call__(self, x):
        return jax.vmap(self.mlp)(x) * self.scale + self.steps


@functools.cache
def model_and_data():
    @eqx.filter_jit  # one compilation, not one per initializer op
    def make(key):
        k1, k2 = jax.random.split(key)
        mlp = eqx.nn.MLP(3, 2, 8, depth=2, activation=jax.nn.softplus, key=k1)
        return Model(mlp, 0.5, jnp.int32(1)), jax.random.normal(k2, (6, 3), f32)

    return make(jax.random.PRNGKey(4))


def model_loss(model, x, target):
    return jnp.mean((model(x) - target) ** 2)


@functools.cache
def equinox_reference():
    model, x = model_and_data()
    return eqx.filter_jit(eqx.filter_value_and_grad(model_loss))(model, x, 0.3)


def test_filter_value_and_grad_matches_equinox():
    model, x = model_and_data()
    got = eqx.filter_jit(jg.filter_value_and_grad(model_loss))(model, x, 0.3)
    want = equinox_reference()
    assert jax.tree.structure(got, is_leaf=lambda a: a is None) == \
        jax.tree.structure(want, is_leaf=lambda a: a is None)
    assert got[1].steps is None and got[1].mlp.activation is None  # not differentiated
    assert_trees_close(got, want, rtol=1e-5)
    updated = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, got[1]))
    assert updated.name == "model" and updated.scale == 0.5


def test_filter_grad_forms_and_jit():
    model, x = model_and_data()
    want = equinox_reference()[1]

    @jg.filter_grad
    def bare(model, x, target):
        return model_loss(model, x, target)

    with_aux = jg.filter_grad(has_aux=True)(lambda m, x, t: (model_loss(m, x, t), "aux"))
    assert_trees_close(bare(model, x, 0.3), want, rtol=1e-5)  # eagerly
    grads, aux = eqx.filter_jit(with_aux)(model, x, 0.3)
    assert aux == "aux"
    assert_trees_close(grads, want, rtol=1e-5)
    step = eqx.filter_jit(lambda m, x: jg.filter_value_and_grad(model_loss)(m, x, 0.3))
    assert_trees_close(step(model, x), equinox_reference(), rtol=1e-5)


def test_filter_needs_the_first_argument_by_position():
    with pytest.raises(TypeError, match="first argument"):
        eqx.filter_grad(model_loss)(model=1)
    with pytest.raises(TypeError, match="first argument"):
        jg.filter_grad(model_loss)(model=1)


def test_plain_value_and_grad_refuses_an_equinox_model_as_jax_does():
    model, x = model_and_data()
    with pytest.raises(TypeError):
        jax.value_and_grad(model_loss)(model, x, 0.3)  # JAX refuses the activation function
    with pytest.raises(TypeError, match=r"args\[0\]"):
        jg.value_and_grad(model_loss)(model, x, 0.3)


# -- every real model (opt-in: eleven models, two compilations each) ------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", [m.name for m in MODELS])
def test_real_models_match_jax(name):
    model = next(m for m in MODELS if m.name == name)
    fn, args = model.built
    got = jax.jit(jg.value_and_grad(fn, has_aux=model.has_aux))(*args)
    want = jax.jit(jax.value_and_grad(fn, has_aux=model.has_aux))(*args)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)
