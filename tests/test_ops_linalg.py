"""Per-op gradients of linear algebra, FFT, unstack, scatter-mul, cumlogsumexp and
custom_linear_solve: one spec row per op (or per family of its params).

Each row is a small batched JAX function whose traced graph contains the op, applied to structured
inputs (symmetric positive definite, triangular, well conditioned, separated spectra). For each
row: `jg.backward` equals `jax.vjp` for a random output cotangent in float32 (x64 off) and in
float64, and jgraph's float64 gradient matches central finite differences (`check_grads`) of a
function invariant to the sign freedom of eigen- and singular vectors. Complex rows compare
jgraph's rules, run by JAX through `jg.to_jax`, with `jax.vjp` for complex cotangents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from linalg_inputs import general, normal, separated_singular, separated_symmetric, spd, triangular

import jgraph as jg
from jgraph import ops, vjp_rules
from jgraph.lower import as_function

QUICK = {"xla_backend_optimization_level": 0}
tri_solve = lax.linalg.triangular_solve


@dataclass(frozen=True)
class Row:
    name: str
    op: str  # the op the traced graph must contain
    fn: Callable  # f(*arrays) -> array or tuple of arrays
    inputs: tuple  # one maker per input: rng -> float64 array
    fd_fn: Callable | None = None  # a sign-invariant function of the same op, for finite diffs


# Sign-invariant views of eigen/singular vectors: v[i, j] * v[0, j] is unchanged by v[:, j] -> -v.
def _column_gauge(v):
    return v * v[..., :1, :]


def _eigh_invariant(a):
    w, v = jnp.linalg.eigh(a)
    return w, _column_gauge(v)


def _svd_invariant(full_matrices):
    def fn(a):
        u, s, vt = jnp.linalg.svd(a, full_matrices=full_matrices)
        return s, _column_gauge(u), _column_gauge(jnp.swapaxes(vt, -1, -2))
    return fn


def _qr_complete_invariant(a):
    q, r = jnp.linalg.qr(a, mode="complete")
    n = a.shape[-1]  # the extra columns of Q are determined only up to a rotation among them
    return q[..., :n], r, q[..., n:] @ jnp.swapaxes(q[..., n:], -1, -2)


def _tri_solves(left_side, lower):
    def fn(a, b):
        return tuple(tri_solve(a, b, left_side=left_side, lower=lower, transpose_a=t,
                               unit_diagonal=u) for t in (False, True) for u in (False, True))
    return fn


def _fft_roundtrip(forward, inverse, k):
    """A real function through a complex transform: inverse(forward(x)[..., :k])."""
    return lambda x: inverse(forward(x)[..., :k])


ROWS = [
    Row("cholesky", "cholesky", jnp.linalg.cholesky, (spd(2, 4, 4),)),
    Row("cholesky-2batch", "cholesky", jnp.linalg.cholesky, (spd(2, 3, 3),)),
    *(Row(f"triangular_solve-left{int(left)}-lower{int(lower)}", "triangular_solve",
          _tri_solves(left, lower),
          (triangular(2, 4, 4, lower=lower), normal(2, 4, 3) if left else normal(2, 3, 4)))
      for left in (True, False) for lower in (True, False)),
    Row("solve_triangular", "triangular_solve",
        lambda a, b: jax.scipy.linalg.solve_triangular(a, b, trans=1, lower=False),
        (triangular(4, 4, lower=False), normal(4))),
    Row("cho_solve", "triangular_solve",
        lambda a, b: jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(a), True), b),
        (spd(2, 4, 4), normal(2, 4, 2))),
    Row("lu-square", "lu", lambda a: lax.linalg.lu(a)[0], (general(2, 4, 4),)),
    Row("lu-wide", "lu", lambda a: lax.linalg.lu(a)[0], (general(2, 3, 5),)),
    Row("lu-tall", "lu", lambda a: lax.linalg.lu(a)[0], (general(2, 5, 3),)),
    Row("scipy-lu", "lu", jax.scipy.linalg.lu, (general(4, 4),)),
    Row("lu_solve", "lu_pivots_to_permutation",
        lambda a, b: jax.scipy.linalg.lu_solve(jax.scipy.linalg.lu_factor(a), b),
        (general(4, 4), normal(4, 2))),
    Row("slogdet", "lu", jnp.linalg.slogdet, (general(2, 4, 4),)),
    Row("det-3x3", "mul", jnp.linalg.det, (general(2, 3, 3),)),
    Row("det-5x5", "lu", jnp.linalg.det, (general(2, 5, 5),)),
    Row("solve", "custom_linear_solve", jnp.linalg.solve, (general(2, 4, 4), normal(2, 4, 3))),
    Row("solve-vector", "custom_linear_solve", jnp.linalg.solve, (general(4, 4), normal(4))),
    Row("inv", "custom_linear_solve", jnp.linalg.inv, (general(2, 4, 4),)),
    Row("qr-square", "qr", jnp.linalg.qr, (general(2, 4, 4),)),
    Row("qr-tall", "qr", jnp.linalg.qr, (general(2, 5, 3),)),
    Row("qr-wide", "qr", jnp.linalg.qr, (general(2, 3, 5),)),
    Row("qr-complete-tall", "qr", lambda a: jnp.linalg.qr(a, mode="complete"),
        (general(2, 5, 3),), fd_fn=_qr_complete_invariant),
    Row("qr-r", "qr", lambda a: jnp.linalg.qr(a, mode="r"), (general(2, 5, 3),)),
    Row("qr-pivoting", "qr", lambda a: jax.scipy.linalg.qr(a, pivoting=True)[:2],
        (general(5, 4),)),
    Row("eigh", "eigh", jnp.linalg.eigh, (separated_symmetric(2, 4, 4),), fd_fn=_eigh_invariant),
    Row("eigvalsh", "eigh", jnp.linalg.eigvalsh, (separated_symmetric(2, 4, 4),)),
    Row("svd-square", "svd", jnp.linalg.svd, (separated_singular(2, 4, 4),),
        fd_fn=_svd_invariant(True)),
    Row("svd-tall", "svd", lambda a: jnp.linalg.svd(a, full_matrices=False),
        (separated_singular(2, 5, 3),), fd_fn=_svd_invariant(False)),
    Row("svd-wide", "svd", lambda a: jnp.linalg.svd(a, full_matrices=False),
        (separated_singular(2, 3, 5),), fd_fn=_svd_invariant(False)),
    Row("svdvals", "svd", jnp.linalg.svdvals, (separated_singular(2, 3, 5),)),
    Row("fft", "fft", _fft_roundtrip(jnp.fft.fft, jnp.fft.irfft, 5), (normal(2, 8),)),
    Row("ifft", "fft", _fft_roundtrip(jnp.fft.ifft, lambda z: jnp.fft.irfft(z, 7), 4),
        (normal(2, 7),)),
    Row("rfft-irfft", "fft", lambda x: jnp.fft.irfft(jnp.fft.rfft(x) * jnp.arange(1.0, 6.0), 9),
        (normal(3, 8),)),
    Row("fftn", "fft", _fft_roundtrip(jnp.fft.fftn, jnp.fft.irfftn, 4), (normal(2, 3, 6),)),
    Row("rfftn-irfftn", "fft",
        lambda x: jnp.fft.irfftn(jnp.fft.rfftn(x, axes=(-3, -2, -1)) * 1.5, (3, 4, 5)),
        (normal(2, 3, 4, 5),)),
    Row("unstack", "unstack", lambda x: jnp.unstack(x, axis=1)[1] * jnp.unstack(x, axis=1)[2],
        (normal(2, 4, 3),)),
    Row("cumlogsumexp", "cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=1), (normal(2, 5, 3),)),
    Row("cumlogsumexp-reverse", "cumlogsumexp",
        lambda x: lax.cumlogsumexp(x, axis=0, reverse=True), (normal(5, 3),)),
    Row("scatter-mul", "scatter-mul",  # JAX differentiates it only with unique_indices=True
        lambda x, u: x.at[np.array([2, 0])].multiply(u, unique_indices=True),
        (normal(3, 4), normal(2, 4))),
]


def _row_id(row):
    return row.name


def _inputs(row, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [make(rng).astype(dtype) for make in row.inputs]


def _loss(fn):
    def loss(xs, cts):
        outs = [o for o in jax.tree.leaves(fn(*xs)) if jnp.issubdtype(o.dtype, jnp.inexact)]
        return sum(jnp.sum(o * c) for o, c in zip(outs, cts, strict=True))
    return loss


def _cotangents(fn, xs, seed):
    rng = np.random.default_rng(seed)
    outs = [o for o in jax.tree.leaves(jax.eval_shape(fn, *xs))
            if jnp.issubdtype(o.dtype, jnp.inexact)]
    return [rng.standard_normal(o.shape).astype(o.dtype) for o in outs]


def _scale_close(got, want, tol):
    """|got - want| <= tol * max(1, max |want|): relative to the gradient's scale."""
    want = np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol * scale)


