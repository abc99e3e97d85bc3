"""VJP rules of contractions: `dot_general` (with batch dims) and `conv_general_dilated`.

`dot_general`'s rule contracts the cotangent with the other operand and permutes the result into
the operand's layout, as JAX's transpose does (same dot, same order: bitwise equal gradients).
The convolution's cotangents are convolutions again: for the input, the cotangent against the
flipped kernel (strides become input dilation, input dilation becomes strides); for the kernel, the
input against the cotangent (strides become window dilation, window dilation becomes strides),
batch and features swapped. Feature groups and batch groups trade places between the two.
These are the convolutions JAX's transpose emits, so the gradients agree bitwise.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jgraph.backward import defvjp


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


def dilated(n, d):
    """Size of a length-`n` axis with `d - 1` zeros put between neighbours."""
    return 0 if n == 0 else (n - 1) * d + 1


def transposed_window_padding(in_size, window, stride, out_size, padding, in_dilation,
                              window_dilation):
    """Padding of the stride-dilated cotangent that makes a window sweep over it give back the
    (dilated) input: the transpose of one windowed axis (convolution or reduce_window).

    Forward, out[o] reads in_padded[o*stride + k*window_dilation] with in_padded[p] =
    in_dilated[p - lo]. Flipping the window, the input element at q collects the cotangent at
    dilated position q + lo - (dilated window - 1) + k*window_dilation, so the cotangent gets
    `dilated window - 1 - lo` in front and enough behind for in_dilated's last element.
    """
    lo = dilated(window, window_dilation) - 1 - padding[0]
    hi = dilated(in_size, in_dilation) + dilated(window, window_dilation) - 1
    return lo, hi - dilated(out_size, stride) - lo


def _move_group(x, src, dst, groups):
    """Move the major factor `groups` of axis `src` into axis `dst`, as its major factor."""
    shape = list(x.shape)
    x = lax.reshape(x, shape[:src] + [groups, shape[src] // groups] + shape[src + 1:])
    axes = [a for a in range(x.ndim) if a != src]
    at = axes.index(dst + 1 if dst > src else dst)
    x = lax.transpose(x, tuple(axes[:at] + [src] + axes[at:]))
    shape[src] //= groups
    shape[dst] *= groups
    return lax.reshape(x, shape)


def _swap(spec):
    return (spec[1], spec[0], *spec[2:])


def _conv_lhs_ct(ct, lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation,
                 dimension_numbers, feature_group_count, batch_group_count, precision,
                 preferred_element_type):
    """The input's cotangent: the cotangent, dilated by the strides, convolved with the flipped
    kernel (its in/out features swapped), sampled every lhs_dilation."""
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    spatial = range(len(lhs_spec) - 2)
    pads = [transposed_window_padding(lhs.shape[lhs_spec[i + 2]], rhs.shape[rhs_spec[i + 2]],
                                      window_strides[i], ct.shape[out_spec[i + 2]], padding[i],
                                      lhs_dilation[i], rhs_dilation[i]) for i in spatial]
    # Grouped either way, group g's kernel slice maps group g of ct's features back to group g of
    # the input's features (or batch): the groups move from the kernel's out to its in features.
    groups = max(feature_group_count, batch_group_count)
    kernel = _move_group(rhs, rhs_spec[0], rhs_spec[1], groups) if groups > 1 else rhs
    kernel = lax.rev(kernel, tuple(rhs_spec[2:])).astype(ct.dtype)
    dims = lax.ConvDimensionNumbers(out_spec, _swap(rhs_spec), lhs_spec)
    out = lax.conv_general_dilated(
        ct, kernel, window_strides=lhs_dilation, padding=pads, lhs_dilation=window_strides,
        rhs_dilation=rhs_dilation, dimension_numbers=dims,
        feature_group_count=groups, precision=precision,
        preferred_element_type=preferred_element_type)
    if batch_group_count > 1:  # the groups of features are groups of the batch
        out = _move_group(out, lhs_spec[1], lhs_spec[0], batch_group_count)
    return out.astype(lhs.dtype)


def _conv_rhs_ct(ct, lhs, rhs, *, window_strides, padding, lhs_dilation, rhs_dilation,
                 dimension_numbers, feature_group_count, batch_group_count, precision,
                 preferred_element_type):
    """The kernel's cotangent: the input convolved with the cotangent as the window (dilated by
    the strides), contracting the batch, sampled every rhs_dilation. Feature groups become batch
    groups and back."""
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    spatial = range(len(lhs_spec) - 2)
    pads = []
    for i in spatial:
        n, k = lhs.shape[lhs_spec[i + 2]], rhs.shape[rhs_spec[i + 2]]
        o, lo = ct.shape[out_spec[i + 2]], padding[i][0]
        # pad behind so that the last window position is kernel tap k - 1
        span = dilated(k, rhs_dilation[i]) + dilated(o, window_strides[i]) - 1
        pads.append((lo, span - lo - dilated(n, lhs_dilation[i])))
    dims = lax.ConvDimensionNumbers(_swap(lhs_spec), _swap(out_spec), _swap(rhs_spec))
    out = lax.conv_general_dilated(
        lhs.astype(ct.dtype), ct, window_strides=rhs_dilation, padding=pads,
        lhs_dilation=lhs_dilation, rhs_dilation=window_strides, dimension_numbers=dims,
        feature_group_count=batch_group_count, batch_group_count=feature_group_count,
        precision=precision, preferred_element_type=preferred_element_type)
    return out.astype(rhs.dtype)


def _conv_general_dilated_vjp(cts, ins, outs, **params):
    (ct,), (lhs, rhs) = cts, ins
    if ct.size == 0:  # no window read anything: avoid degenerate (empty-window) convolutions
        return [jnp.zeros_like(lhs), jnp.zeros_like(rhs)]
    params.pop("out_sharding", None)
    return [_conv_lhs_ct(ct, lhs, rhs, **params), _conv_rhs_ct(ct, lhs, rhs, **params)]


defvjp("conv_general_dilated", _conv_general_dilated_vjp)
