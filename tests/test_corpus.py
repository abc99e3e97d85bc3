"""Every corpus model traces, checks, and runs exactly like the function it was traced from.

`jg.compile(jg.trace(f, *a))(*a)` must equal `jax.jit(f)(*a)` bit for bit on CPU (same primitives,
same compiler, loops kept as loops), and `jg.evaluate` must equal `f` run op by op
(`jax.disable_jit`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import BY_NAME, MODELS

import jgraph as jg

UNROLLED: set[str] = set()  # models jgraph would run with other primitives than jax.jit (none)
REQUIRED = {"mlp", "residual_mlp", "layer_norm", "causal_attention", "transformer_block",
            "cnn_pool_window", "cnn_pool_reshape", "embedding", "xent_optax", "xent_hand",
            "dropout", "checkpointed", "nested_jit", "pytree_params", "scan_layers",
            "activations", "logsumexp", "one_hot_xent"}
IDS = [spec.name for spec in MODELS]


def _trace(spec, args):
    return jg.trace(spec.fn, *args, param_argnums=spec.param_argnums, has_aux=spec.has_aux)


def _assert_same(got, want, exact=True, rtol=1e-6):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.shape(a) == np.shape(b) and np.asarray(a).dtype == np.asarray(b).dtype
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol)


def test_corpus_covers_the_required_models():
    assert REQUIRED <= set(BY_NAME) and len(MODELS) >= 12
    assert len(BY_NAME) == len(MODELS)  # names are unique


@pytest.mark.f64
@pytest.mark.parametrize("spec", MODELS, ids=IDS)
def test_corpus_traces_and_checks_in_float64(spec):
    """With x64 on (the f64 marker), the same models trace to graphs `check` accepts."""
    args = spec.args(seed=0, dtype=jnp.float64)
    g = jg.check(_trace(spec, args))
    jg.check(jg.backward(g))


@pytest.mark.parametrize("spec", MODELS, ids=IDS)
def test_compiled_equals_jit_bitwise(spec):
    args = spec.args(seed=0, dtype=jnp.float32)
    g = jg.check(_trace(spec, args))
    assert g.output_roles[0] == "loss"
    assert g.input_roles.count("param") == len(jax.tree.leaves(args[spec.param_argnums]))
    _assert_same(jg.compile(g)(*args), jax.jit(spec.fn)(*args), exact=spec.name not in UNROLLED)


# Eager evaluation compiles every op separately, which is slow on a shared CPU: the default suite
# evaluates these models (one of each kind of op family); `-m slow` evaluates all, in f32 and f64.
EVALUATED = {"f32": {"mlp", "causal_attention", "cnn_pool_window", "embedding", "dropout",
                     "checkpointed", "pytree_params", "scan_layers", "xent_hand"},
             "f64": {"layer_norm", "scan_layers"}}
EVAL_CASES = [
    pytest.param(spec, dtype, id=f"{spec.name}-{tag}",
                 marks=([] if spec.name in EVALUATED[tag] else [pytest.mark.slow])
                 + ([pytest.mark.f64] if tag == "f64" else []))
    for spec in MODELS for dtype, tag in ((jnp.float32, "f32"), (jnp.float64, "f64"))
]


@pytest.mark.parametrize("spec, dtype", EVAL_CASES)
def test_evaluate_equals_op_by_op_bitwise(spec, dtype):
    args = spec.args(seed=1, dtype=dtype)
    g = _trace(spec, args)
    with jax.disable_jit():
        want = spec.fn(*args)
    _assert_same(jg.evaluate(g, *args), want)


@pytest.mark.parametrize("name", ["mlp", "transformer_block", "pytree_params", "dropout"])
def test_compiled_graph_composes_with_jit_and_new_values(name):
    spec = BY_NAME[name]
    g = _trace(spec, spec.args(seed=0))
    args = spec.args(seed=2)  # same signature, other values
    outer = jax.jit(lambda *a: jax.tree.map(lambda x: x, jg.compile(g)(*a)))
    _assert_same(outer(*args), jax.jit(spec.fn)(*args))
