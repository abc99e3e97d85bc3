"""The harness of the per-op gradient families (cases in `families_*.py`, tests in
`test_op_families.py`), modelled on JAX's own autodiff suite (`tests/lax_autodiff_test.py`).

A `Case` is one function of floating arrays whose traced graph contains the op under test, at one
point of its family's parameters (shapes, dtypes, dimension numbers, modes, ...). Index operands
are numpy constants closed over, as in JAX's tests. A case is checked two ways:
- `check_against_jax` (float32 / complex64, x64 off, as users run JAX): `jg.backward` of
  Re<f(x), ct> equals `jax.vjp(f, *x)[1](ct)` (JAX's cotangent pairing: no conjugation), with
  equal shapes and dtypes; the forward value equals f's; `jg.check` passes on both graphs.
- `check_finite_differences` (float64 / complex128): `jg.testing.check_grads` up to `case.order`
  (every order from 1), complex inputs and outputs through their real and imaginary parts.
Input samplers keep values away from the points where an op is not differentiable (ties, kinks,
poles) by far more than the difference step, as JAX's `rand_*` factories do.
"""

from __future__ import annotations

import functools
import operator
import zlib
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jgraph as jg
from jgraph.lower import as_function

QUICK = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
REAL, COMPLEX = "real", "complex"
ISSUE = "issue"  # tag of a case reproducing a reported bug: always in the default run
ISSUE_TAG = frozenset({ISSUE})
_DTYPES = {(REAL, 32): np.float32, (REAL, 64): np.float64,
           (COMPLEX, 32): np.complex64, (COMPLEX, 64): np.complex128}


@dataclass(frozen=True)
class Arg:
    shape: tuple
    kind: object = "default"  # default small positive nonzero unique, (lo, hi), ("at", value)
    #                           or ("values", flat values)
    dtype: object = None  # a fixed dtype (else the case's: float or complex, 32 or 64 bits)


@dataclass(frozen=True)
class Case:
    family: str
    name: str  # unique within the family
    fn: Callable  # f(*arrays) -> array or tuple of floating arrays
    args: tuple  # one Arg per input
    ops: tuple  # ops the traced forward graph must contain
    kinds: tuple = (REAL,)  # REAL and/or COMPLEX
    order: int = 2  # highest finite-difference order checked (0: none, see `why_no_fd`)
    rtol: float = 1e-5  # against jax.vjp, float32
    fd_tol: float = 1e-5  # against finite differences, float64
    eps: float = 1e-4  # finite-difference step
    backward_ops: tuple = ()  # ops the backward graph must contain (rules of higher orders)
    why_no_fd: str = ""
    jax_fails: str = ""  # JAX raises on this case: how (jgraph is checked by differences only)
    tags: frozenset = field(default_factory=frozenset)

    @property
    def id(self) -> str:
        return f"{self.family}:{self.name}"


def arg_values(case: Case, kind: str, bits: int):
    rng = np.random.default_rng(zlib.crc32(f"{case.id}/{kind}".encode()))
    out = []
    for arg in case.args:
        dtype = np.dtype(arg.dtype or _DTYPES[kind, bits])
        value = _sample(rng, arg.kind, arg.shape)
        if np.issubdtype(dtype, np.complexfloating):
            value = value + 1j * _sample(rng, arg.kind, arg.shape)
        out.append(np.asarray(value).astype(dtype))
    return out


