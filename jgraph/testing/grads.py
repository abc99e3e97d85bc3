"""Testing helpers for users' own test suites: `check_grads`.

`check_grads(fn, args, order)` checks jgraph's gradient of `fn` against central finite differences
in float64, as `jax.test_util.check_grads` checks JAX's: for random unit directions `u` (inputs)
and `w` (outputs), the reverse product `<J^T w, u>` from `jgraph.backward` must match the finite
difference of `<w, fn(x + t u)>` at t = 0. Order 2 checks the gradient of that gradient, again
built by `jgraph.backward` (on the backward graph: second-order use of jgraph's rules), and so on.
All floating leaves of all arguments are differentiated; other leaves are held fixed.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jgraph.backward import backward
from jgraph.errors import JGraphError
from jgraph.lower import compile as compile_graph
from jgraph.testing.options import TestingOptionError, count
from jgraph.trace import trace

_EPS = 1e-4  # central-difference step in float64: error ~ eps**2 * f''' stays below tolerance
_TOL = 1e-5
_QUICK_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _split(args):
    """Floating leaves (as float64 numpy arrays) and a function rebuilding the args from them."""
    leaves, tree = jax.tree.flatten(tuple(args))
    mask = [_is_float(x) for x in leaves]
    floats = [np.asarray(x, np.float64) for x, m in zip(leaves, mask, strict=True) if m]

    def rebuild(new_floats):
        it = iter(new_floats)
        return jax.tree.unflatten(tree, [next(it) if m else x
                                         for x, m in zip(leaves, mask, strict=True)])

    return floats, rebuild


def _random_like(rng, shapes):
    """Random directions (numpy, so that no eager JAX op compiles), of unit total norm."""
    vs = [rng.standard_normal(s) for s in shapes]
    norm = np.sqrt(sum(np.sum(v * v) for v in vs)) or 1.0
    return [v / norm for v in vs]


def _vdot(xs, ys):
    return sum(jnp.vdot(x, y) for x, y in zip(xs, ys, strict=True))


def _jgraph_grad(scalar_fn, floats):
    """jgraph's gradient of `scalar_fn(list of floats)`, as a traceable JAX function."""
    gb = backward(trace(scalar_fn, floats, param_argnums=0))
    step = compile_graph(gb)
    return lambda xs: step(xs)[1]


def check_grads(fn, args, order: int = 1, eps=None, rtol=None, atol=None, seed: int = 0):
    """Raise AssertionError unless jgraph's derivatives of `fn` up to `order` match finite
    differences (in float64) along random directions. `args` is the tuple of `fn`'s arguments;
    `eps` (the finite-difference step), `rtol` and `atol` default to 1e-4, 1e-5 and 1e-5; a bad
    argument raises `TestingOptionError` naming it."""
    if not callable(fn):
        raise TestingOptionError(f"check_grads: fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, tuple | list):
        raise TestingOptionError(f"check_grads: args must be the tuple of fn's arguments, got "
                                 f"{type(args).__name__} (for one argument x, write (x,))")
    order = count(order, "check_grads: order", 1, 8)  # each order nests a backward: 8 is hours
    eps = _EPS if eps is None else _real(eps, "eps", positive=True)
    rtol = _TOL if rtol is None else _real(rtol, "rtol")
    atol = _TOL if atol is None else _real(atol, "atol")
    seed = count(seed, "check_grads: seed", 0, 2**63 - 1)
    with jax.enable_x64(True):  # float64 whatever the user's setting
        _check_grads(fn, args, order, eps, rtol, atol, seed)


def _real(value, name: str, positive: bool = False) -> float:
    """A finite float >= 0 (> 0 with `positive`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(
            value) or value < 0 or (positive and value == 0):
        want = "a finite number > 0" if positive else "a finite number >= 0"
        raise TestingOptionError(f"check_grads: {name} must be {want}, got {value!r}")
    return float(value)


def _check_grads(fn, args, order, eps, rtol, atol, seed):
    floats, rebuild = _split(args)
    if not floats:
        raise JGraphError("check_grads: no floating argument to differentiate")
    rng = np.random.default_rng(seed)
    out = jax.eval_shape(lambda xs: fn(*rebuild(xs)), floats)
    w = _random_like(rng, [o.shape for o in jax.tree.leaves(out) if _is_float(o)])

    def scalar(xs):  # <w, fn(x)>: reverse mode of it is J^T w
        outs = [o for o in jax.tree.leaves(fn(*rebuild(xs))) if _is_float(o)]
        return _vdot(w, [o.astype(jnp.float64) for o in outs])

    levels = []  # (scalar function, its jgraph gradient, direction), one per order
    for _ in range(order):
        grad = _jgraph_grad(scalar, floats)
        levels.append((scalar, grad, _random_like(rng, [x.shape for x in floats])))
        # next order: jgraph's gradient of <grad(x), v>, built by jgraph from grad's own graph
        scalar = _directional(grad, _random_like(rng, [x.shape for x in floats]))
    results = _probe(levels, floats, eps)
    for level, (analytic, numeric) in enumerate(results, start=1):
        if not np.isclose(analytic, numeric, rtol=rtol, atol=atol):
            raise AssertionError(
                f"check_grads: order-{level} derivative of {getattr(fn, '__name__', fn)!r} along "
                f"a random direction: jgraph gives {analytic!r}, central finite differences "
                f"(eps={eps}) give {numeric!r} (rtol={rtol}, atol={atol})")


def _probe(levels, xs, eps):
    """Per level, (<grad(x), u>, central difference of scalar along u): one compiled call."""

    @jax.jit
    def probe(xs):
        out = []
        for scalar, grad, u in levels:
            plus = scalar([x + eps * d for x, d in zip(xs, u, strict=True)])
            minus = scalar([x - eps * d for x, d in zip(xs, u, strict=True)])
            out.append((_vdot(grad(xs), u), (plus - minus) / (2 * eps)))
        return out

    # A check runs once: a quick compile matters more than fast code.
    compiled = probe.lower(xs).compile(compiler_options=_QUICK_COMPILE)
    return [(float(a), float(n)) for a, n in compiled(xs)]


def _directional(grad, v):
    def scalar(xs):
        return _vdot(grad(xs), v)

    return scalar