def _compare_with_vjp(row, dtype, tol, seed=0):
    xs = _inputs(row, dtype, seed)
    cts = _cotangents(row.fn, xs, seed + 1)
    g = jg.trace(_loss(row.fn), xs, cts, param_argnums=0)
    assert row.op in {e.op for e in g.eqns}, f"{row.op} not in the traced graph"
    gb = jg.check(jg.backward(g))

    def both(xs, cts):
        theirs = jax.vjp(lambda *xs: [o for o in jax.tree.leaves(row.fn(*xs))
                                      if jnp.issubdtype(o.dtype, jnp.inexact)], *xs)[1](cts)
        return as_function(gb)(xs, cts)[1], theirs

    ours, theirs = jax.jit(both).lower(xs, cts).compile(QUICK)(xs, cts)
    for got, want in zip(ours, theirs, strict=True):
        assert got.dtype == want.dtype
        _scale_close(got, want, tol)


@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_vjp_f32(row):
    _compare_with_vjp(row, np.float32, 1e-5)


@pytest.mark.f64
@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_vjp_f64_and_finite_differences(row):
    _compare_with_vjp(row, np.float64, 1e-9, seed=3)
    jg.testing.check_grads(row.fd_fn or row.fn, _inputs(row, np.float64, seed=4))


