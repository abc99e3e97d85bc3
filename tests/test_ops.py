"""Table-driven op tests: one spec row per op.

Each row is a small JAX function whose traced graph contains the op. For each row: the forward
value equals `jnp`'s, `jg.backward` equals `jax.vjp` for a random output cotangent, and jgraph's
gradient matches central finite differences in float64 along a random direction. Input ranges
avoid non-differentiable points (kinks, ties, poles). Hypothesis varies shapes and values of the
elementwise and reduction rows. The registry test checks every op of the issue's op set has a shape
rule, a lowering, and a VJP rule or a non-differentiable mark.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import jgraph as jg
from jgraph import ops, vjp_rules
from jgraph.lower import as_function


@dataclass(frozen=True)
class OpSpec:
    op: str  # the op the traced graph must contain
    fn: Callable  # f(*float arrays) -> array
    shapes: tuple = ((3, 4),)  # one shape per input
    lo: float = -2.0  # input values are uniform in [lo, hi]
    hi: float = 2.0
    rtol: float = 1e-6  # f32 tolerance against jax.vjp
    fd_rtol: float = 1e-6  # f64 tolerance against finite differences
    tags: frozenset = field(default_factory=frozenset)  # "shapes": hypothesis may vary shapes


_IDX = np.array([2, 0, 2, 1], np.int32)


def _narrower(dtype):
    return jnp.float32 if dtype == jnp.float64 else jnp.bfloat16
_SCATTER_DN = lax.ScatterDimensionNumbers((1,), (0,), (0,))
_VARY = frozenset({"shapes"})
QUICK = {"xla_backend_optimization_level": 0}  # compile options: these tests compile ~200 times


def _conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 2), "SAME", dimension_numbers=("NHWC", "HWIO",
                                                                              "NHWC"))


def _grouped_conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), ((1, 0), (0, 1)), rhs_dilation=(1, 2),
                                    feature_group_count=2)


def _conv_with(**params):
    return lambda x, w: lax.conv_general_dilated(x, w, **params)


# Convolutions over the rule's padding/dilation algebra: layouts, ranks, strides, (negative)
# padding, both dilations, feature and batch groups.
_CONVS = [
    (_conv_with(window_strides=(2, 1), padding=((1, 2), (0, 1)), lhs_dilation=(1, 2),
                rhs_dilation=(2, 1)), ((2, 3, 7, 6), (4, 3, 3, 2))),
    (_conv_with(window_strides=(3,), padding="VALID", rhs_dilation=(2,),
                dimension_numbers=("NWC", "WIO", "NWC")), ((2, 11, 3), (3, 3, 2))),
    (_conv_with(window_strides=(3,), padding=((0, 4),), dimension_numbers=("NCW", "OIW", "NCW")),
     ((1, 2, 7), (3, 2, 2))),  # the strides skip the last padded elements
    (_conv_with(window_strides=(1, 2, 1), padding="SAME", feature_group_count=2,
                dimension_numbers=("NDHWC", "DHWIO", "NDHWC")), ((1, 4, 5, 3, 4), (2, 2, 2, 2, 6))),
    (_conv_with(window_strides=(1, 1), padding=((-1, 2), (1, -1)),
                dimension_numbers=("NHWC", "OIHW", "NCHW")), ((2, 6, 5, 3), (4, 3, 2, 2))),
    (_conv_with(window_strides=(2, 3), padding=((1, 0), (0, 2)), lhs_dilation=(2, 2),
                rhs_dilation=(1, 2), feature_group_count=3,
                dimension_numbers=("NCHW", "HWIO", "NHWC")), ((2, 6, 4, 5), (2, 2, 2, 6))),
    (_conv_with(window_strides=(2, 2), padding=((1, 1), (0, 1)), batch_group_count=2),
     ((4, 3, 5, 5), (4, 3, 3, 3))),
    (_conv_with(window_strides=(1, 2), padding=((2, 0), (1, 1)), lhs_dilation=(2, 1),
                batch_group_count=3, dimension_numbers=("NHWC", "HWIO", "NHWC")),
     ((6, 4, 5, 2), (2, 3, 2, 6))),
]


def _window_sum(*args, **params):
    return lambda x: lax.reduce_window(x, 0.0, lax.add, *args, **params)


@jax.custom_vjp
def _scaled_sin(x):  # a custom_vjp whose bwd is the true derivative
    return jnp.sin(x)


_scaled_sin.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))

SPECS = [
    # elementwise unary
    OpSpec("neg", lambda x: -x, tags=_VARY),
    OpSpec("exp", jnp.exp, tags=_VARY),
    OpSpec("exp2", jnp.exp2),
    OpSpec("log", jnp.log, lo=0.3, hi=3.0, tags=_VARY),
    OpSpec("log1p", jnp.log1p, lo=-0.5, hi=2.0),
    OpSpec("expm1", jnp.expm1),
    OpSpec("tanh", jnp.tanh, tags=_VARY),
    OpSpec("logistic", jax.nn.sigmoid, tags=_VARY),
    OpSpec("sin", jnp.sin, tags=_VARY),
    OpSpec("cos", jnp.cos),
    OpSpec("tan", jnp.tan, lo=-1.0, hi=1.0),
    OpSpec("asin", jnp.arcsin, lo=-0.8, hi=0.8),
    OpSpec("acos", jnp.arccos, lo=-0.8, hi=0.8),
    OpSpec("atan", jnp.arctan),
    OpSpec("sinh", jnp.sinh),
    OpSpec("cosh", jnp.cosh),
    OpSpec("asinh", jnp.arcsinh),
    OpSpec("acosh", jnp.arccosh, lo=1.2, hi=3.0),
    OpSpec("atanh", jnp.arctanh, lo=-0.8, hi=0.8),
    OpSpec("sqrt", jnp.sqrt, lo=0.3, hi=3.0, tags=_VARY),
    OpSpec("rsqrt", lax.rsqrt, lo=0.3, hi=3.0),
    OpSpec("cbrt", jnp.cbrt, lo=0.3, hi=3.0),
    OpSpec("square", jnp.square, tags=_VARY),
    OpSpec("integer_pow", lambda x: x**3, tags=_VARY),
    OpSpec("integer_pow", lambda x: lax.integer_pow(x, -2), lo=0.5, hi=2.0),
    OpSpec("abs", jnp.abs, lo=0.1, hi=2.0),
    OpSpec("sign", lambda x: jnp.sign(x) * x, lo=0.1, hi=2.0),
    OpSpec("floor", lambda x: jnp.floor(x) + x, lo=0.1, hi=0.9),
    OpSpec("erf", jax.scipy.special.erf, tags=_VARY),
    OpSpec("erfc", jax.scipy.special.erfc),
    OpSpec("erf_inv", jax.scipy.special.erfinv, lo=-0.8, hi=0.8),
    OpSpec("lgamma", jax.scipy.special.gammaln, lo=0.5, hi=3.0),
    OpSpec("digamma", jax.scipy.special.digamma, lo=0.5, hi=3.0),
    OpSpec("copy", lambda x: lax.copy_p.bind(x)),
    OpSpec("convert_element_type", lambda x: x.astype(_narrower(x.dtype)).astype(x.dtype).sum(0),
           rtol=1e-2, fd_rtol=1e-2),
    OpSpec("reduce_precision", lambda x: lax.reduce_precision(x, 8, 23), fd_rtol=1e-3),
    OpSpec("name", lambda x: jax.ad_checkpoint.checkpoint_name(x * x, "h")),
    OpSpec("optimization_barrier", lambda x: lax.optimization_barrier((x, 2 * x))[1]),
    # elementwise binary (with rank-0 and size-1 broadcasting through jnp)
    OpSpec("add", lambda x, y: x + y, ((3, 4), (3, 4)), tags=_VARY),
    OpSpec("add", lambda x, y: x + y, ((3, 4), (1, 4))),
    OpSpec("sub", lambda x, y: x - y, ((3, 4), ()), tags=_VARY),
    OpSpec("mul", lambda x, y: x * y, ((3, 4), (3, 1)), tags=_VARY),
    OpSpec("div", lambda x, y: x / y, ((3, 4), (3, 4)), lo=0.5, hi=2.0, tags=_VARY),
    OpSpec("max", jnp.maximum, ((3, 4), (3, 4))),
    OpSpec("min", jnp.minimum, ((3, 4), (3, 4))),
    OpSpec("pow", lambda x, y: x**y, ((3, 4), (3, 4)), lo=0.5, hi=2.0),
    OpSpec("pow", lambda x: lax.pow(x, jnp.int32(3)), lo=0.5, hi=2.0),
    OpSpec("atan2", jnp.arctan2, ((3, 4), (3, 4)), lo=0.5, hi=2.0),
    OpSpec("rem", jnp.fmod, ((3, 4), (3, 4)), lo=0.6, hi=0.9),
    OpSpec("select_n", lambda x, y: jnp.where(x > y, x, y * y), ((3, 4), (3, 4))),
    OpSpec("select_n", lambda x, y, z: lax.select_n((x > 0).astype(jnp.int32) + (y > 0), x, y, z),
           ((3, 4),) * 3),
    OpSpec("clamp", lambda x: lax.clamp(jnp.asarray(-1.0, x.dtype), x, jnp.asarray(1.5, x.dtype))),
    OpSpec("clamp", lambda lo, x: lax.clamp(lo, x, 1.5 * jnp.ones_like(x)), ((3, 4), (3, 4)),
           lo=-1.0, hi=1.0),
    # structural
    OpSpec("broadcast_in_dim", lambda x: jnp.broadcast_to(x[:, None, :], (3, 2, 4)) * 1.5),
    OpSpec("broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (3, 2, 4), (0, 2)),
           ((3, 1),)),
    OpSpec("reshape", lambda x: x.reshape(2, 6) @ jnp.ones((6, 2)), tags=_VARY),
    OpSpec("squeeze", lambda x: jnp.squeeze(x, 1), ((3, 1, 4),)),
    OpSpec("broadcast_in_dim", lambda x: jnp.expand_dims(x, 1), ((3, 4),)),
    OpSpec("transpose", lambda x: jnp.transpose(x, (2, 0, 1)), ((2, 3, 4),)),
    OpSpec("rev", lambda x: jnp.flip(x, (0, 1))),
    OpSpec("slice", lambda x: x[1:, ::2]),
    OpSpec("slice", lambda x: x[:0]),
    OpSpec("pad", lambda x, v: lax.pad(x, v, ((1, -1, 1), (2, 0, 0))), ((3, 4), ())),
    OpSpec("concatenate", lambda x, y: jnp.concatenate([x, y, x], 1), ((3, 4), (3, 2))),
    OpSpec("split", lambda x: jnp.split(x, [1, 3], axis=1)[1]),
    # contractions
    OpSpec("dot_general", lambda x, y: x @ y, ((3, 4), (4, 5)), tags=_VARY),
    OpSpec("dot_general", lambda x, y: jnp.einsum("bij,bkj->bki", x, y), ((2, 3, 4), (2, 5, 4))),
    OpSpec("dot_general", lambda x, y: jnp.einsum("ijb,kbj->bik", x, y), ((3, 4, 2), (5, 2, 4))),
    OpSpec("conv_general_dilated", _conv, ((2, 5, 6, 3), (3, 3, 3, 4))),
    OpSpec("conv_general_dilated", _grouped_conv, ((1, 4, 5, 6), (6, 2, 2, 3))),
    *(OpSpec("conv_general_dilated", fn, shapes) for fn, shapes in _CONVS),
    # indexing
    OpSpec("gather", lambda x: x[_IDX]),
    OpSpec("gather", lambda x: jnp.take_along_axis(x, jnp.array([[0], [3], [1]]), 1)),
    OpSpec("scatter-add", lambda x, u: x.at[_IDX].add(u), ((3, 4), (4, 4))),
    OpSpec("scatter", lambda x, u: x.at[np.array([2, 0])].set(u), ((3, 4), (2, 4))),
    OpSpec("dynamic_slice", lambda x: lax.dynamic_slice(x, (jnp.int32(1), jnp.int32(2)), (2, 2))),
    OpSpec("dynamic_update_slice", lambda x, u: lax.dynamic_update_slice(x, u, (1, 1)),
           ((3, 4), (2, 2))),
    # reductions
    OpSpec("reduce_sum", lambda x: jnp.sum(x, 1), tags=_VARY),
    OpSpec("reduce_max", lambda x: jnp.max(x, 0), tags=_VARY),
    OpSpec("reduce_min", lambda x: jnp.min(x, (0, 1))),
    OpSpec("reduce_prod", lambda x: jnp.prod(x, 1), lo=0.5, hi=1.5),
    OpSpec("argmax", lambda x: x[jnp.argmax(x[:, 0])]),
    OpSpec("cumsum", lambda x: jnp.cumsum(x, 1), tags=_VARY),
    OpSpec("cumsum", lambda x: lax.cumsum(x, 0, reverse=True)),
    OpSpec("cumprod", lambda x: jnp.cumprod(x, 1), lo=0.5, hi=1.5),
    OpSpec("cummax", lambda x: lax.cummax(x, 1)),
    OpSpec("cummin", lambda x: lax.cummin(x, 0, reverse=True)),
    OpSpec("reduce_window_max", lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2),
                                                            (1, 2), "VALID")),
    OpSpec("reduce_window_min", lambda x: lax.reduce_window(x, jnp.inf, lax.min, (2, 3),
                                                            (1, 1), "SAME")),
    OpSpec("reduce_window_sum", lambda x: lax.reduce_window(x, 0.0, lax.add, (2, 2), (2, 1),
                                                            ((1, 0), (0, 1)))),
    OpSpec("reduce_window_sum", _window_sum((3,), (2,), ((1, 3),), base_dilation=(2,),
                                            window_dilation=(2,)), ((7,),)),
    OpSpec("reduce_window_sum", _window_sum((2, 1, 3), (1, 2, 2), "SAME"), ((3, 5, 6),)),
    OpSpec("reduce_window_sum", _window_sum((2, 2), (3, 1), ((-1, 2), (2, -1)),
                                            window_dilation=(1, 2)), ((7, 6),)),
    OpSpec("sort", lambda x: jnp.sort(x, 1)),
    OpSpec("top_k", lambda x: lax.top_k(x, 2)[0]),
    OpSpec("custom_vjp_call", _scaled_sin),
]


def _row_id(spec):
    return f"{spec.op}-{SPECS.index(spec)}"


def _args(spec, dtype, seed=0, shapes=None):
    rng = np.random.default_rng(seed)
    return [rng.uniform(spec.lo, spec.hi, s).astype(dtype) for s in shapes or spec.shapes]


def _vjp_loss(fn):
    return lambda xs, ct: jnp.sum(fn(*xs) * ct)


def _check_row(spec, shapes=None, seed=0):
    """Forward vs jnp and jg.backward vs jax.vjp in float32, with JAX's defaults (x64 off): one
    compile."""
    xs = _args(spec, np.float32, seed, shapes)
    y = jax.eval_shape(spec.fn, *xs)
    ct = np.random.default_rng(seed + 1).standard_normal(y.shape).astype(y.dtype)
    g = jg.trace(_vjp_loss(spec.fn), xs, ct, param_argnums=0)
    assert spec.op in {e.op for e in g.eqns}, f"{spec.op} not in the traced graph"
    gb = jg.check(jg.backward(jg.check(g)))

    def row(xs, ct):
        ours, theirs = as_function(gb)(xs, ct), jax.vjp(spec.fn, *xs)[1](ct)
        return ours, theirs, jnp.sum(spec.fn(*xs) * ct)

    compiled = jax.jit(row).lower(xs, ct).compile(QUICK)
    (value, grads), vjp_ref, value_ref = compiled(xs, ct)
    np.testing.assert_allclose(value, value_ref, rtol=1e-5)  # sums may reassociate
    for got, want in zip(grads, vjp_ref, strict=True):
        np.testing.assert_allclose(got, want, rtol=spec.rtol, atol=spec.rtol)


def _check_row_finite_differences(spec, seed=0):
    """jgraph's float64 gradient along a random direction vs central differences (x64 on)."""
    assert jax.config.jax_enable_x64
    xs64 = _args(spec, np.float64, seed + 2)
    y = jax.eval_shape(spec.fn, *xs64)
    rng = np.random.default_rng(seed + 1)
    ct = rng.standard_normal(y.shape).astype(y.dtype)
    u = [rng.standard_normal(x.shape) for x in xs64]
    gb64 = jg.check(jg.backward(jg.trace(_vjp_loss(spec.fn), xs64, ct, param_argnums=0)))
    eps = 1e-4

    def row(xs64, ct, u):
        loss64 = _vjp_loss(spec.fn)
        plus = loss64([x + eps * d for x, d in zip(xs64, u, strict=True)], ct)
        minus = loss64([x - eps * d for x, d in zip(xs64, u, strict=True)], ct)
        grads64 = as_function(gb64)(xs64, ct)[1]
        directional = sum(jnp.vdot(a, d) for a, d in zip(grads64, u, strict=True))
        return directional, (plus - minus) / (2 * eps)

    directional, numeric = jax.jit(row).lower(xs64, ct, u).compile(QUICK)(xs64, ct, u)
    np.testing.assert_allclose(directional, numeric, rtol=spec.fd_rtol, atol=spec.fd_rtol / 10)


