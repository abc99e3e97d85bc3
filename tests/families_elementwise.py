"""Gradient families of elementwise ops: JAX's LAX_GRAD_OPS (unary and binary ops over its
compatible shapes, float and complex where JAX differentiates them), its special values, `mul`
with `out_dtype`, clamp, select, conversions, identities, and complex intermediates."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core.primitives import add_jaxvals_p
from op_families import COMPLEX, ISSUE_TAG, REAL, Arg, Case

RC = (REAL, COMPLEX)
COMPATIBLE_SHAPES = [[(3,)], [(), (3, 4), (3, 1), (1, 4)], [(2, 3, 4), (2, 1, 4)]]
SHAPES = [s for group in COMPATIBLE_SHAPES for s in group]
SHAPE_PAIRS = [p for group in COMPATIBLE_SHAPES
               for p in itertools.combinations_with_replacement(group, 2)]

# op, function, sampler, dtype kinds, extra Case fields
UNARY = [
    ("neg", lax.neg, "default", RC, {}),
    ("floor", lax.floor, (0.1, 0.4), (REAL,), {}),
    ("ceil", lax.ceil, (0.1, 0.4), (REAL,), {}),
    ("round", lax.round, (0.1, 0.4), (REAL,), {}),
    ("sign", lax.sign, "nonzero", (REAL,), {}),
    ("exp", lax.exp, "small", RC, {}),
    ("exp2", lax.exp2, "small", RC, {}),
    ("expm1", lax.expm1, "default", RC, {}),
    ("log", lax.log, "positive", RC, {}),
    ("log1p", lax.log1p, "positive", RC, {}),
    ("sinh", lax.sinh, "default", RC, {}),
    ("cosh", lax.cosh, "default", RC, {}),
    ("tanh", lax.tanh, "default", RC, {}),
    ("sin", lax.sin, "default", RC, {}),
    ("cos", lax.cos, "default", RC, {}),
    ("tan", lax.tan, (-1.3, 1.3), RC, {"fd_tol": 1e-4}),
    ("asin", lax.asin, (-0.8, 0.8), (REAL,), {}),
    ("acos", lax.acos, (-0.8, 0.8), (REAL,), {}),
    ("atan", lax.atan, "default", (REAL,), {}),
    ("asinh", lax.asinh, "default", (REAL,), {}),
    ("acosh", lax.acosh, (1.2, 3.0), (REAL,), {}),
    ("atanh", lax.atanh, (-0.8, 0.8), (REAL,), {}),
    ("erf", lax.erf, "small", (REAL,), {}),
    ("erfc", lax.erfc, "small", (REAL,), {}),
    ("erf_inv", lax.erf_inv, (-0.8, 0.8), (REAL,), {}),
    ("lgamma", lax.lgamma, (0.5, 3.0), (REAL,), {}),
    ("digamma", lax.digamma, (0.5, 3.0), (REAL,), {"fd_tol": 1e-4}),
    ("bessel_i0e", lax.bessel_i0e, "default", (REAL,), {}),
    ("bessel_i1e", lax.bessel_i1e, "default", (REAL,), {}),
    ("real", lax.real, "default", (COMPLEX,), {}),
    ("imag", lax.imag, "default", (COMPLEX,), {}),
    ("conj", lax.conj, "default", RC, {}),
    ("abs", lax.abs, "nonzero", RC, {}),
    ("sqrt", lax.sqrt, "positive", RC, {}),
    ("rsqrt", lax.rsqrt, "positive", RC, {}),
    ("cbrt", lax.cbrt, "nonzero", (REAL,), {}),
    ("logistic", lax.logistic, "default", RC, {}),
    ("square", lax.square, "default", RC, {}),
    ("copy", jnp.copy, "default", RC, {}),
]
for _y in (0, 1, 2, 3, -2, 5):
    UNARY.append(("integer_pow", lambda x, y=_y: lax.integer_pow(x, y), "nonzero", RC,
                  {"family": f"integer_pow/{_y}"}))


def _unary_cases():
    cases = []
    for op, fn, kind, kinds, extra in UNARY:
        extra = dict(extra)
        family = extra.pop("family", op)
        for shape in SHAPES:
            cases.append(Case(family, str(shape), fn, (Arg(shape, kind),), (op,), kinds, **extra))
    return cases


# JAX's LAX_GRAD_SPECIAL_VALUE_TESTS: derivatives at points of interest.
SPECIAL_VALUES = [("sinh", lax.sinh, [0.0]), ("cosh", lax.cosh, [0.0]),
                  ("tanh", lax.tanh, [0.0, 1000.0]),
                  ("sin", lax.sin, [0.0, np.pi, np.pi / 2, np.pi / 4]),
                  ("cos", lax.cos, [0.0, np.pi, np.pi / 2, np.pi / 4]),
                  ("tan", lax.tan, [0.0]), ("asin", lax.asin, [0.0]), ("acos", lax.acos, [0.0]),
                  ("atan", lax.atan, [0.0, 1000.0]), ("erf", lax.erf, [0.0, 10.0]),
                  ("erfc", lax.erfc, [0.0, 10.0]), ("bessel_i1e", lax.bessel_i1e, [0.0]),
                  ("bessel_i0e", lax.bessel_i0e, [0.5])]


def _special_value_cases():
    # i1e(x) = x/2 - x|x|/2 + ... at 0: a central difference is off by eps/2, so a smaller step
    return [Case(f"special/{op}", str(v), fn, (Arg((), ("at", v)),), (op,),
                 eps=1e-7 if op == "bessel_i1e" else 1e-4)
            for op, fn, values in SPECIAL_VALUES for v in values]


def _not_small(shape):
    return Arg(shape, "nonzero")


# op, function, samplers of x and y, kinds, extra
BINARY = [
    ("add", lax.add, ("default", "default"), RC, {}),
    ("sub", lax.sub, ("default", "default"), RC, {}),
    ("mul", lax.mul, ("default", "default"), RC, {}),
    ("div", lax.div, ("nonzero", "nonzero"), RC, {"order": 1}),  # JAX: order 1
    ("max", lax.max, ("unique", "unique"), (REAL,), {}),
    ("min", lax.min, ("unique", "unique"), (REAL,), {}),
    ("pow", lax.pow, ("positive", "positive"), RC, {"rtol": 1e-4}),
    ("atan2", lax.atan2, ("nonzero", "nonzero"), (REAL,), {}),
    ("rem", lax.rem, ((-9.0, 9.0), "nonzero"), (REAL,), {}),
    ("complex", lax.complex, ("default", "default"), (REAL,), {}),
    ("add_any", add_jaxvals_p.bind, ("default", "default"), RC, {"same_shape": True}),
]


def _binary_cases():
    cases = []
    for op, fn, (kx, ky), kinds, extra in BINARY:
        extra = dict(extra)
        same_shape = extra.pop("same_shape", False)
        for sx, sy in SHAPE_PAIRS:
            if same_shape and sx != sy:
                continue
            cases.append(Case(op, f"{sx}x{sy}", fn, (Arg(sx, kx), Arg(sy, ky)), (op,), kinds,
                              **extra))
    return cases


def _polygamma_cases():
    m = np.array([0.0, 1.0, 2.0, 3.0])
    return [Case("polygamma", f"m{shape}", lambda x: lax.polygamma(m.astype(x.dtype), x),
                 (Arg(shape, (0.5, 3.0)),), ("polygamma",), fd_tol=1e-4) for shape in [(4,)]]


NARROW = [jnp.bfloat16, jnp.float16, jnp.float32]


def _mul_out_dtype_cases():
    """JAX's testOpGradOutDtype: lhs, rhs and out dtypes among the float types."""
    cases = []
    for lhs, rhs, out in itertools.product(NARROW, NARROW, NARROW):
        for sx, sy in [((3,), (3,)), ((3, 4), (3, 1)), ((), (3, 4))]:
            narrow = np.finfo(lhs).bits < 32 or np.finfo(rhs).bits < 32 \
                or np.finfo(out).bits < 32
            cases.append(Case(
                "mul/out_dtype", f"{np.dtype(lhs).name}*{np.dtype(rhs).name}->"
                f"{np.dtype(out).name}:{sx}x{sy}",
                lambda x, y, out=out: lax.mul(x, y, out_dtype=out),
                (Arg(sx, dtype=lhs), Arg(sy, dtype=rhs)), ("mul",), order=0,
                tags=ISSUE_TAG if (lhs, rhs, out, sx) == (NARROW[0], NARROW[0], NARROW[2], (3,))
                else frozenset(),
                rtol=2e-2 if narrow else 1e-5,
                why_no_fd="fixed narrow dtypes; the float64 form is plain mul"))
    return cases


