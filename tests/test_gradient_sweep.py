"""A sweep of everyday differentiable functions: `jax.nn`, `jax.numpy` reductions and
manipulations, `jnp.linalg` (and a few of `jax.scipy.linalg`), `jnp.fft` and optax losses.

For each row, the loss `sum_k <out_k, ct_k>` (real and imaginary parts of complex outputs taken
apart) is differentiated by jgraph (`jg.backward`) and by `jax.value_and_grad`:
- where JAX differentiates it, jgraph's value and gradient equal JAX's, to 1e-5 in float32 (x64
  off) and 1e-9 in float64, relative to the gradient's scale;
- where JAX raises, jgraph raises a `JGraphError` naming the problem, or its float64 gradient
  matches central finite differences (it does better than JAX: scatter-mul with duplicates).

The default run takes SAMPLE (a row or two per family); `-m slow` runs every row in both
precisions. `python tests/test_gradient_sweep.py` (from the repository root, jgraph importable)
prints the count table per family and the failures with their cause.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from linalg_inputs import (
    binary,
    general,
    labels,
    positive,
    probabilities,
    separated_singular,
    separated_symmetric,
    spd,
    triangular,
    uniform,
)

import jgraph as jg
from jgraph.lower import as_function

QUICK = {"xla_backend_optimization_level": 0}
TOLERANCE = {np.float32: 1e-5, np.float64: 1e-9}


@dataclass(frozen=True)
class Entry:
    name: str  # family.function[-variant]
    fn: Callable  # f(*args) -> array or pytree of arrays
    args: tuple  # one maker per argument: rng -> array (floats are differentiated)
    tol32: float | None = None  # looser f32 tolerance where the function amplifies rounding
    raises: str | None = None  # where JAX cannot differentiate it: what jgraph's error says


def _family(prefix, rows):
    """Entries from (name, fn, args[, options]) tuples."""
    return [Entry(prefix + row[0], row[1], row[2], **(row[3] if len(row) > 3 else {}))
            for row in rows]


def U(*shape):
    return uniform(*shape)


X = U(3, 4)
SQ = general(4, 4)
BSQ = general(2, 4, 4)


def _idx():
    """Fresh index constants per call: JAX 0.10 caches the conversion of a numpy constant without
    regard to x64, so a module-level array traced under x64 off and then on gives a jaxpr whose
    constant keeps the 32-bit dtype."""
    return np.array([2, 0, 2, 1])



def _attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v)


NN = _family("nn.", [
    ("relu", jax.nn.relu, (X,)), ("relu6", jax.nn.relu6, (uniform(3, 4, lo=-2, hi=8),)),
    ("sigmoid", jax.nn.sigmoid, (X,)), ("softplus", jax.nn.softplus, (X,)),
    ("sparse_plus", jax.nn.sparse_plus, (X,)), ("sparse_sigmoid", jax.nn.sparse_sigmoid, (X,)),
    ("soft_sign", jax.nn.soft_sign, (X,)), ("silu", jax.nn.silu, (X,)),
    ("log_sigmoid", jax.nn.log_sigmoid, (X,)), ("leaky_relu", jax.nn.leaky_relu, (X,)),
    ("hard_sigmoid", jax.nn.hard_sigmoid, (uniform(3, 4, lo=-5, hi=5),)),
    ("hard_silu", jax.nn.hard_silu, (uniform(3, 4, lo=-5, hi=5),)),
    ("hard_tanh", jax.nn.hard_tanh, (X,)), ("elu", jax.nn.elu, (X,)),
    ("celu", jax.nn.celu, (X,)), ("selu", jax.nn.selu, (X,)),
    ("gelu-tanh", functools.partial(jax.nn.gelu, approximate=True), (X,)),
    ("gelu-erf", functools.partial(jax.nn.gelu, approximate=False), (X,)),
    ("glu", jax.nn.glu, (X,)), ("squareplus", jax.nn.squareplus, (X,)),
    ("mish", jax.nn.mish, (X,)), ("tanh", jax.nn.tanh, (X,)),
    ("log_softmax", jax.nn.log_softmax, (X,)), ("softmax", jax.nn.softmax, (X,)),
    ("logsumexp", lambda x: jax.nn.logsumexp(x, axis=1), (X,)),
    ("logmeanexp", lambda x: jax.nn.logmeanexp(x, axis=0), (X,)),
    ("log1mexp", jax.nn.log1mexp, (uniform(3, 4, lo=0.1, hi=3),)),
    ("standardize", lambda x: jax.nn.standardize(x, axis=1), (X,)),
    ("one_hot", lambda x, y: jax.nn.one_hot(y, 4) * x, (X, labels(3, classes=4))),
    ("dot_product_attention", _attention, (U(2, 3, 2, 4), U(2, 5, 2, 4), U(2, 5, 2, 4))),
])

REDUCTIONS = _family("jnp.", [
    ("sum", lambda x: jnp.sum(x, 0), (X,)), ("prod", lambda x: jnp.prod(x, 1), (positive(3, 4),)),
    ("mean", jnp.mean, (X,)), ("var", lambda x: jnp.var(x, 1), (X,)),
    ("std", lambda x: jnp.std(x, 0, ddof=1), (X,)), ("max", lambda x: jnp.max(x, 1), (X,)),
    ("min", jnp.min, (X,)), ("ptp", lambda x: jnp.ptp(x, 1), (X,)),
    ("median", lambda x: jnp.median(x, 1), (U(3, 5),)),
    ("quantile", lambda x: jnp.quantile(x, 0.3, axis=1), (X,)),
    ("percentile", lambda x: jnp.percentile(x, 70.0), (X,)),
    ("nansum", jnp.nansum, (X,)), ("nanmean", lambda x: jnp.nanmean(x, 0), (X,)),
    ("nanmax", jnp.nanmax, (X,)), ("nanvar", jnp.nanvar, (X,)), ("nanstd", jnp.nanstd, (X,)),
    ("nanprod", jnp.nanprod, (positive(3, 4),)),
    ("average", lambda x: jnp.average(x, axis=1, weights=np.array([0.5, 1.5, 2.0, 1.0])), (X,)),
    ("cumsum", lambda x: jnp.cumsum(x, 1), (X,)), ("cumprod", jnp.cumprod, (positive(6),)),
    ("cumulative_sum", lambda x: jnp.cumulative_sum(x, axis=0, include_initial=True), (X,)),
    ("scipy.logsumexp", lambda x: jax.scipy.special.logsumexp(x, axis=0), (X,)),
    ("trace", jnp.trace, (X,)), ("diff", lambda x: jnp.diff(x, n=2, axis=1), (X,)),
    ("ediff1d", jnp.ediff1d, (X,)), ("convolve", jnp.convolve, (U(6), U(3))),
    ("correlate", lambda a, v: jnp.correlate(a, v, "same"), (U(6), U(3))),
    ("polyval", jnp.polyval, (U(4), U(5))),
    ("interp", lambda x, fp: jnp.interp(x, np.linspace(-2, 2, 5), fp), (U(7), U(5))),
    ("dot", jnp.dot, (X, U(4, 2))), ("vdot", jnp.vdot, (X, X)), ("inner", jnp.inner, (X, X)),
    ("outer", jnp.outer, (U(3), U(4))), ("kron", jnp.kron, (U(2, 2), U(2, 3))),
    ("tensordot", lambda a, b: jnp.tensordot(a, b, 2), (U(2, 3, 4), U(3, 4, 2))),
    ("einsum", lambda a, b: jnp.einsum("bij,bjk->bik", a, b), (U(2, 3, 4), U(2, 4, 2))),
    ("matmul", jnp.matmul, (U(2, 3, 4), U(4, 2))), ("cross", jnp.cross, (U(4, 3), U(4, 3))),
    ("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=1), (X,)),
])

MANIPULATIONS = _family("jnp.", [
    ("reshape", lambda x: jnp.reshape(x, (2, 6)), (X,)), ("transpose", jnp.transpose, (X,)),
    ("moveaxis", lambda x: jnp.moveaxis(x, 0, -1), (U(2, 3, 4),)),
    ("swapaxes", lambda x: jnp.swapaxes(x, 0, 2), (U(2, 3, 4),)),
    ("squeeze", jnp.squeeze, (U(3, 1, 4),)), ("expand_dims", lambda x: x[:, None], (X,)),
    ("concatenate", lambda a, b: jnp.concatenate([a, b, a], 0), (X, U(2, 4))),
    ("stack", lambda a, b: jnp.stack([a, b], 1), (X, X)), ("hstack", jnp.hstack, (X,)),
    ("vstack", lambda a, b: jnp.vstack([a, b]), (X, X)),
    ("dstack", lambda a, b: jnp.dstack([a, b]), (X, X)),
    ("column_stack", lambda a, b: jnp.column_stack([a, b]), (U(3), U(3))),
    ("split", lambda x: jnp.split(x, 2, axis=1)[1], (X,)),
    ("array_split", lambda x: jnp.array_split(x, 3, axis=1)[2], (X,)),
    ("unstack", lambda x: jnp.unstack(x)[1], (X,)), ("tile", lambda x: jnp.tile(x, (2, 1)), (X,)),
    ("repeat", lambda x: jnp.repeat(x, 2, axis=0), (X,)), ("flip", jnp.flip, (X,)),
    ("roll", lambda x: jnp.roll(x, 2, axis=1), (X,)), ("rot90", jnp.rot90, (X,)),
    ("pad-constant", lambda x: jnp.pad(x, ((1, 2), (0, 1))), (X,)),
    ("pad-edge", lambda x: jnp.pad(x, 2, mode="edge"), (X,)),
    ("pad-reflect", lambda x: jnp.pad(x, 2, mode="reflect"), (X,)),
    ("pad-wrap", lambda x: jnp.pad(x, 2, mode="wrap"), (X,)),
    ("pad-symmetric", lambda x: jnp.pad(x, 1, mode="symmetric"), (X,)),
    ("pad-linear_ramp", lambda x: jnp.pad(x, 1, mode="linear_ramp"), (X,)),
    ("take", lambda x: jnp.take(x, _idx(), axis=1), (X,)),
    ("take_along_axis", lambda x: jnp.take_along_axis(x, jnp.argsort(x, 1), 1), (X,)),
    ("where", lambda a, b: jnp.where(a > b, a, b * b), (X, X)),
    ("select", lambda x: jnp.select([x < -1, x > 1], [x, x * x], 0.0), (X,)),
    ("clip", lambda x: jnp.clip(x, -1.0, 1.5), (X,)), ("sort", lambda x: jnp.sort(x, 1), (X,)),
    ("partition", lambda x: jnp.partition(x, 2, axis=1), (X,)),
    ("triu", jnp.triu, (X,)), ("tril", lambda x: jnp.tril(x, -1), (X,)),
    ("diag", jnp.diag, (SQ,)), ("diagonal", lambda x: jnp.diagonal(x, 1), (X,)),
    ("diagflat", jnp.diagflat, (U(3),)), ("broadcast_to", lambda x: jnp.broadcast_to(x, (2, 3, 4)),
                                           (X,)),
    ("ravel", jnp.ravel, (X,)), ("atleast_3d", jnp.atleast_3d, (X,)),
    ("delete", lambda x: jnp.delete(x, 1, axis=1), (X,)),
    ("insert", lambda x, v: jnp.insert(x, 1, v, axis=1), (X, U(3))),
    ("append", lambda x, v: jnp.append(x, v, axis=0), (X, U(1, 4))),
    ("block", lambda a, b: jnp.block([[a, b], [b, a]]), (U(2, 2), U(2, 2))),
    ("at-set", lambda x, u: x.at[np.array([2, 0])].set(u), (X, U(2, 4))),
    ("at-add-duplicates", lambda x, u: x.at[_idx()].add(u), (X, U(4, 4))),
    ("at-set-duplicates", lambda x, u: x.at[_idx()].set(u), (X, U(4, 4))),
    ("at-multiply", lambda x, u: x.at[np.array([2, 0])].multiply(u, unique_indices=True),
     (X, U(2, 4))),
    ("at-multiply-duplicates", lambda x, u: x.at[_idx()].multiply(u), (X, U(4, 4))),
    ("at-min", lambda x, u: x.at[_idx()].min(u), (X, U(4, 4))),
    ("at-max", lambda x, u: x.at[np.array([2, 0])].max(u), (X, U(2, 4))),
    ("at-get", lambda x: x.at[_idx(), 1:].get(), (X,)),
    ("meshgrid", lambda a, b: jnp.meshgrid(a, b)[0] * jnp.meshgrid(a, b)[1], (U(3), U(4))),
    ("resize", lambda x: jnp.resize(x, (5, 3)), (X,)),
    ("vander", lambda x: jnp.vander(x, 3), (U(4),)),
])

LINALG = _family("linalg.", [
    ("cholesky", jnp.linalg.cholesky, (spd(2, 4, 4),)),
    ("det", jnp.linalg.det, (SQ,)), ("det-batched", jnp.linalg.det, (general(2, 5, 5),)),
    ("slogdet", lambda a: jnp.linalg.slogdet(a)[1], (SQ,)),
    ("eigh", lambda a: jnp.linalg.eigh(a)[0], (separated_symmetric(2, 4, 4),)),
    ("eigvalsh", jnp.linalg.eigvalsh, (separated_symmetric(4, 4),)),
    ("inv", jnp.linalg.inv, (BSQ,)), ("solve", jnp.linalg.solve, (SQ, U(4, 2))),
    ("lstsq", lambda a, b: jnp.linalg.lstsq(a, b)[0], (separated_singular(5, 3), U(5, 2))),
    ("matrix_power", lambda a: jnp.linalg.matrix_power(a, 3), (U(3, 3),)),
    ("matrix_power-inverse", lambda a: jnp.linalg.matrix_power(a, -2), (SQ,)),
    ("multi_dot", lambda a, b, c: jnp.linalg.multi_dot([a, b, c]), (U(2, 3), U(3, 4), U(4, 2))),
    ("norm-fro", jnp.linalg.norm, (X,)),
    ("norm-nuc", lambda a: jnp.linalg.norm(a, "nuc"), (separated_singular(3, 4),)),
    ("norm-2", lambda a: jnp.linalg.norm(a, 2), (separated_singular(3, 4),)),
    ("norm-minus2", lambda a: jnp.linalg.norm(a, -2), (separated_singular(4, 3),)),
    ("norm-1", lambda a: jnp.linalg.norm(a, 1), (X,)),
    ("norm-inf", lambda a: jnp.linalg.norm(a, jnp.inf), (X,)),
    ("norm-vector", lambda a: jnp.linalg.norm(a, axis=1), (X,)),
    ("norm-vector-3", lambda a: jnp.linalg.norm(a, 3, axis=1), (X,)),
    ("vector_norm", lambda a: jnp.linalg.vector_norm(a, ord=1, axis=0), (X,)),
    ("matrix_norm", lambda a: jnp.linalg.matrix_norm(a), (U(2, 3, 4),)),
    ("pinv", jnp.linalg.pinv, (separated_singular(4, 3),)),
    ("qr", lambda a: jnp.linalg.qr(a)[1], (general(4, 3),)),
    ("qr-complete", lambda a: jnp.linalg.qr(a, mode="complete")[0][:, :3], (general(4, 3),)),
    ("svd", lambda a: jnp.linalg.svd(a)[1], (separated_singular(2, 4, 4),)),
    ("svd-reduced", lambda a: jnp.linalg.svd(a, full_matrices=False)[0] ** 2,
     (separated_singular(5, 3),)),
    ("svd-full-nonsquare", lambda a: jnp.linalg.svd(a)[0], (separated_singular(5, 3),),
     {"raises": "full_matrices"}),
    ("svdvals", jnp.linalg.svdvals, (separated_singular(3, 5),)),
    ("cond", jnp.linalg.cond, (separated_singular(3, 3),)),
    ("tensorinv", lambda a: jnp.linalg.tensorinv(a.reshape(4, 2, 2), 1).reshape(4, 4),
     (SQ,)),
    ("tensorsolve", lambda a, b: jnp.linalg.tensorsolve(a.reshape(2, 2, 4), b), (SQ, U(2, 2))),
    ("vecdot", jnp.linalg.vecdot, (X, X)), ("outer", jnp.linalg.outer, (U(3), U(2))),
    ("matrix_transpose", jnp.linalg.matrix_transpose, (U(2, 3, 4),)),
    ("eigvals", jnp.linalg.eigvals, (general(3, 3),)),
    ("eig", lambda a: jnp.linalg.eig(a)[1], (general(3, 3),), {"raises": "enable_eigvec_derivs"}),
    ("scipy.solve_triangular", lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True),
     (triangular(4, 4), U(4, 2))),
    ("scipy.cho_solve", lambda a, b: jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a), b),
     (spd(4, 4), U(4, 2))),
    ("scipy.lu", lambda a: jax.scipy.linalg.lu(a)[1:], (SQ,)),
    ("scipy.lu_solve", lambda a, b: jax.scipy.linalg.lu_solve(jax.scipy.linalg.lu_factor(a), b),
     (SQ, U(4))),
    ("scipy.expm", jax.scipy.linalg.expm, (uniform(3, 3, lo=-0.5, hi=0.5),)),
    ("scipy.eigh", lambda a: jax.scipy.linalg.eigh(a)[0], (separated_symmetric(3, 3),)),
])

SIGNAL = U(2, 8)
FFT = _family("fft.", [
    ("fft", jnp.fft.fft, (SIGNAL,)), ("ifft", lambda x: jnp.fft.ifft(x, n=10), (SIGNAL,)),
    ("fft2", jnp.fft.fft2, (U(2, 4, 6),)), ("ifft2", jnp.fft.ifft2, (U(4, 6),)),
    ("fftn", lambda x: jnp.fft.fftn(x, norm="ortho"), (U(2, 3, 4),)),
    ("ifftn", jnp.fft.ifftn, (U(3, 4),)), ("rfft", jnp.fft.rfft, (SIGNAL,)),
    ("rfft-odd", lambda x: jnp.fft.rfft(x, n=7), (SIGNAL,)), ("irfft", jnp.fft.irfft, (SIGNAL,)),
    ("irfft-odd", lambda x: jnp.fft.irfft(x, n=9, norm="forward"), (SIGNAL,)),
    ("rfft2", jnp.fft.rfft2, (U(4, 6),)), ("irfft2", jnp.fft.irfft2, (U(4, 6),)),
    ("rfftn", jnp.fft.rfftn, (U(2, 3, 5),)), ("irfftn", jnp.fft.irfftn, (U(2, 3, 5),)),
    ("hfft", jnp.fft.hfft, (SIGNAL,)), ("ihfft", jnp.fft.ihfft, (SIGNAL,)),
    ("fftshift", jnp.fft.fftshift, (SIGNAL,)), ("ifftshift", jnp.fft.ifftshift, (SIGNAL,)),
    ("real-roundtrip", lambda x: jnp.fft.irfft(jnp.fft.rfft(x) * jnp.arange(5.0)), (SIGNAL,)),
])

LOGITS, TARGETS = U(4, 5), probabilities(4, 5)
OPTAX = _family("optax.", [
    ("l2_loss", optax.losses.l2_loss, (X, X)),
    ("squared_error", optax.losses.squared_error, (X, X)),
    ("huber_loss", optax.losses.huber_loss, (X, X)),
    ("log_cosh", optax.losses.log_cosh, (X, X)),
    ("softmax_cross_entropy", optax.losses.softmax_cross_entropy, (LOGITS, TARGETS)),
    ("softmax_cross_entropy_with_integer_labels",
     optax.losses.softmax_cross_entropy_with_integer_labels, (LOGITS, labels(4, classes=5))),
    ("safe_softmax_cross_entropy", optax.losses.safe_softmax_cross_entropy, (LOGITS, TARGETS)),
    ("sigmoid_binary_cross_entropy", optax.losses.sigmoid_binary_cross_entropy,
     (LOGITS, binary(4, 5))),
    ("sigmoid_focal_loss", optax.losses.sigmoid_focal_loss, (LOGITS, binary(4, 5))),
    ("poly_loss_cross_entropy", optax.losses.poly_loss_cross_entropy, (LOGITS, TARGETS)),
    ("hinge_loss", optax.losses.hinge_loss, (U(6), binary(6))),
    ("multiclass_hinge_loss", optax.losses.multiclass_hinge_loss,
     (LOGITS, labels(4, classes=5))),
    ("perceptron_loss", optax.losses.perceptron_loss, (U(6), binary(6))),
    ("multiclass_perceptron_loss", optax.losses.multiclass_perceptron_loss,
     (LOGITS, labels(4, classes=5))),
    ("sparsemax_loss", optax.losses.sparsemax_loss, (U(6), binary(6))),
    ("multiclass_sparsemax_loss", optax.losses.multiclass_sparsemax_loss,
     (LOGITS, labels(4, classes=5))),
    ("cosine_distance", optax.losses.cosine_distance, (X, X)),
    ("cosine_similarity", optax.losses.cosine_similarity, (X, X)),
    ("kl_divergence", optax.losses.kl_divergence, (lambda r: np.log(TARGETS(r)), TARGETS)),
    ("kl_divergence_with_log_targets", optax.losses.kl_divergence_with_log_targets,
     (lambda r: np.log(TARGETS(r)), lambda r: np.log(TARGETS(r)))),
    ("convex_kl_divergence", optax.losses.convex_kl_divergence,
     (lambda r: np.log(TARGETS(r)), TARGETS)),
    ("generalized_kl_divergence", optax.losses.generalized_kl_divergence,
     (positive(4, 5), positive(4, 5))),
    ("triplet_margin_loss", optax.losses.triplet_margin_loss, (X, X, X)),
    ("ntxent", lambda e: optax.losses.ntxent(e, jnp.array([0, 0, 1, 1])), (U(4, 3),)),
    ("dice_loss", optax.losses.dice_loss, (LOGITS, TARGETS)),
    ("ranking_softmax_loss", optax.losses.ranking_softmax_loss, (U(6), binary(6))),
    ("ctc_loss", lambda logits, lab: optax.losses.ctc_loss(
        logits, np.zeros((2, 6)), lab, np.zeros((2, 3))), (U(2, 6, 4), labels(2, 3, classes=3))),
    ("smooth_labels", lambda t: optax.smooth_labels(t, 0.1) * 2.0, (TARGETS,)),
])

ROWS = NN + REDUCTIONS + MANIPULATIONS + LINALG + FFT + OPTAX
BY_NAME = {e.name: e for e in ROWS}
assert len(BY_NAME) == len(ROWS), "duplicate sweep names"

# A row or two per family for the default run (the rest run with -m slow).
SAMPLE = ["nn.gelu-erf", "nn.dot_product_attention", "jnp.median", "jnp.cumlogsumexp",
          "jnp.pad-reflect", "jnp.unstack", "jnp.at-multiply-duplicates", "linalg.slogdet",
          "linalg.solve", "linalg.eigh", "linalg.pinv", "linalg.svd-full-nonsquare",
          "fft.real-roundtrip", "optax.softmax_cross_entropy_with_integer_labels"]


# -- the check ------------------------------------------------------------------------------------
def _inputs(entry, dtype, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for make in entry.args:
        a = np.asarray(make(rng))
        out.append(a.astype(dtype) if np.issubdtype(a.dtype, np.floating) else a)
    return out


def _float_leaves(tree):
    return [o for o in jax.tree.leaves(tree) if jnp.issubdtype(o.dtype, jnp.inexact)]


def _loss(fn, float_mask):
    """(floats, others, cts) -> sum_k <out_k, ct_k>, real and imaginary parts apart."""
    def loss(floats, others, cts):
        it_f, it_o = iter(floats), iter(others)
        args = [next(it_f) if is_float else next(it_o) for is_float in float_mask]
        total = 0.0
        for out, ct in zip(_float_leaves(fn(*args)), cts, strict=True):
            parts = (jnp.real(out), jnp.imag(out)) if jnp.iscomplexobj(out) else (out,)
            total = total + sum(jnp.sum(p * c) for p, c in zip(parts, ct, strict=True))
        return total
    return loss


def _split(xs):
    mask = [np.issubdtype(x.dtype, np.floating) for x in xs]
    return mask, [x for x, m in zip(xs, mask, strict=True) if m], [
        x for x, m in zip(xs, mask, strict=True) if not m]


def _cotangents(fn, xs, dtype, seed):
    rng = np.random.default_rng(seed)
    cts = []
    for out in _float_leaves(jax.eval_shape(fn, *xs)):
        n = 2 if jnp.issubdtype(out.dtype, jnp.complexfloating) else 1
        cts.append([rng.standard_normal(out.shape).astype(dtype) for _ in range(n)])
    return cts


def jax_gradient(entry, dtype, seed=0):
    """(value, grads) by jax.value_and_grad, or the exception JAX raises."""
    xs = _inputs(entry, dtype, seed)
    mask, floats, others = _split(xs)
    cts = _cotangents(entry.fn, xs, dtype, seed + 1)
    loss = _loss(entry.fn, mask)
    try:
        return jax.jit(jax.value_and_grad(loss)).lower(floats, others, cts).compile(QUICK)(
            floats, others, cts), (loss, floats, others, cts)
    except Exception as e:  # JAX cannot differentiate it
        return e, (loss, floats, others, cts)


def check_entry(entry, dtype):
    """Raise AssertionError (or jgraph's error) unless jgraph's gradient is JAX's."""
    theirs, (loss, floats, others, cts) = jax_gradient(entry, dtype)
    if isinstance(theirs, Exception):
        try:
            gb = jg.backward(jg.trace(loss, floats, others, cts, param_argnums=0))
        except jg.JGraphError as e:
            assert entry.raises and re.search(entry.raises, str(e)), (
                f"JAX cannot differentiate {entry.name} ({theirs!r}); jgraph's error should say "
                f"{entry.raises!r}, it says: {e}")
            return "both raise"
        jg.check(gb)  # jgraph differentiates what JAX cannot: its gradient must be right
        jg.testing.check_grads(lambda *fs: loss(list(fs), others, cts), floats)
        return "jgraph only (finite differences)"
    gb = jg.check(jg.backward(jg.trace(loss, floats, others, cts, param_argnums=0)))
    value, grads = jax.jit(as_function(gb)).lower(floats, others, cts).compile(QUICK)(
        floats, others, cts)
    tol = TOLERANCE[dtype] if dtype == np.float64 or entry.tol32 is None else entry.tol32
    want_value, want_grads = theirs
    scale = max(1.0, abs(float(want_value)))
    np.testing.assert_allclose(value, want_value, rtol=tol, atol=tol * scale)
    for got, want in zip(grads, want_grads, strict=True):
        want = np.asarray(want)
        scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
        np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol * scale)
    return "equal"


