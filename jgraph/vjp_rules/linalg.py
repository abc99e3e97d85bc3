"""VJP rules of linear algebra: cholesky, triangular_solve, lu, qr, eigh, svd, eig.

Each rule is the transpose of the standard matrix-calculus derivative of the factorization (the
forward-mode results JAX's own rules use), derived by hand: for a linear map `dA -> dOut`, the
cotangent `ct_A` satisfies `<ct_A, dA> = <ct_Out, dOut>`. All rules work on batches of matrices
(`[..., m, n]`). Complex inputs follow JAX's convention: the pairing is `Re sum(a * b)` with no
conjugation, so a complex-linear map `X -> M X N` transposes to `ct -> M^T ct N^T`, `X -> X^H` to
`ct -> ct^H` and `X -> Re X` to `ct -> ct` (as a complex value).

Degenerate spectra are not special-cased (as in JAX): eigh's and svd's eigenvector cotangents
divide by differences of eigenvalues (singular values), which are infinite for repeated ones.
`lu_pivots_to_permutation` has integer outputs only: it needs no rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.lax import linalg as lax_linalg

from jgraph.backward import defvjp
from jgraph.errors import TransformError

_HIGHEST = lax.Precision.HIGHEST


def _T(x):
    return jnp.swapaxes(x, -1, -2)


def _H(x):
    return jnp.conj(_T(x))


def _mm(a, b):
    return jnp.matmul(a, b, precision=_HIGHEST)


def _eye(n, dtype):
    return jnp.eye(n, dtype=dtype)


def _diag(v, dtype):
    """Batch of diagonal matrices with diagonal `v` (last axis)."""
    return v.astype(dtype)[..., None, :] * _eye(v.shape[-1], dtype)


def _tri_solve(a, b, **kw):
    return lax_linalg.triangular_solve(a, b, **kw)


# -- cholesky: L = chol(A),  dL = L phi(L^-1 dA L^-H),  phi = lower triangle, half diagonal --------
def _phi(x):
    n = x.shape[-1]
    return jnp.tril(x) * (1 - 0.5 * np.eye(n)).astype(x.real.dtype)


def _cholesky_vjp(cts, ins, outs, **_):
    # The op leaves the strict upper triangle unspecified; the factor is its lower triangle.
    (ct,), fac = cts, jnp.tril(outs[0])
    inner = _phi(_mm(_T(fac), ct))
    left = _tri_solve(fac, inner, left_side=True, lower=True, transpose_a=True)  # L^-T phi(L^T ct)
    return [_tri_solve(fac, left, left_side=False, lower=True, conjugate_a=True)]  # ... conj(L)^-1


defvjp("cholesky", _cholesky_vjp)


# -- triangular_solve: op(A) X = B (left side) or X op(A) = B --------------------------------------
def _triangular_solve_vjp(cts, ins, outs, *, left_side, lower, transpose_a, conjugate_a,
                          unit_diagonal):
    """ct_B solves the transposed system; dX = -op(A)^-1 op(dA) X, so ct_op(A) = -ct_B X^T
    (left) or -X^T ct_B (right), mapped back through op and onto the triangle the op reads."""
    (ct,), (a, _b), (x,) = cts, ins, outs
    ct_b = _tri_solve(a, ct, left_side=left_side, lower=lower, transpose_a=not transpose_a,
                  conjugate_a=conjugate_a, unit_diagonal=unit_diagonal)
    ct_op_a = -(_mm(ct_b, _T(x)) if left_side else _mm(_T(x), ct_b))
    ct_a = _T(ct_op_a) if transpose_a else ct_op_a
    ct_a = jnp.conj(ct_a) if conjugate_a else ct_a
    strict = 1 if unit_diagonal else 0
    return [jnp.tril(ct_a, -strict) if lower else jnp.triu(ct_a, strict), ct_b]


defvjp("triangular_solve", _triangular_solve_vjp)


# -- lu: P A = L U,  dL = L tril(Y, -1),  dU = triu(Y) U,  Y = L^-1 P dA U^-1 ----------------------
def _lu_factors(lu):
    """Unit lower L (m x m) and upper U (n x n), padded with identity for non-square inputs."""
    m, n = lu.shape[-2:]
    k = min(m, n)
    fac = jnp.tril(lu[..., :, :k], -1)
    fac = jnp.pad(fac, [(0, 0)] * (fac.ndim - 1) + [(0, m - k)]) + _eye(m, lu.dtype)
    u = jnp.triu(lu[..., :k, :])
    u_pad = np.zeros((n, n))
    u_pad[k:, k:] = np.eye(n - k)
    u = jnp.pad(u, [(0, 0)] * (u.ndim - 2) + [(0, n - k), (0, 0)]) + u_pad.astype(lu.dtype)
    return fac, u


def _lu_vjp(cts, ins, outs):
    (ct, _, _), (_lu, _, permutation) = cts, outs
    unit_lower, u = _lu_factors(_lu)
    ct_y = jnp.tril(_mm(_T(unit_lower), ct), -1) + jnp.triu(_mm(ct, _T(u)))
    ct_y = _tri_solve(u, ct_y, left_side=False, lower=False, transpose_a=True)  # ... U^-T
    ct_pa = _tri_solve(unit_lower, ct_y, left_side=True, lower=True, transpose_a=True,
                       unit_diagonal=True)
    inverse = jnp.argsort(permutation, axis=-1)  # row i of P A is row permutation[i] of A
    return [jnp.take_along_axis(ct_pa, inverse[..., :, None], axis=-2)]


defvjp("lu", _lu_vjp)


# -- qr --------------------------------------------------------------------------------------------
def _thin_qr_vjp(q, r, ct_q, ct_r):
    """X = Q R with Q [m, n], R [n, n] (m >= n). With D = dX R^-1 and C = Q^H D:
    dQ = Q (Om - C) + D and dR = (C - Om) R, where Om = tril(C, -1) - tril(C, -1)^H + i Im diag C
    (skew-Hermitian)."""
    a = _mm(_T(q), ct_q) - _mm(ct_r, _T(r))  # the cotangent of Om
    n = a.shape[-1]
    ct_c = jnp.tril(a - _H(a), -1) - a
    if jnp.iscomplexobj(a):
        ct_c = ct_c + _eye(n, a.dtype) * (1j * jnp.imag(a)).astype(a.dtype)
    ct_d = ct_q + _mm(jnp.conj(q), ct_c)
    return _tri_solve(r, ct_d, left_side=False, lower=False, transpose_a=True)  # ct_D R^-T


def _full_qr_extra_columns(q, ct_q_extra, n):
    """Cotangent of the thin Q's derivative from the extra columns of a full (m > n) Q, whose
    derivative is dQ_mp = dQ_mn Z^H - (Q_mn + Q_mp Z)(dQ_pn - Z dQ_nn)^H with
    Z = Q_pn (Q_nn - I)^-1 (arXiv:2409.13374, eqs. 32-33, as JAX differentiates it)."""
    q_mn, q_mp = q[..., :, :n], q[..., :, n:]
    q_nn, q_pn = q_mn[..., :n, :], q_mn[..., n:, :]
    z = _H(jnp.linalg.solve(_H(q_nn - _eye(n, q.dtype)), _H(q_pn)))
    p = q_mn + _mm(q_mp, z)
    ct_e = -_mm(_H(ct_q_extra), jnp.conj(p))  # the cotangent of E = dQ_pn - Z dQ_nn
    return _mm(ct_q_extra, jnp.conj(z)) + jnp.concatenate([-_mm(_T(z), ct_e), ct_e], axis=-2)


def _qr_vjp(cts, ins, outs, *, pivoting, full_matrices, use_magma=None):
    (ct_q, ct_r, *_), (x,), (q, r, *perm) = cts, ins, outs
    m, n = x.shape[-2:]
    if pivoting:  # Q R = X[..., P]: differentiate the column-permuted X, then scatter back
        x = jnp.take_along_axis(x, perm[0][..., None, :], axis=-1)
    if m < n:  # X = [X1 X2]: X1 = Q R1 (square), R2 = Q^H X2, so dR2 = dQ^H X2 + Q^H dX2
        x2, ct_r1, ct_r2 = x[..., m:], ct_r[..., :m], ct_r[..., m:]
        ct_q = ct_q + _mm(jnp.conj(x2), _H(ct_r2))
        ct_x = jnp.concatenate([_thin_qr_vjp(q, r[..., :m], ct_q, ct_r1),
                                _mm(jnp.conj(q), ct_r2)], axis=-1)
    elif full_matrices and m > n:  # R's last m - n rows are zero whatever X is
        ct_q_thin = ct_q[..., :n] + _full_qr_extra_columns(q, ct_q[..., n:], n)
        ct_x = _thin_qr_vjp(q[..., :n], r[..., :n, :], ct_q_thin, ct_r[..., :n, :])
    else:
        ct_x = _thin_qr_vjp(q, r, ct_q, ct_r)
    if pivoting:
        inverse = jnp.argsort(perm[0], axis=-1)
        ct_x = jnp.take_along_axis(ct_x, inverse[..., None, :], axis=-1)
    return [ct_x]


defvjp("qr", _qr_vjp)


# -- eigh: A = V diag(w) V^H,  dw = Re diag(V^H dA V),  dV = V (F o V^H dA V) ----------------------
def _eigh_vjp(cts, ins, outs, *, subset_by_index=None, **_):
    (ct_v, ct_w), (a,), (v, w) = cts, ins, outs
    n = a.shape[-1]
    if subset_by_index not in (None, (0, n)):
        raise TransformError("eigh with subset_by_index (a partial eigendecomposition) has no "
                             "derivative; JAX does not differentiate it either")
    w = w.astype(a.dtype)
    eye = _eye(n, a.dtype)
    f = 1 / (eye + w[..., None, :] - w[..., :, None]) - eye  # 1 / (w_j - w_i) off the diagonal
    inner = f * _mm(_T(v), ct_v) + _diag(ct_w, a.dtype)
    return [_mm(_mm(jnp.conj(v), inner), _T(v))]


defvjp("eigh", _eigh_vjp)


# -- svd: A = U diag(s) V^H ------------------------------------------------------------------------
def _svd_vjp(cts, ins, outs, *, full_matrices, compute_uv, subset_by_index=None, algorithm=None):
    """With dS = U^H dA V: ds = Re diag(dS);
    dU = U (F o (dS S + (dS S)^H) + i Im diag(dS) / s) [+ (I - U U^H) dA V / s when m > n];
    dV = V (F o (S dS + (S dS)^H)) [+ (I - V V^H) dA^H U / s when n > m];
    F_ij = 1 / (s_j^2 - s_i^2) off the diagonal."""
    (a,) = ins
    m, n = a.shape[-2:]
    dtype = a.dtype
    if compute_uv and full_matrices and m != n:
        raise TransformError("svd with full_matrices=True of a non-square matrix has no VJP "
                             "(JAX does not differentiate it either): use full_matrices=False")
    if compute_uv:
        (ct_s, ct_u, ct_vt), (s, u, vt) = cts, outs
    else:
        u, s, vt = lax_linalg.svd(a, full_matrices=False, compute_uv=True,
                                  subset_by_index=subset_by_index, algorithm=algorithm)
        ct_s, ct_u, ct_vt = cts[0], None, None
    ct_core = _diag(ct_s, dtype)  # the cotangent of dS
    if ct_u is not None:
        v, ct_v = _H(vt), _H(ct_vt)
        k = s.shape[-1]
        s_row, s_col = s[..., None, :], s[..., :, None]
        eye = _eye(k, s.dtype)
        f = (1 / (s_row * s_row - s_col * s_col + eye) - eye).astype(dtype)
        s_inv = jnp.where(s == 0, 0, 1 / jnp.where(s == 0, 1, s))
        pu = f * _mm(_T(u), ct_u)
        pv = f * _mm(_T(v), ct_v)
        j = 0.5 * _mm(_T(u), ct_u) * _diag(s_inv, dtype)
        ct_core = (ct_core + (pu + _H(pu)) * s_row.astype(dtype)
                   + s_col.astype(dtype) * (pv + _H(pv)) + j - _H(j))
    v_t = jnp.conj(vt)  # V^T, as V = vt^H
    ct_a = _mm(_mm(jnp.conj(u), ct_core), v_t)
    if ct_u is not None and m > n:
        scaled = ct_u / s_row.astype(dtype)
        ct_a = ct_a + _mm(scaled - _mm(jnp.conj(u), _mm(_T(u), scaled)), v_t)
    if ct_u is not None and n > m:
        scaled = ct_v / s_row.astype(dtype)
        w = scaled - _mm(jnp.conj(v), _mm(_T(v), scaled))
        ct_a = ct_a + _mm(jnp.conj(u), _H(w))
    return [ct_a]


defvjp("svd", _svd_vjp)


# -- eig (general matrices): A V = V diag(w), P = V^-1 dA V, dw = diag(P) --------------------------
def _eigvec_tangent(w, v, v_inv, da):
    """dV = V (F o P) + V diag(c): the eigenvalue equation leaves each dv_j free along v_j; LAPACK's
    normalization (unit norm, largest component real) fixes c_j = -Re(v_j^H u_j) - i Im(u_kj) / v_kj
    with k the row of v_j's largest entry and u_j the j-th column of V (F o P)."""
    n = w.shape[-1]
    eye = _eye(n, w.dtype)
    f = 1 / (eye + w[..., None, :] - w[..., :, None]) - eye
    u = _mm(v, f * _mm(_mm(v_inv, da), v))
    rows = lax.broadcasted_iota(jnp.int32, v.shape, v.ndim - 2)
    mask = (rows == jnp.argmax(jnp.abs(v), axis=-2)[..., None, :]).astype(v.dtype)
    c = lax.complex(-jnp.real(jnp.sum(jnp.conj(v) * u, axis=-2)),
                    -jnp.imag(jnp.sum(mask * u, axis=-2)) / jnp.real(jnp.sum(mask * v, axis=-2)))
    return u + v * c[..., None, :]


