"""`lax.custom_linear_solve` (behind `jnp.linalg.solve` and `jnp.linalg.inv`): an op whose VJP is
implicit differentiation of `matvec(x) = b`.

The tracer carries JAX's primitive whole (`builder.CARRIED_WHOLE`): its params hold the jaxprs of
`matvec`, `vecmat`, `solve` and `transpose_solve`, and its inputs are their closed-over values (in
that order) followed by the right-hand side `b`. The op's forward is the primitive itself
(`solve(b)`).

Its VJP follows from differentiating `A(theta) x = b`: with `lam = A^-T ct` (a linear solve of the
transposed system, emitted as this same op with the roles of matvec/vecmat and solve/
transpose_solve swapped, so that it is differentiable again), `ct_b = lam` and the matvec's
closed-over values get `-(d/dtheta <lam, matvec_theta(x)>)`. As in JAX, the derivative is defined
by `matvec` alone: `solve` is trusted to invert it, so the closed-over values of `vecmat`, `solve`
and `transpose_solve` get no cotangent (`jnp.linalg.solve` passes its LU factors through
`stop_gradient` and the matrix itself to both matvec and vecmat).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun
from jax.extend.core.primitives import linear_solve_p

from jgraph.backward import defvjp
from jgraph.errors import TransformError

_OP = linear_solve_p.name  # "custom_linear_solve"


def _split(values, const_lengths):
    """(matvec, vecmat, solve, transpose_solve) consts, and the right-hand side."""
    groups, start = [], 0
    for n in const_lengths:
        groups.append(list(values[start:start + n]))
        start += n
    return groups, list(values[start:])


def _custom_linear_solve_vjp(cts, ins, outs, *, const_lengths, jaxprs):
    if jaxprs.transpose_solve is None:
        raise TransformError(
            "custom_linear_solve without transpose_solve (and not symmetric) cannot be "
            "differentiated in reverse mode; JAX cannot either: pass transpose_solve= or "
            "symmetric=True to lax.custom_linear_solve")
    (matvec_c, vecmat_c, solve_c, transpose_solve_c), b = _split(ins, const_lengths)
    # With has_aux, the solves also return auxiliary values after x: they carry no gradient.
    x, ct_x = outs[:len(b)], cts[:len(b)]
    lam = linear_solve_p.bind(
        *vecmat_c, *matvec_c, *transpose_solve_c, *solve_c, *ct_x,
        const_lengths=const_lengths.transpose(), jaxprs=jaxprs.transpose())[:len(b)]
    matvec = jaxpr_as_fun(jaxprs.matvec)
    floating = [jnp.issubdtype(c.dtype, jnp.inexact) for c in matvec_c]

    def matvec_of_consts(*theta):
        it = iter(theta)
        full = [next(it) if f else c for c, f in zip(matvec_c, floating, strict=True)]
        return matvec(*full, *x)

    _, pull = jax.vjp(matvec_of_consts, *(c for c, f in zip(matvec_c, floating, strict=True)
                                          if f))
    grads = iter(pull(list(lam)))
    ct_matvec = [-next(grads) if f else None for f in floating]
    n_other = len(vecmat_c) + len(solve_c) + len(transpose_solve_c)
    return ct_matvec + [None] * n_other + list(lam)


defvjp(_OP, _custom_linear_solve_vjp)