@pytest.mark.parametrize("spec", SPECS, ids=_row_id)
def test_op_row(spec):
    _check_row(spec)


@pytest.mark.f64
@pytest.mark.parametrize("spec", SPECS, ids=_row_id)
def test_op_row_finite_differences(spec):
    _check_row_finite_differences(spec)


_TRANSPOSED = [s for s in SPECS if s.op in ("conv_general_dilated", "reduce_window_sum")]


@pytest.mark.parametrize("spec", _TRANSPOSED, ids=_row_id)
def test_windowed_gradients_bitwise_equal_jax(spec):
    """The rules emit the convolutions/windowed sums JAX's transposes emit: same bits in f32."""
    xs = _args(spec, np.float32, seed=4)
    ct = np.random.default_rng(5).standard_normal(jax.eval_shape(spec.fn, *xs).shape)
    ct = ct.astype(np.float32)
    gb = jg.backward(jg.trace(_vjp_loss(spec.fn), xs, ct, param_argnums=0))
    ours = jax.jit(as_function(gb)).lower(xs, ct).compile(QUICK)(xs, ct)[1]
    theirs = jax.jit(lambda xs, ct: jax.vjp(spec.fn, *xs)[1](ct)).lower(xs, ct).compile(QUICK)
    for got, want in zip(ours, theirs(xs, ct), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.f64
def test_check_grads_on_op_rows():
    for spec in (SPECS[0], SPECS[-1]):  # jg.testing.check_grads itself, on a plain and a custom op
        jg.testing.check_grads(spec.fn, _args(spec, np.float64, seed=3), order=2)


_VARYING = [s for s in SPECS if "shapes" in s.tags]


@st.composite
def _shapes(draw, spec):
    """Shapes like the row's, each dim resized (dims equal across inputs stay equal)."""
    sizes = {}
    out = []
    for shape in spec.shapes:
        out.append(tuple(sizes.setdefault(d, draw(st.integers(1, 5))) if d > 1 else d
                         for d in shape))
    return out


@given(st.sampled_from(_VARYING).flatmap(lambda s: st.tuples(st.just(s), _shapes(s))),
       st.integers(0, 2**16))
def test_op_row_varied(spec_shapes, seed):
    spec, shapes = spec_shapes
    if spec.op == "reshape":  # its row reshapes to (2, 6)
        shapes = [(3, 4)]
    _check_row(spec, shapes, seed)


def test_reduce_max_ties_split_evenly_as_jax():
    x = jnp.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], jnp.float32)
    gb = jg.backward(jg.trace(lambda x: jnp.sum(jnp.max(x, 1) * jnp.array([1.0, 3.0])), x,
                              param_argnums=0))
    grad = jg.compile(gb)(x)[1]
    np.testing.assert_array_equal(grad, [[0.0, 0.5, 0.5], [1.0, 1.0, 1.0]])
    np.testing.assert_array_equal(grad, jax.grad(lambda x: jnp.sum(jnp.max(x, 1) *
                                                                   jnp.array([1.0, 3.0])))(x))


