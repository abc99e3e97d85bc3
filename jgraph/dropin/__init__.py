"""Drop-in transforms: `jax.value_and_grad`, `jax.grad` and `jax.vjp` computed by jgraph.

    loss, grads = jg.value_and_grad(loss_fn)(params, batch)   # was jax.value_and_grad

Same signatures, argument handling, results and errors as JAX's; usable wherever JAX's are (eager,
inside the user's `jax.jit`, `vmap`, `lax.scan`, `shard_map`, under `jax.grad` or each other). Each
call runs the joint graph of its abstract signature, traced once and cached
(`jgraph.dropin.transform`); `jg.value_and_grad(f).graph(*args)` returns it. The equinox
variants are in `jgraph.dropin.filtered`, `jg.vjp` in `jgraph.dropin.pullback`.
"""

from jgraph.dropin.arguments import ArgumentError, ArgumentValueError, UnsupportedOptionError
from jgraph.dropin.filtered import filter_grad, filter_value_and_grad
from jgraph.dropin.jit import Jit, jit
from jgraph.dropin.pullback import vjp
from jgraph.dropin.transform import ValueAndGrad, grad, value_and_grad

__all__ = ["ArgumentError", "ArgumentValueError", "Jit", "UnsupportedOptionError", "ValueAndGrad",
           "filter_grad", "filter_value_and_grad", "grad", "jit", "value_and_grad", "vjp"]