def _clamp_cases():
    """JAX's testClampGrad: the operand inside, below and above the bounds (each argument in
    turn gets the gradient), bounds scalar or full."""
    cases = []
    for shape in [(), (2, 3)]:
        for bounds in {(), shape}:
            low, mid, high = Arg(bounds, (-12.0, -8.0)), Arg(shape, "default"), \
                Arg(bounds, (8.0, 12.0))
            # JAX's rule selects between a scalar bound's cotangent and a full-shaped zero
            fails = "select cases must have the same shapes" if bounds != shape else ""
            cases += [
                Case("clamp", f"inside{shape}{bounds}", lax.clamp, (low, mid, high), ("clamp",),
                     jax_fails=fails),
                Case("clamp", f"below{shape}{bounds}",
                     lambda lo, hi, x: lax.clamp(lo, x - 20, hi), (low, high, mid), ("clamp",),
                     jax_fails=fails),
                Case("clamp", f"above{shape}{bounds}",
                     lambda lo, hi, x: lax.clamp(lo, x + 20, hi), (low, high, mid), ("clamp",),
                     jax_fails=fails),
            ]
    return cases


def _select_cases():
    """JAX's testSelectGrad (predicate scalar or full), and select_n over three cases."""
    cases = []
    for arg_shape in [(), (3,), (2, 3)]:
        for pred_shape in ([(), arg_shape] if arg_shape else [()]):
            pred = np.random.default_rng(len(arg_shape)).uniform(size=pred_shape) > 0.5
            cases.append(Case("select_n", f"{pred_shape}{arg_shape}",
                              lambda x, y, pred=pred: lax.select(pred, x, y),
                              (Arg(arg_shape), Arg(arg_shape)), ("select_n",), RC))
    which = np.array([[0, 2, 1], [1, 0, 2]], np.int32)
    cases.append(Case("select_n", "which3", lambda x, y, z: lax.select_n(which, x, y, z),
                      (Arg((2, 3)),) * 3, ("select_n",), RC))
    return cases