_SECOND_ORDER = {"cholesky", "svd-tall"}  # the others run with -m slow


@pytest.mark.f64
@pytest.mark.parametrize("row", [
    pytest.param(r, marks=() if r.name in _SECOND_ORDER else pytest.mark.slow)
    for r in ROWS if r.name in _SECOND_ORDER | {"eigh", "qr-tall", "lu-square", "solve", "inv",
                                                 "rfft-irfft", "cumlogsumexp", "scatter-mul"}],
    ids=_row_id)
def test_second_order_finite_differences(row):
    """jgraph's backward of jgraph's backward: the rules' own eqns differentiate correctly."""
    jg.testing.check_grads(row.fd_fn or row.fn, _inputs(row, np.float64, seed=6), order=2)


# -- complex inputs: the rules' conjugation conventions, through jg.to_jax -------------------------
def _complex(*shape):
    return lambda rng: general(*shape)(rng) + 1j * rng.standard_normal(shape)


def _hpd(*shape):
    def make(rng):
        a = rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
        return a @ np.conj(np.swapaxes(a, -1, -2)) + shape[-1] * np.eye(shape[-1])
    return make


def _hermitian_separated(*shape):
    def make(rng):
        z = rng.standard_normal((*shape[:-2], shape[-1], shape[-1]))
        q = np.linalg.qr(z + 1j * rng.standard_normal(z.shape))[0]
        return (q * np.arange(1.0, shape[-1] + 1)[..., None, :]) @ np.conj(np.swapaxes(q, -1, -2))
    return make