def _sample(rng, kind, shape):
    size = int(np.prod(shape))
    if isinstance(kind, tuple) and kind[0] == "at":
        return np.full(shape, kind[1])
    if isinstance(kind, tuple) and kind[0] == "values":
        return np.array(kind[1], np.float64).reshape(shape)
    if isinstance(kind, tuple):
        return rng.uniform(*kind, shape)
    if kind == "default":
        return rng.uniform(-2.0, 2.0, shape)
    if kind == "small":
        return rng.uniform(-0.9, 0.9, shape)
    if kind == "positive":
        return rng.uniform(0.3, 3.0, shape)
    if kind == "nonzero":  # |x| >= 0.3, either sign
        return rng.uniform(0.3, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    if kind == "unique":  # distinct, at least 0.2 apart: no ties, no kink within a step
        return ((rng.permutation(size) - size / 2) * 0.25 + rng.uniform(-0.02, 0.02)).reshape(
            shape)
    raise ValueError(kind)


def _pairing(y, ct):
    """Re<y, ct>, JAX's pairing of a value with its cotangent."""
    product = y * ct
    return jnp.sum(jnp.real(product) if jnp.iscomplexobj(product) else product)


def _cotangents(case, xs, seed):
    outs = jax.tree.leaves(jax.eval_shape(case.fn, *xs))
    assert all(jnp.issubdtype(o.dtype, jnp.inexact) for o in outs), "outputs must be floating"
    rng = np.random.default_rng(seed)
    cts = []
    for o in outs:
        ct = rng.standard_normal(o.shape)
        if jnp.issubdtype(o.dtype, jnp.complexfloating):
            ct = ct + 1j * rng.standard_normal(o.shape)
        cts.append(ct.astype(o.dtype))
    return cts


def check_against_jax(pairs):
    """jg.backward == jax.vjp in 32 bits (x64 off) for each (case, kind): one compile for all,
    one AssertionError listing every case that differs."""
    failures, ready = [], []
    for pair in pairs:
        try:
            prepared = _prepare(*pair)
        except Exception as err:  # report every case of the batch, not only the first
            failures.append(f"{pair_id(pair)}: {type(err).__name__}: {err}")
            continue
        if prepared is not None:
            ready.append((pair, prepared))
    try:
        results = _run_all([prepared for _, prepared in ready])
    except Exception:  # find the case that breaks the batch
        results = []
        for pair, prepared in ready:
            try:
                results += _run_all([prepared])
            except Exception as err:
                failures.append(f"{pair_id(pair)}: {type(err).__name__}: {err}")
                results.append(None)
    for (pair, _), result in zip(ready, results, strict=True):
        if result is not None:
            try:
                _compare(pair[0], *result)
            except AssertionError as err:
                failures.append(f"{pair_id(pair)}: {err}")
    if failures:
        raise AssertionError(f"{len(failures)} of {len(pairs)} cases fail:\n" +
                             "\n\n".join(failures))


def _prepare(case: Case, kind: str):
    """Trace and differentiate one case; None when JAX itself fails on it (asserted)."""
    xs = arg_values(case, kind, 32)
    cts = _cotangents(case, xs, seed=1)

    def loss(xs, cts):
        terms = [_pairing(y, c) for y, c in zip(jax.tree.leaves(case.fn(*xs)), cts, strict=True)]
        return functools.reduce(operator.add, terms)

    graph = jg.trace(loss, xs, cts, param_argnums=0)
    missing = set(case.ops) - {e.op for e in graph.eqns}
    assert not missing, f"ops {sorted(missing)} not in the traced graph"
    jg.check(graph)
    gb = jg.backward(graph)
    jg.check(gb)
    missing = set(case.backward_ops) - {e.op for e in gb.eqns}
    assert not missing, f"ops {sorted(missing)} not in the backward graph"
    if case.jax_fails:
        out_tree = jax.tree.structure(jax.eval_shape(case.fn, *xs))
        with pytest.raises(Exception, match=case.jax_fails):
            jax.vjp(case.fn, *xs)[1](jax.tree.unflatten(out_tree, cts))
        return None
    return case, xs, cts, gb, loss


def _run_all(prepared):
    def run(args):
        out = []
        for (case, _, _, gb, loss), (xs, cts) in zip(prepared, args, strict=True):
            ys, pullback = jax.vjp(case.fn, *xs)
            ref = list(pullback(jax.tree.unflatten(jax.tree.structure(ys), cts)))
            out.append((as_function(gb)(xs, cts), (loss(xs, cts), ref)))
        return out

    args = [(xs, cts) for _, xs, cts, _, _ in prepared]
    return jax.jit(run).lower(args).compile(QUICK)(args)


def _compare(case, ours, theirs):
    (value, grads), (ref_value, ref_grads) = ours, theirs
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-5, err_msg="loss value")
    for k, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
        assert got.shape == want.shape and got.dtype == want.dtype, (
            f"arg {k}: gradient {got.dtype}{list(got.shape)}, JAX {want.dtype}{list(want.shape)}")
        wide = np.complex128 if np.iscomplexobj(got) else np.float64
        scale = max(1.0, float(np.max(np.abs(np.asarray(want, wide)), initial=0.0)))
        np.testing.assert_allclose(np.asarray(got, wide), np.asarray(want, wide), rtol=case.rtol,
                                   atol=case.rtol * scale, err_msg=f"arg {k}")