@pytest.mark.parametrize("name", SAMPLE)
def test_sweep_sample_f32(name):
    check_entry(BY_NAME[name], np.float32)


@pytest.mark.f64
@pytest.mark.parametrize("name", SAMPLE[::3])
def test_sweep_sample_f64(name):
    check_entry(BY_NAME[name], np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BY_NAME))
def test_sweep_f32(name):
    check_entry(BY_NAME[name], np.float32)


@pytest.mark.slow
@pytest.mark.f64
@pytest.mark.parametrize("name", list(BY_NAME))
def test_sweep_f64(name):
    check_entry(BY_NAME[name], np.float64)


# -- the count table -------------------------------------------------------------------------------
def report(names=None):
    """Run the sweep (both precisions); print counts per family and each failure's cause."""
    rows, failures = {}, []
    for name in names or list(BY_NAME):
        family = name.split(".")[0]
        counts = rows.setdefault(family, {"rows": 0, "equal": 0, "both raise": 0,
                                          "jgraph only (finite differences)": 0, "fail": 0})
        counts["rows"] += 1
        outcomes = []
        for dtype, x64 in ((np.float32, False), (np.float64, True)):
            with jax.enable_x64(x64):
                try:
                    outcomes.append(check_entry(BY_NAME[name], dtype))
                except Exception as e:  # noqa: BLE001 - the report lists every failure
                    outcomes.append("fail")
                    text = str(e).strip().splitlines()
                    failures.append((name, np.dtype(dtype).name, type(e).__name__,
                                     (text[0] if text else "")[:150]))
        counts["fail" if "fail" in outcomes else outcomes[0]] += 1
    header = ["family", "rows", "equal", "both raise", "jgraph only (finite differences)", "fail"]
    print(" | ".join(header))
    for family, counts in rows.items():
        print(" | ".join([family] + [str(counts[h]) for h in header[1:]]))
    total = {h: sum(c[h] for c in rows.values()) for h in header[1:]}
    print(" | ".join(["total"] + [str(total[h]) for h in header[1:]]))
    for failure in failures:
        print(" ".join(failure))


if __name__ == "__main__":
    report()