def _tri_solves_conj(a, b):
    return tuple(tri_solve(a, b, left_side=side, lower=True, transpose_a=t, conjugate_a=c)
                 for side in (True,) for t in (False, True) for c in (False, True))


COMPLEX_ROWS = [
    Row("cholesky", "cholesky", lambda a: lax.linalg.cholesky(a, symmetrize_input=False),
        (_hpd(2, 3, 3),)),
    Row("triangular_solve", "triangular_solve", _tri_solves_conj,
        (lambda rng: np.tril(_complex(2, 3, 3)(rng)) + 3 * np.eye(3), _complex(2, 3, 2))),
    Row("lu", "lu", lambda a: lax.linalg.lu(a)[0], (_complex(2, 3, 4),)),
    Row("solve", "custom_linear_solve", jnp.linalg.solve, (_complex(2, 3, 3),
                                                          _complex(2, 3, 2))),
    Row("qr-wide", "qr", jnp.linalg.qr, (_complex(2, 3, 4),)),
    Row("qr-complete-tall", "qr", lambda a: jnp.linalg.qr(a, mode="complete"),
        (_complex(2, 4, 3),)),
    Row("eigh", "eigh", lambda a: lax.linalg.eigh(a, symmetrize_input=False),
        (_hermitian_separated(2, 3, 3),)),
    Row("svd-tall", "svd", lambda a: jnp.linalg.svd(a, full_matrices=False),
        (_complex(2, 4, 3),)),
    Row("eigvals", "eig", jnp.linalg.eigvals, (general(2, 4, 4),)),
    Row("eig-vectors", "eig", lambda a: lax.linalg.eig(a, compute_left_eigenvectors=True,
                                                        enable_eigvec_derivs=True),
        (general(2, 4, 4),)),
    Row("fft-ifft2", "fft", lambda z: (jnp.fft.fft(z), jnp.fft.ifft2(z)), (_complex(2, 4, 6),)),
    Row("rfft", "fft", lambda x: (jnp.fft.rfft(x), jnp.fft.rfftn(x)), (normal(2, 4, 7),)),
    Row("irfft", "fft", lambda z: (jnp.fft.irfft(z, 6), jnp.fft.irfftn(z, (3, 5))),
        (_complex(2, 3, 3),)),
    Row("scatter-mul", "scatter-mul",
        lambda x, u: x.at[np.array([2, 0])].multiply(u, unique_indices=True),
        (_complex(3, 4), _complex(2, 4))),
]


@pytest.mark.parametrize("row", COMPLEX_ROWS, ids=_row_id)
def test_complex_rules_match_jax_vjp(row):
    rng = np.random.default_rng(5)
    xs = [make(rng) for make in row.inputs]
    xs = [x.astype(np.complex64 if np.iscomplexobj(x) else np.float32) for x in xs]
    g = jg.trace(row.fn, *xs)
    assert row.op in {e.op for e in g.eqns}
    outs = jax.eval_shape(row.fn, *xs)
    cts = [(rng.standard_normal(o.shape) + 1j * rng.standard_normal(o.shape)).astype(o.dtype)
           if jnp.iscomplexobj(o) else rng.standard_normal(o.shape).astype(o.dtype)
           for o in jax.tree.leaves(outs)]
    cts = jax.tree.unflatten(jax.tree.structure(outs), cts)

    def both(xs, cts):
        return (jax.vjp(jg.to_jax(g), *xs)[1](cts), jax.vjp(row.fn, *xs)[1](cts))

    ours, theirs = jax.jit(both).lower(xs, cts).compile(QUICK)(xs, cts)
    for got, want in zip(ours, theirs, strict=True):
        _scale_close(got, want, 2e-5)


