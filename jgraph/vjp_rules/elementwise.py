"""VJP rules of elementwise ops (unary, binary, select_n, clamp, complex parts), with JAX's
formulas.

Each rule is written as JAX's JVP rule transposed, operation for operation, so that jgraph's
gradients agree with `jax.vjp` bitwise on the same backend. Complex values follow JAX's
convention: a rule transposes the (real-)linear JVP without conjugating, so `mul`'s cotangent is
`ct * y` for complex `y` too, and a cotangent always has its input's dtype (`real`'s is complex).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from jgraph.backward import (
    defbinary,
    defunary,
    defvjp,
    unbroadcast,
    undifferentiable_inputs,
)

# -- identities ----------------------------------------------------------------------------------
for _op in ("copy", "copy_p", "name"):
    defunary(_op, lambda ct, x, y: ct)


def _reduce_precision_vjp(cts, ins, outs, **params):
    return [lax.reduce_precision_p.bind(cts[0], **params)]  # linear: JAX rounds the ct too


defvjp("reduce_precision", _reduce_precision_vjp)


def _convert_element_type_vjp(ct, x, y):
    if jnp.iscomplexobj(ct) and not jnp.iscomplexobj(x):  # the conversion kept the real part
        ct = lax.real(ct)
    return lax.convert_element_type(ct, x.dtype)


defunary("convert_element_type", _convert_element_type_vjp)


def _identities_vjp(cts, ins, outs, **_):
    return list(cts)


defvjp("optimization_barrier", _identities_vjp)
defvjp("device_put", _identities_vjp)  # variadic too: jax.device_put((x, y))

# -- unary ---------------------------------------------------------------------------------------
defunary("neg", lambda ct, x, y: -ct)
defunary("exp", lambda ct, x, y: ct * y)
defunary("exp2", lambda ct, x, y: (math.log(2) * ct).astype(ct.dtype) * y)
defunary("log", lambda ct, x, y: ct / x)
defunary("log1p", lambda ct, x, y: ct / (x + 1))
defunary("expm1", lambda ct, x, y: ct * (y + 1))
defunary("logistic", lambda ct, x, y: ct * (y * (1 - y)))
defunary("sin", lambda ct, x, y: ct * jnp.cos(x))
defunary("cos", lambda ct, x, y: -ct * jnp.sin(x))
defunary("tan", lambda ct, x, y: ct * (1 + jnp.square(y)))
defunary("asin", lambda ct, x, y: ct * lax.rsqrt(1 - jnp.square(x)))
defunary("acos", lambda ct, x, y: ct * -lax.rsqrt(1 - jnp.square(x)))
defunary("atan", lambda ct, x, y: ct / (1 + jnp.square(x)))
defunary("sinh", lambda ct, x, y: ct * jnp.cosh(x))
defunary("cosh", lambda ct, x, y: ct * jnp.sinh(x))
defunary("asinh", lambda ct, x, y: ct * lax.rsqrt(jnp.square(x) + 1))
defunary("acosh", lambda ct, x, y: ct * lax.rsqrt((x - 1) * (x + 1)))
defunary("atanh", lambda ct, x, y: ct / ((1 - x) * (1 + x)))
defunary("sqrt", lambda ct, x, y: ct * (0.5 / y))
defunary("rsqrt", lambda ct, x, y: ct * (-0.5 * (y / x)))
defunary("cbrt", lambda ct, x, y: ct * ((1 / 3) * lax.integer_pow(y, -2)))
defunary("square", lambda ct, x, y: ct * (2 * x))


def _abs_vjp(ct, x, y):
    if jnp.iscomplexobj(x):  # d|z| = real(conj(z) / |z| * dz), transposed
        safe = jnp.where(y == 0, jnp.ones_like(y), y).astype(x.dtype)
        return lax.complex(ct, jnp.zeros_like(ct)) * (lax.conj(x) / safe)
    return jnp.where(x >= 0, ct, -ct)


defunary("abs", _abs_vjp)
defunary("erf", lambda ct, x, y: (2 / math.sqrt(math.pi) * ct) * jnp.exp(-jnp.square(x)))
defunary("erfc", lambda ct, x, y: (-2 / math.sqrt(math.pi) * ct) * jnp.exp(-jnp.square(x)))
defunary("erf_inv", lambda ct, x, y: ct * (math.sqrt(math.pi) / 2 * jnp.exp(jnp.square(y))))
defunary("lgamma", lambda ct, x, y: ct * lax.digamma(x))
defunary("digamma", lambda ct, x, y: ct * lax.polygamma(jnp.ones_like(x), x))
defunary("bessel_i0e", lambda ct, x, y: ct * (lax.bessel_i1e(x) - jnp.sign(x) * y))


def _bessel_i1e_vjp(ct, x, y):
    """i1e' = i0e - y (sign(x) + 1/x), whose limit at 0 is 1/2 (JAX's guard for tiny x)."""
    eps = jnp.finfo(x.dtype).eps
    not_tiny = jnp.abs(x) > eps
    safe_x = jnp.where(not_tiny, x, jnp.full_like(x, eps))
    slope = lax.bessel_i0e(safe_x) - y * (jnp.sign(safe_x) + 1 / safe_x)
    return ct * jnp.where(not_tiny, slope, jnp.full_like(x, 0.5))


defunary("bessel_i1e", _bessel_i1e_vjp)


def _polygamma_vjp(cts, ins, outs, **_):
    (ct,), (m, x) = cts, ins
    return [None, unbroadcast(ct * lax.polygamma(m + jnp.ones_like(m), x), x)]


defvjp("polygamma", _polygamma_vjp)
undifferentiable_inputs["polygamma"] = lambda n_in, params: (0,)  # JAX: no gradient in m

# -- complex parts (linear over the reals) --------------------------------------------------------
defunary("real", lambda ct, x, y: lax.complex(ct, jnp.zeros_like(ct)))
defunary("imag", lambda ct, x, y: lax.complex(jnp.zeros_like(ct), -ct))


def _conj_vjp(cts, ins, outs, *, input_dtype):
    (ct,), (x,) = cts, ins
    return [lax.conj(ct) if jnp.iscomplexobj(x) else lax.real(ct)]


defvjp("conj", _conj_vjp)
defbinary("complex", lambda ct, x, y, z: (lax.real(ct), -lax.imag(ct)))


def _tanh_vjp(ct, x, y):
    t = ct * (1 - y)  # JAX's jvp is (g + g*y) * (1 - y); transposed, it reads:
    return t + t * y


defunary("tanh", _tanh_vjp)


def _integer_pow_vjp(cts, ins, outs, *, y):
    (ct,), (x,) = cts, ins
    if y == 0:
        return [jnp.zeros_like(ct)]
    if y == 1:
        return [ct]
    if y == 2:
        return [ct * (2 * x)]
    return [ct * (y * lax.integer_pow(x, y - 1))]


defvjp("integer_pow", _integer_pow_vjp)

# -- binary --------------------------------------------------------------------------------------
defbinary("add", lambda ct, x, y, z: (ct, ct))
defbinary("add_any", lambda ct, x, y, z: (ct, ct))
defbinary("sub", lambda ct, x, y, z: (ct, -ct))


def _mul_vjp(cts, ins, outs, *, out_dtype=None):
    """With `out_dtype`, the products are taken back to each input's dtype, as JAX does."""
    (ct,), (x, y) = cts, ins
    if out_dtype is None:
        return [unbroadcast(ct * y, x), unbroadcast(x * ct, y)]
    return [unbroadcast(lax.mul(ct, y, out_dtype=x.dtype), x),
            unbroadcast(lax.mul(x, ct, out_dtype=y.dtype), y)]