def check_finite_differences(case: Case, kind: str):
    """jgraph's derivatives up to `case.order` against float64 central differences."""
    xs = arg_values(case, kind, 64)
    fn, parts = _real_form(case.fn, xs)
    jg.testing.check_grads(fn, parts, order=case.order, eps=case.eps, rtol=case.fd_tol,
                           atol=case.fd_tol)


def _real_form(fn, xs):
    """fn as a function of real arrays to real arrays: each complex input is given as its real
    and imaginary parts, each complex output returned as its real and imaginary parts (so complex
    intermediates are differentiated with a real loss, as users do)."""
    complex_in = [np.iscomplexobj(x) for x in xs]
    parts = []
    for x, c in zip(xs, complex_in, strict=True):
        parts += [x.real.copy(), x.imag.copy()] if c else [x]

    def real_fn(*parts):
        it, zs = iter(parts), []
        for c in complex_in:
            zs.append(lax.complex(next(it), next(it)) if c else next(it))
        outs = []
        for y in jax.tree.leaves(fn(*zs)):
            outs += [jnp.real(y), jnp.imag(y)] if jnp.iscomplexobj(y) else [y]
        return outs

    real_fn.__name__ = getattr(fn, "__name__", "case")
    return real_fn, parts


def chunks(pairs, size: int):
    return [pairs[i:i + size] for i in range(0, len(pairs), size)]


def chunk_id(chunk) -> str:
    return f"{pair_id(chunk[0])}+{len(chunk) - 1}"


def items(cases, check: str):
    """(case, kind) pairs of one check ("jax" or "fd")."""
    out = []
    for case in cases:
        if check == "fd" and case.order == 0:
            continue
        out += [(case, kind) for kind in case.kinds]
    return out


def split_sample(pairs, per_family: int, seed: str, by_op: bool = False):
    """(default, rest): `per_family` pairs of each family (or each op's families, `by_op`)
    drawn at random, plus the first pair of every op and dtype kind not yet covered, so that
    the default run reaches every op of every family in both kinds, plus every ISSUE case."""
    by_family: dict[str, list] = {}
    for pair in pairs:
        family = pair[0].family.split("/")[0] if by_op else pair[0].family
        by_family.setdefault(family, []).append(pair)
    chosen = {id(pair) for pair in pairs if ISSUE in pair[0].tags}
    for family, members in by_family.items():
        rng = np.random.default_rng(zlib.crc32(f"{seed}/{family}".encode()))
        picks = rng.permutation(len(members))[:per_family]
        chosen.update(id(members[i]) for i in picks)
        covered = {op for i in picks for op in members[i][0].ops}
        covered |= {(members[i][1],) for i in picks}
        for pair in members:
            new = (set(pair[0].ops) - covered) or ({(pair[1],)} - covered)
            if new:
                chosen.add(id(pair))
                covered |= set(pair[0].ops) | {(pair[1],)}
    default = [p for p in pairs if id(p) in chosen]
    return default, [p for p in pairs if id(p) not in chosen]


def pair_id(pair) -> str:
    case, kind = pair
    return f"{case.id}-{kind}"