# -- behaviour beyond JAX's, and errors where JAX cannot differentiate ----------------------------
@pytest.mark.f64
def test_scatter_mul_with_duplicate_and_zero_updates_matches_finite_differences():
    """JAX differentiates x.at[i].multiply(u) w.r.t. u only for unique indices; jgraph's rule
    takes the product of the *other* updates to the same target, exact at zero updates."""
    idx = np.array([1, 0, 1, 1, 3])
    x = np.random.default_rng(0).standard_normal((4, 3))
    u = np.random.default_rng(1).standard_normal((5, 3))
    u[2, 0] = 0.0  # one zero among three updates to x[1, 0]
    u[0, 1] = u[3, 1] = 0.0  # two zeros to x[1, 1]: every update's cotangent is zero there

    def fn(x, u):
        return jnp.asarray(x).at[idx].multiply(u)

    with pytest.raises(NotImplementedError, match="unique_indices"):
        jax.grad(lambda x, u: jnp.sum(fn(x, u)), argnums=1)(x, u)
    jg.testing.check_grads(fn, (x, u))
    gb = jg.backward(jg.trace(lambda x, u: jnp.sum(fn(x, u)), x, u, param_argnums=(0, 1)))
    ct_u = np.asarray(jg.compile(gb)(x, u)[1][1])
    others = {0: u[[2, 3], 0], 2: u[[0, 3], 0], 3: u[[0, 2], 0]}  # x[1, 0]'s updates
    for k, rest in others.items():
        assert ct_u[k, 0] == pytest.approx(x[1, 0] * np.prod(rest), rel=1e-12)
    np.testing.assert_array_equal(ct_u[[0, 2, 3], 1], 0.0)
    np.testing.assert_allclose(ct_u[1], x[0], rtol=1e-12)  # the only update to x[0]