defvjp("mul", _mul_vjp)
defbinary("div", lambda ct, x, y, z: (ct / y, -((ct * lax.integer_pow(y, -2)) * x)))
defbinary("atan2", lambda ct, x, y, z: (ct * (y / (jnp.square(x) + jnp.square(y))),
                                        ct * -x / (jnp.square(x) + jnp.square(y))))
defbinary("rem", lambda ct, x, y, z: (
    ct, -ct * (jnp.sign(x / y) * jnp.floor(jnp.abs(x / y)))))


def _balanced_eq(x, z, y):
    """1 where x is the result z, 0.5 where both x and y are (JAX splits ties evenly)."""
    one, zero, two = jnp.ones_like(z), jnp.zeros_like(z), jnp.full_like(z, 2)
    return jnp.where(x == z, one, zero) / jnp.where(y == z, two, one)


def _chooser_vjp(ct, x, y, z):
    return ct * _balanced_eq(x, z, y), ct * _balanced_eq(y, z, x)


defbinary("max", _chooser_vjp)
defbinary("min", _chooser_vjp)


def _pow_vjp(cts, ins, outs, **_):
    (ct,), (x, y), (z,) = cts, ins, outs
    if jnp.issubdtype(y.dtype, jnp.integer):
        yf = jnp.broadcast_to(y.astype(x.dtype), z.shape)
        xb = jnp.broadcast_to(x, z.shape)
        jac = jnp.where(yf == 0, jnp.zeros_like(yf),
                        jnp.where(yf == 0, 1, yf) * lax.pow(xb, yf - jnp.ones_like(yf)))
        return [unbroadcast(ct * jac, x), None]
    ct_x = ct * (y * lax.pow(x, y - jnp.ones_like(y)))
    ct_y = ct * (jnp.log(jnp.where(x == 0, jnp.ones_like(x), x)) * z)
    return [unbroadcast(ct_x, x), unbroadcast(ct_y, y)]


defvjp("pow", _pow_vjp)


# -- selection -----------------------------------------------------------------------------------
def _select_n_vjp(cts, ins, outs, **_):
    (ct,), (which, *cases) = cts, ins
    zeros = jnp.zeros_like(ct)
    if which.dtype == jnp.bool_:
        return [None, lax.select(which, zeros, ct), lax.select(which, ct, zeros)]
    return [None] + [lax.select(which == i, ct, zeros) for i in range(len(cases))]


defvjp("select_n", _select_n_vjp)


def _clamp_vjp(cts, ins, outs, **_):
    (ct,), (lo, x, hi) = cts, ins
    zeros = jnp.zeros_like(ct)
    ct_lo = jnp.where((lo > x) & (lo < hi), ct, zeros)
    ct_x = jnp.where((x > lo) & (x < hi), ct, zeros)
    ct_hi = jnp.where(hi < x, ct, zeros)
    return [unbroadcast(ct_lo, lo), ct_x, unbroadcast(ct_hi, hi)]


defvjp("clamp", _clamp_vjp)
