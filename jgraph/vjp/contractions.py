"""VJP rules of contractions: `dot_general` (with batch dims) and `conv_general_dilated`.

`dot_general`'s rule contracts the cotangent with the other operand and permutes the result into
the operand's layout, as JAX's transpose does (same dot, same order: bitwise equal gradients).
The convolution's cotangents are convolutions again; their padding/dilation algebra is long and
easy to get wrong, so the rule emits them through JAX's own transpose helpers.
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax
from jax._src.interpreters import ad
from jax._src.lax import convolution

from jgraph.vjp import defvjp


def _dot_transpose(ct, other, self_ndim, self_c, other_c, self_b, other_b, ct_other_free,
                   other_free, dtype, precision, preferred):
    """Cotangent of one dot_general operand: contract ct with the other operand, then permute."""
    nb = len(self_b)
    dims = ((tuple(ct_other_free), tuple(other_free)), (tuple(range(nb)), tuple(other_b)))
    r = lax.dot_general(ct, other, dims, precision=precision, preferred_element_type=preferred)
    # r's dims: batch, self free (as in ct), then self's contracting dims sorted by other's.
    self_free = [d for d in range(self_ndim) if d not in self_c and d not in self_b]
    self_c_by_other = [self_c[i] for i in np.argsort(other_c)]
    src = list(self_b) + self_free + self_c_by_other
    r = lax.transpose(r, tuple(int(i) for i in np.argsort(src)))
    return r if r.dtype == dtype else r.astype(dtype)


def _dot_general_vjp(cts, ins, outs, *, dimension_numbers, precision=None,
                     preferred_element_type=None, **_):
    (xc, yc), (xb, yb) = dimension_numbers
    x, y = ins
    ct = cts[0]
    nb = len(xb)
    x_free = [d for d in range(x.ndim) if d not in xc and d not in xb]
    y_free = [d for d in range(y.ndim) if d not in yc and d not in yb]
    ct_x_free = range(nb, nb + len(x_free))
    ct_y_free = range(nb + len(x_free), nb + len(x_free) + len(y_free))
    dx = _dot_transpose(ct, y, x.ndim, list(xc), list(yc), xb, yb, ct_y_free, y_free, x.dtype,
                        precision, preferred_element_type)
    dy = _dot_transpose(ct, x, y.ndim, list(yc), list(xc), yb, xb, ct_x_free, x_free, y.dtype,
                        precision, preferred_element_type)
    return [dx, dy]


defvjp("dot_general", _dot_general_vjp)


def _conv_general_dilated_vjp(cts, ins, outs, **params):
    (ct,), (lhs, rhs) = cts, ins
    undefined = ad.UndefinedPrimal
    ct_lhs = convolution._conv_general_dilated_transpose_lhs(
        ct, undefined(jax.typeof(lhs)), rhs, **params)
    ct_rhs = convolution._conv_general_dilated_transpose_rhs(
        ct, lhs, undefined(jax.typeof(rhs)), **params)
    return [ct_lhs, ct_rhs]


defvjp("conv_general_dilated", _conv_general_dilated_vjp)
