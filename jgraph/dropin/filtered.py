"""`jg.filter_value_and_grad` and `jg.filter_grad`: equinox's filter semantics.

As `equinox.filter_value_and_grad`: the floating arrays among the leaves of the first argument are
differentiated; everything else (integer arrays, Python numbers, functions, strings: the
non-array fields of an `eqx.Module`) is not, and its gradient is None, so `eqx.apply_updates`
takes the result as it is. Non-array leaves are static (concrete inside `fun`, part of the cache
key), integer arrays are graph inputs. Usable bare or with options, as equinox's:
`@jg.filter_grad` or `jg.filter_value_and_grad(loss, has_aux=True)`. Needs no equinox at run time.
"""

from __future__ import annotations

import functools

from jgraph.dropin.transform import ValueAndGrad


def filter_value_and_grad(fun=None, *, has_aux=False, policy=None, budget=None, target=None):
    """`(value, grads)` of `fun(x, *args, **kwargs)` w.r.t. the floating arrays of `x`.

    Equinox's filter semantics: every other leaf of `x` (functions, ints, strings) gets None.

    Args:
        fun: the function; None returns a decorator.
        has_aux: `fun` returns `(value, aux)`.
        policy: passed to `jg.remat`, as `value_and_grad`'s.
        budget: passed to `jg.remat`, as `value_and_grad`'s.
        target: passed to `jg.remat`, as `value_and_grad`'s.

    Returns:
        A callable returning `(value, grads)`, or `((value, aux), grads)`."""
    if fun is None:
        return functools.partial(filter_value_and_grad, has_aux=has_aux, policy=policy,
                                 budget=budget, target=target)
    return ValueAndGrad(fun, 0, has_aux, policy=policy, budget=budget, target=target,
                        filtered=True, name="jg.filter_value_and_grad")


def filter_grad(fun=None, *, has_aux=False, policy=None, budget=None, target=None):
    """`grads` (or `(grads, aux)`) of `fun(x, *args, **kwargs)` w.r.t. the floating arrays of `x`.

    Args:
        fun: the function; None returns a decorator.
        has_aux: `fun` returns `(value, aux)`.
        policy: passed to `jg.remat`, as `value_and_grad`'s.
        budget: passed to `jg.remat`, as `value_and_grad`'s.
        target: passed to `jg.remat`, as `value_and_grad`'s.

    Returns:
        A callable returning `grads`, or `(grads, aux)` with `has_aux`."""
    if fun is None:
        return functools.partial(filter_grad, has_aux=has_aux, policy=policy, budget=budget,
                                 target=target)
    return ValueAndGrad(fun, 0, has_aux, policy=policy, budget=budget, target=target, value=False,
                        filtered=True, name="jg.filter_grad")