def _eig_vjp(cts, ins, outs, *, compute_left_eigenvectors, compute_right_eigenvectors,
             enable_eigvec_derivs=False, implementation=None):
    """The transpose (by `jax.linear_transpose`) of the tangent map above, as JAX defines it."""
    (a,) = ins
    left, right = compute_left_eigenvectors, compute_right_eigenvectors
    if (left or right) and not enable_eigvec_derivs:
        raise TransformError("eig with eigenvectors is differentiable only with "
                             "enable_eigvec_derivs=True (lax.linalg.eig), as in JAX; "
                             "jnp.linalg.eigvals differentiates")
    full = outs if right else lax_linalg.eig(
        a, compute_left_eigenvectors=left, compute_right_eigenvectors=True,
        enable_eigvec_derivs=True, implementation=implementation)
    w, vr = full[0], full[-1]
    vr_inv = jnp.linalg.inv(vr)
    vl_inv = jnp.linalg.inv(full[1]) if left else None

    def tangent(da):
        da = da.astype(vr.dtype)
        dw = jnp.diagonal(_mm(_mm(vr_inv, da), vr), axis1=-2, axis2=-1)
        out = [dw]
        if left:
            out.append(_eigvec_tangent(jnp.conj(w), full[1], vl_inv, _H(da)))
        if right:
            out.append(_eigvec_tangent(w, vr, vr_inv, da))
        return out

    return list(jax.linear_transpose(tangent, a)(list(cts)))


defvjp("eig", _eig_vjp)