@pytest.mark.f64
def test_custom_linear_solve_user_operators():
    """lax.custom_linear_solve with a user's matvec (closing over a param) and solves: the
    gradient flows through matvec (implicit differentiation), as in JAX; and second order."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 3)) + 4 * np.eye(3)
    b = rng.standard_normal(3)

    def fn(a, b):
        def matvec(x):
            return a @ x

        def solve(_, y):
            return jnp.linalg.inv(lax.stop_gradient(a)) @ y

        def transpose_solve(_, y):
            return jnp.linalg.inv(lax.stop_gradient(a)).T @ y

        return lax.custom_linear_solve(matvec, b, solve, transpose_solve)

    def loss(a, b):
        return jnp.sum(jnp.sin(fn(a, b)))

    ours = jg.compile(jg.backward(jg.trace(loss, a, b, param_argnums=(0, 1))))(a, b)
    theirs = jax.value_and_grad(loss, argnums=(0, 1))(a, b)
    for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    jg.testing.check_grads(fn, (a, b), order=2)

    def with_aux(a, b):  # the solves also return an auxiliary value, which has no gradient
        def solve(_, y):
            x = jnp.linalg.solve(lax.stop_gradient(a), y)
            return x, jnp.sum(x)

        def transpose_solve(_, y):
            x = jnp.linalg.solve(lax.stop_gradient(a).T, y)
            return x, jnp.sum(x)

        x, aux = lax.custom_linear_solve(lambda x: a @ x, b, solve, transpose_solve,
                                         has_aux=True)
        return jnp.sum(jnp.sin(x)) + lax.stop_gradient(aux)

    ours = jg.compile(jg.backward(jg.trace(with_aux, a, b, param_argnums=(0, 1))))(a, b)
    for got, want in zip(ours[1], jax.grad(with_aux, (0, 1))(a, b), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    sym = spd(3, 3)(rng)
    jg.testing.check_grads(lambda m, b: lax.custom_linear_solve(
        lambda x: m @ x, b, lambda _, y: jnp.linalg.solve(lax.stop_gradient(m), y),
        symmetric=True), (sym, b))


@pytest.mark.f64
def test_qr_pivoting_wide_matches_finite_differences():
    """A wide (m < n) column-pivoted QR: R2 = Q^H X2 holds the *permuted* trailing columns
    (JAX 0.10's own rule reads the unpermuted ones there, so it is compared with finite
    differences only)."""
    a = np.random.default_rng(0).standard_normal((3, 5))
    jg.testing.check_grads(lambda a: jax.scipy.linalg.qr(a, pivoting=True)[:2], (a,))


def test_custom_linear_solve_without_transpose_is_a_clear_error():
    a = np.eye(3, dtype=np.float32) * 2

    def loss(a, b):
        return jnp.sum(lax.custom_linear_solve(lambda x: a @ x, b, lambda _, y: y / 2))

    b = np.ones(3, np.float32)
    with pytest.raises(TypeError, match="transpose_solve"):  # JAX cannot either
        jax.grad(loss)(a, b)
    with pytest.raises(jg.TransformError, match="transpose_solve"):
        jg.backward(jg.trace(loss, a, b, param_argnums=1))


def test_eig_eigenvectors_without_opt_in_is_a_clear_error():
    a = np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32)

    def vectors(a):
        return jnp.linalg.eig(a)[1]

    ct = np.ones((3, 3), np.complex64)
    with pytest.raises(NotImplementedError, match="enable_eigvec_derivs"):  # JAX cannot either
        jax.vjp(vectors, a)[1](ct)
    with pytest.raises(jg.TransformError, match="enable_eigvec_derivs"):
        jax.vjp(jg.to_jax(jg.trace(vectors, a)), a)[1](ct)


def test_svd_full_matrices_of_non_square_is_a_clear_error():
    a = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)

    def loss(a):
        return jnp.sum(jnp.linalg.svd(a, full_matrices=True)[0])

    with pytest.raises(NotImplementedError):  # JAX cannot either
        jax.grad(loss)(a)
    with pytest.raises(jg.TransformError, match="full_matrices"):
        jg.backward(jg.trace(loss, a, param_argnums=0))


def test_solve_graph_prints_evaluates_and_remats():
    a = (np.eye(3) * 3 + 0.1).astype(np.float32)
    b = np.ones(3, np.float32)

    def loss(a, b):
        return jnp.sum(jnp.linalg.solve(a, b) ** 2)

    g = jg.trace(loss, a, b, param_argnums=0)
    assert "custom_linear_solve[const_lengths=" in str(g)
    gb = jg.check(jg.backward(g))
    want = jax.value_and_grad(loss)(a, b)
    for graph in (gb, jg.check(jg.remat(gb, policy=jg.policies.nothing_saveable))):
        got = jg.evaluate(graph, a, b)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    np.testing.assert_allclose(jax.grad(jg.to_jax(g))(a, b), want[1], rtol=1e-6)


def test_platform_dependent_code_is_resolved_while_tracing():
    """jnp.diagonal of a matrix stages a cond on platform_index (a Pallas/mosaic branch and a
    default one): the tracer inlines the branch of the default backend, so it differentiates."""
    a = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)

    def loss(a):
        picked = lax.platform_dependent(a, cpu=lambda a: 2 * a, default=lambda a: 3 * a)
        return jnp.trace(a) + jnp.sum(jnp.diagonal(a, 1) ** 2) + jnp.sum(jnp.sin(picked))

    g = jg.trace(loss, a, param_argnums=0)
    assert "cond" not in {e.op for e in g.eqns}
    ours = jg.compile(jg.backward(g))(a)
    want = jax.value_and_grad(loss)(a)
    np.testing.assert_allclose(ours[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(ours[1], want[1], rtol=1e-6)


LINALG_OPS = ["cholesky", "triangular_solve", "lu", "lu_pivots_to_permutation", "qr", "eigh",
              "svd", "eig", "fft", "unstack", "scatter-mul", "cumlogsumexp", "custom_linear_solve"]


@pytest.mark.parametrize("op", LINALG_OPS)
def test_registry_complete(op):
    assert op in ops.shape_rules and op in ops.lowerings, f"{op} is not an op"
    assert op in vjp_rules.vjp_rules or op == "lu_pivots_to_permutation", f"{op}: no VJP rule"