def _to(kind):
    """A conversion to the float or complex type of the argument's width."""
    def convert(x):
        wide = x.dtype in (np.float64, np.complex128)
        target = {"float": (np.float32, np.float64), "complex": (np.complex64, np.complex128)}
        return lax.convert_element_type(x, target[kind][wide]) * 1.5
    return convert


def _conversion_cases():
    """JAX's testConvertElementTypeGrad (float <-> complex, narrowing), reduce_precision."""
    cases = [
        Case("convert_element_type", "to_complex", _to("complex"), (Arg((2, 3)),),
             ("convert_element_type",)),
        Case("convert_element_type", "to_float", _to("float"), (Arg((2, 3)),),
             ("convert_element_type",), (COMPLEX,)),
        Case("convert_element_type", "to_bfloat16",
             lambda x: lax.convert_element_type(x, jnp.bfloat16), (Arg((2, 3)),),
             ("convert_element_type",), order=0, rtol=1e-2,
             why_no_fd="a bfloat16 output has 8 bits of mantissa"),
        Case("convert_element_type", "from_float16", lambda x: x.astype(jnp.float32) ** 2,
             (Arg((2, 3), dtype=jnp.float16),), ("convert_element_type",), order=0, rtol=1e-2,
             why_no_fd="a float16 input has 11 bits of mantissa"),
        Case("reduce_precision", "lossless",
             lambda x: lax.reduce_precision(x, *_full_precision(x)), (Arg((2, 3)),),
             ("reduce_precision",)),
        Case("reduce_precision", "bf16-like", lambda x: lax.reduce_precision(x, 8, 7),
             (Arg((2, 3)),), ("reduce_precision",), order=0,
             why_no_fd="rounding to 8 bits: the function is a staircase at the difference step"),
    ]
    return cases