def test_max_ties_split_evenly_as_jax():
    x = jnp.array([1.0, 2.0, 3.0], jnp.float32)
    f = lambda x: jnp.sum(jnp.maximum(x, 2.0))
    grad = jg.compile(jg.backward(jg.trace(f, x, param_argnums=0)))(x)[1]
    np.testing.assert_array_equal(grad, [0.0, 0.5, 1.0])
    np.testing.assert_array_equal(grad, jax.grad(f)(x))


# The op set of the backward issue (and of the foundation's tracer).
OP_SET = sorted({s.op for s in SPECS} | {
    "add_any", "stop_gradient", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "iota",
    "argmin", "is_finite", "ceil", "round", "select_and_scatter_add", "reduce_and", "reduce_or",
    "bitcast_convert_type", "nextafter", "shift_left", "population_count"})


@pytest.mark.parametrize("op", OP_SET)
def test_registry_complete(op):
    assert op in ops.shape_rules, f"no shape rule for {op}"
    assert op in ops.lowerings, f"no lowering for {op}"
    assert op in vjp_rules.vjp_rules or op in vjp_rules.NON_DIFFERENTIABLE, \
        f"{op}: no VJP rule, not marked"


def test_every_registered_op_is_differentiable_or_says_why_not():
    """Every op in the shape-rule table has a lowering and a VJP rule, or is non-differentiable
    (zero gradient, as in JAX), or is in the documented NO_VJP_RULE set."""
    for op in ops.shape_rules:
        assert op in ops.lowerings, f"{op}: a shape rule but no lowering"
        kinds = [op in vjp_rules.vjp_rules or op in vjp_rules.loops.TRANSPOSED,
                 op in vjp_rules.NON_DIFFERENTIABLE | vjp_rules.CUTS_GRADIENT,
                 op in vjp_rules.NO_VJP_RULE]
        assert sum(kinds) == 1, f"{op}: rule / non-differentiable / NO_VJP_RULE = {kinds}"


@pytest.mark.parametrize("op", sorted(vjp_rules.NO_VJP_RULE))
def test_an_op_without_a_rule_on_the_gradient_path_is_an_error_saying_why(op):
    from jgraph.builder import Builder

    aval = jax.core.ShapedArray((2,), np.dtype("float32"))
    eqn = jg.Eqn(op, (jg.Var(aval),), {}, (jg.Var(aval),), source="model.py:7 (f)")
    with pytest.raises(jg.TransformError, match=rf"no VJP rule for op '{op}': .+ at model.py:7"):
        vjp_rules.apply_rule(Builder(), eqn, [eqn.outputs[0]])


def test_special_function_without_a_rule_fails_at_the_users_line():
    f = lambda a: jnp.sum(jax.scipy.special.gammainc(a, 2.0))
    with pytest.raises(jg.TransformError, match=r"'igamma': special function .*test_ops.py:\d+"):
        jg.backward(jg.trace(f, jnp.ones(3), param_argnums=0))
