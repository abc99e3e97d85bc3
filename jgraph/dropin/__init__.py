"""Drop-in transforms: `jax.value_and_grad`, `jax.grad` and `jax.vjp` computed by jgraph.

    loss, grads = jg.value_and_grad(loss_fn)(params, batch)   # was jax.value_and_grad

Same signatures, argument handling, results and errors as JAX's; usable wherever JAX's are (eager,
inside the user's `jax.jit`, `vmap`, `lax.scan`, `shard_map`, under `jax.grad` or each other). Each
call runs the joint graph of its abstract signature, traced once and cached
(`jgraph.dropin.transform`); `jg.value_and_grad(f).graph(*args)` returns it. The equinox
variants are in `jgraph.dropin.filtered`, `jg.vjp` in `jgraph.dropin.pullback`.

`jg.vjp` shares its name with `jgraph.vjp`, the package of VJP rules: that module is made callable
(calling it is calling `jg.vjp`), so `jg.vjp(f, x)` and `jgraph.vjp.vjp_rules` both keep working.
"""

import types

import jgraph.vjp as _rules
from jgraph.dropin.arguments import ArgumentError, ArgumentValueError, UnsupportedOptionError
from jgraph.dropin.filtered import filter_grad, filter_value_and_grad
from jgraph.dropin.pullback import vjp
from jgraph.dropin.transform import ValueAndGrad, grad, value_and_grad


class _CallableRulesModule(types.ModuleType):
    """`jgraph.vjp` (the rules) is also `jg.vjp` (the transform): DESIGN fixes both names."""

    def __call__(self, fun, *primals, has_aux=False, reduce_axes=()):
        return vjp(fun, *primals, has_aux=has_aux, reduce_axes=reduce_axes)


_CallableRulesModule.__call__.__doc__ = vjp.__doc__
_rules.__class__ = _CallableRulesModule

__all__ = ["ArgumentError", "ArgumentValueError", "UnsupportedOptionError", "ValueAndGrad",
           "filter_grad", "filter_value_and_grad", "grad", "value_and_grad", "vjp"]
