"""Per-op gradient families (harness in `op_families.py`, cases in `families_*.py`): every op of
the VJP rule table, over the parameter families of JAX's own autodiff suite, against `jax.vjp`
(float32/complex64, x64 off) and float64 central differences (orders 1 and 2; 3 for windows).
The default run draws a sample of each family that reaches every op; `-m slow` runs the rest
(the finite-difference checks of the largest families stay sampled there, see FD_SLOW_CAP).
Where JAX itself has no derivative, jgraph raises a TransformError naming the op and the line."""

from __future__ import annotations

import families_elementwise
import families_indexing
import families_reductions
import families_structural
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from op_families import (
    check_against_jax,
    check_finite_differences,
    chunk_id,
    chunks,
    items,
    pair_id,
    split_sample,
)

import jgraph as jg
from jgraph import ops, vjp_rules
from jgraph.errors import TransformError
from jgraph.lower import as_function

pytestmark = pytest.mark.filterwarnings("ignore:Casting complex values to real")

CASES = (families_elementwise.cases() + families_structural.cases() + families_indexing.cases()
         + families_reductions.cases())
FD_SLOW_CAP = 60  # finite-difference pairs per family under -m slow (conv has thousands)
JAX_DEFAULT, JAX_REST = split_sample(items(CASES, "jax"), per_family=2, seed="jax")
FD_DEFAULT, FD_REST = split_sample(items(CASES, "fd"), per_family=1, seed="fd", by_op=True)
FD_SLOW, _ = split_sample(FD_REST, per_family=FD_SLOW_CAP, seed="fd-slow")


@pytest.mark.parametrize("pairs", chunks(JAX_DEFAULT, 16), ids=chunk_id)
def test_vjp_equals_jax(pairs):
    check_against_jax(pairs)


@pytest.mark.slow
@pytest.mark.parametrize("pairs", chunks(JAX_REST, 32), ids=chunk_id)
def test_vjp_equals_jax_exhaustive(pairs):
    check_against_jax(pairs)


@pytest.mark.f64
@pytest.mark.parametrize("pair", FD_DEFAULT, ids=pair_id)
def test_finite_differences(pair):
    check_finite_differences(*pair)


@pytest.mark.f64
@pytest.mark.slow
@pytest.mark.parametrize("pair", FD_SLOW, ids=pair_id)
def test_finite_differences_exhaustive(pair):
    check_finite_differences(*pair)


# Rule-table keys that no JAX primitive is named (aliases of `copy`, `scatter-add`).
ALIASES = {"copy_p": "copy", "scatter_add": "scatter-add", "scatter_mul": "scatter-mul"}
# Collectives that exist only inside shard_map: tests/test_dropin_transforms.py checks them there.
SHARD_MAP_ONLY = {"pvary", "psum_invariant"}
# Ops that only a backward graph contains: the case whose finite differences run their rules.
HIGHER_ORDER = {"select_and_gather_add": "reduce_window_max:squared, order 3"}


def test_every_rule_has_a_family():
    """Every rule is checked against jax.vjp and finite differences: by a family here, or by a
    row of the linear-algebra/FFT/long-tail table (tests/test_ops_linalg.py)."""
    from test_ops_linalg import COMPLEX_ROWS, ROWS

    covered = {op for case in CASES for op in case.ops + case.backward_ops}
    covered |= {row.op for row in ROWS + COMPLEX_ROWS}
    by_id = {case.id: case for case in CASES}
    for case_id in HIGHER_ORDER.values():
        assert by_id[case_id].order == 3
    missing = set(vjp_rules.vjp_rules) - covered - set(ALIASES) - set(HIGHER_ORDER) - SHARD_MAP_ONLY
    assert not missing, f"ops with a VJP rule but no gradient family: {sorted(missing)}"
    assert not set(ALIASES) & set(ops.primitives), "an alias names a real primitive"


def test_second_order_graph_of_windowed_max_uses_select_and_gather_add():
    x = np.arange(24.0, dtype=np.float32).reshape(4, 6) * 0.3
    v = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)

    def f(x):
        return jnp.sum(jnp.square(lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (1, 2),
                                                    "SAME", (2, 1))))

    gb = jg.backward(jg.trace(f, x, param_argnums=0))
    g2 = jg.backward(jg.trace(lambda x: jnp.vdot(as_function(gb)(x)[1], v), x, param_argnums=0))
    assert "select_and_gather_add" in {e.op for e in g2.eqns}
    hvp = jax.grad(lambda x: jnp.vdot(jax.grad(f)(x), v))(x)
    np.testing.assert_allclose(jg.compile(g2)(x)[1], hvp, rtol=1e-6)


# -- where JAX has no derivative: a TransformError naming the op and the user's line -----------
def _raises(fn, *args, op, jax_error):
    with pytest.raises(jax_error):
        jax.grad(lambda *a: jnp.sum(jnp.real(fn(*a))), tuple(range(len(args))))(*args)
    graph = jg.trace(lambda *a: jnp.sum(jnp.real(fn(*a))), *args,
                     param_argnums=tuple(range(len(args))))
    with pytest.raises(TransformError, match=op) as info:
        jg.backward(graph)
    text = "\n".join([str(info.value), *getattr(info.value, "__notes__", ())])
    assert "test_op_families.py:" in text, "the error must name the user's line"
    return text


def test_scatter_apply_has_no_gradient_as_in_jax():
    message = _raises(lambda x: x.at[1].apply(jnp.sin), jnp.array([1.0, 2.0]), op="'scatter'",
                      jax_error=NotImplementedError)
    assert "update_jaxpr" in message


def test_scatter_apply_prints_its_combiner():
    graph = jg.trace(lambda x: jnp.sum(x.at[1].apply(jnp.sin)), jnp.array([1.0, 2.0]),
                     param_argnums=0)
    line = next(line for line in str(graph).splitlines() if "= scatter[" in line)
    assert "update_jaxpr={ lambda ; a:f32[] b:f32[]. let c:f32[] = sin a in (c,) }" in line
    plain = jg.trace(lambda x: jnp.sum(x.at[1].set(3.0)), jnp.array([1.0, 2.0]), param_argnums=0)
    assert "update_jaxpr" not in str(plain)


def test_windowed_max_with_window_dilation_has_no_gradient_as_in_jax():
    def fn(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (2,), (1,), "VALID", window_dilation=(2,))

    message = _raises(fn, jnp.arange(6.0), op="'reduce_window_max'",
                      jax_error=NotImplementedError)
    assert "window_dilation=(2,)" in message


def test_general_reduce_through_its_init_value_has_no_gradient_as_in_jax():
    def fn(x, init):
        return lax.reduce((x, x), (init, init), lambda a, b: (a[0] + b[0], a[1] * b[1]), (0,))[1]

    _raises(fn, jnp.arange(1.0, 4.0), jnp.float32(1.0), op="'reduce'",
            jax_error=NotImplementedError)


def test_polygamma_order_has_no_gradient_as_in_jax():
    _raises(lambda m, x: lax.polygamma(m, x), jnp.float32(1.0), jnp.float32(2.0),
            op="'polygamma'", jax_error=ValueError)