def _full_precision(x):
    return (11, 52) if jnp.finfo(x.dtype).bits == 64 else (8, 23)


@jax.custom_vjp
def _sin_with_rule(x):
    return jnp.sin(x)


_sin_with_rule.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (g * c,))


def _identity_cases():
    return [
        Case("optimization_barrier", "pair", lambda x, y: lax.optimization_barrier((x * y, y)),
             (Arg((3,)), Arg((3,))), ("optimization_barrier",)),
        Case("name", "checkpoint_name",
             lambda x: jax.ad_checkpoint.checkpoint_name(x * x, "h"), (Arg((3,)),), ("name",)),
        Case("device_put", "one", lambda x: jax.device_put(x) * x, (Arg((3,)),),
             ("device_put",)),
        Case("device_put", "two", lambda x, y: jax.device_put((x * y, y)),
             (Arg((3,)), Arg((3,))), ("device_put",)),
        Case("stop_gradient", "half", lambda x: lax.stop_gradient(x) * x, (Arg((3,)),),
             ("stop_gradient",), order=0,
             why_no_fd="stop_gradient is, by design, not the derivative of what it computes"),
        Case("custom_vjp_call", "sin", _sin_with_rule, (Arg((3, 2)),), ("custom_vjp_call",)),
        Case("custom_jvp_call", "relu", jax.nn.relu, (Arg((3, 2), "nonzero"),),
             ("custom_jvp_call",)),
        Case("custom_jvp_call", "logaddexp", jnp.logaddexp, (Arg((3, 2)), Arg((3, 2))),
             ("custom_jvp_call",)),
        Case("custom_jvp_call", "relu at 0", jax.nn.relu, (Arg((3,), ("at", 0.0)),),
             ("custom_jvp_call",), order=0,
             why_no_fd="relu'(0) is a convention (the custom_jvp rule's, checked against JAX)"),
    ]


def _complex_intermediate_cases():
    """Real parameters, complex values inside, a real result (as users write them)."""
    def z(x, y):
        return lax.complex(x, y)

    programs = {
        "abs": (lambda x, y: jnp.abs(z(x, y) * (1 - 2j)), ("abs", "complex", "mul")),
        "exp_real": (lambda x, y: jnp.real(jnp.exp(z(x, y)) * (0.5 + 1j)), ("exp", "real")),
        "angle": (lambda x, y: jnp.angle(z(x, y)), ("atan2", "imag", "real")),
        "norm2": (lambda x, y: jnp.real(z(x, y) * jnp.conj(z(x, y))), ("conj", "real")),
        "cube_imag": (lambda x, y: jnp.imag(z(x, y) ** 3), ("integer_pow", "imag")),
        "matmul": (lambda x, y: jnp.abs(z(x, y) @ z(y, x).T), ("dot_general", "abs")),
        "from_real": (lambda x, y: jnp.abs(x.astype(jnp.result_type(x, jnp.complex64)) * 1j + y),
                      ("convert_element_type", "abs")),
        "sqrt_log": (lambda x, y: jnp.real(jnp.sqrt(z(x, y)) + jnp.log(z(x, y))),
                     ("sqrt", "log")),
    }
    return [Case("complex_intermediate", name, fn, (Arg((3, 3), "positive"), Arg((3, 3))), ops,
                 tags=ISSUE_TAG) for name, (fn, ops) in programs.items()]


def cases():
    return (_unary_cases() + _special_value_cases() + _binary_cases() + _polygamma_cases()
            + _mul_out_dtype_cases() + _clamp_cases() + _select_cases() + _conversion_cases()
            + _identity_cases() + _complex_intermediate_cases())
