"""`Optimizer.step_period`: the `period` micro-steps of one period in one compiled call.

The grad graph is scanned over the stacked micro-batches and the update applied once at the end
(period 1: the opt graph on the one micro-batch). Only the update is checked for non-finite values
(`on_nonfinite`), as `optax.apply_if_finite` checks the period's mean gradient. On a mesh the
micro-batches are split along the data axis (the stack's axis 1) and the scan runs the per-device
micro-steps of `mesh_steps`, reducing the accumulators once, before the update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jgraph.errors import JGraphError
from jgraph.lower import as_function
from jgraph.training.graphs import update_only
from jgraph.training.guard import with_guard
from jgraph.training.interrupts import held_sigint
from jgraph.training.leaves import dtype_of
from jgraph.training.optimizer_step import optimizer_step
from jgraph.training.train_state import TrainState


class WholePeriods:
    """The `step_period` half of `Optimizer` (a mixin: it reads the Optimizer's builds)."""

    def step_period(self, state, inputs_stack, labels_stack=None):
        """Run the `period` micro-steps of one period (stacked on axis 0) in one compiled call."""
        if self._micro_step(state, "Optimizer.step_period") != 0:
            raise JGraphError(f"step_period must start a period; the state is at micro-step "
                              f"{int(state.counter)} of {self.period}")
        lead = {np.shape(a)[0] for a in jax.tree.leaves((inputs_stack, labels_stack))}
        if lead != {self.period}:
            raise JGraphError(f"step_period needs inputs stacked {self.period} deep on axis 0, "
                              f"got leading sizes {sorted(lead)}")
        run = self.period_function(inputs_stack, labels_stack)
        ys = labels_stack if self.needs_labels else None
        self._check_labels(self._last, ys)
        if self.plan is not None:
            inputs_stack, ys = self._stacked(inputs_stack), self._stacked(ys)
        with held_sigint():
            trainable, keys = self._split(state.params)
            params, acc, opt_state, value, finite = self._run(
                run, state, trainable, state.grad_acc, state.opt_state, inputs_stack, ys,
                *(() if keys is None else (keys,)))
            new = TrainState(self._merge(params, keys), opt_state, acc, np.int32(0))
            self._record(new)
            if self.on_nonfinite == "raise":
                finite = bool(finite)
        if self.on_nonfinite == "raise":
            self._raise_if_nonfinite(finite, "the period run by step_period")
        return new, self._output(value, self._last, self.period,
                                 None if self.on_nonfinite == "ignore" else finite)

    def _stacked(self, tree):
        """Stacked micro-batches as global arrays, each micro-batch split along the data axis."""
        if tree is None:
            return None
        plan = self.plan
        plan.batch_size(jax.tree.map(lambda a: np.empty(np.shape(a)[1:2]), tree),
                        "Optimizer.step_period")
        return jax.tree.map(lambda a: plan.put(a, plan.sharding(None, plan.data_axis),
                                               copy=False), tree)

    def period_function(self, inputs_stack, labels_stack=None):
        """The jitted `(params, grad_acc, opt_state, inputs_stack, labels_stack[, keys]) ->
        (params, grad_acc, opt_state, stacked outputs, finite)` behind `step_period` (`.lower(...)`
        it to read XLA's memory figures). All three state parts are donated (static mode); the
        outputs come in the order of the inputs, because jax pairs donated buffers with outputs of
        the same shape in order: any other order makes XLA copy every state buffer into its
        place."""
        one = lambda t: jax.tree.map(  # noqa: E731 - one micro-batch's shapes
            lambda a: jax.ShapeDtypeStruct(tuple(np.shape(a)[1:]), dtype_of(a)), t)
        build = self._for(one(inputs_stack), None if labels_stack is None else one(labels_stack))
        if build.period_fn is None:
            build.period_fn = self._period_function(build)
        return build.period_fn

    def _period_function(self, build):
        period, labelled, mode = self.period, self.needs_labels, self.on_nonfinite
        donate = (0, 1, 2) if self.static else ()
        if build.steps is not None and period > 1:  # per-device micro-steps, one reduction
            return build.steps.period_function(build.graphs["grad"], build.graphs["update"],
                                               donate)
        if period == 1:
            opt_f = as_function(build.graphs["opt"])
        else:  # scan the grad graph over all micro-batches, then apply the update alone
            grad_f = as_function(build.plain_grad)  # unguarded: the update checks the period
            update = optimizer_step(update_only(build.plain_grad), self.tx)
            build.graphs["update"] = with_guard(update, mode)
            update_f = as_function(build.graphs["update"])

        def data(xs, ys, i, keys):
            pick = lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False)  # noqa: E731
            x = jax.tree.map(pick, xs)
            x = x if keys is None else (x, keys)
            return (x,) + ((jax.tree.map(pick, ys),) if labelled else ())

        guarded = mode != "ignore"

        def run(params, acc, opt_state, xs, ys, keys=None):
            if period == 1:
                out = opt_f(params, *data(xs, ys, 0, keys), opt_state)
                value, _, params, opt_state = out[:4]
                finite = out[-1] if guarded else jnp.bool_(True)
                return params, acc, opt_state, jax.tree.map(lambda v: v[None], value), finite

            def body(carry, batch):
                acc, counter = carry
                if keys is not None:
                    batch = ((batch[0], keys),) + tuple(batch[1:])
                value, acc, counter = grad_f(params, *batch, acc, counter)
                return (acc, counter), value

            batches = (xs, ys) if labelled else (xs,)
            (acc, _), values = lax.scan(body, (acc, jnp.int32(0)), batches)
            out = update_f(params, acc, opt_state)
            acc, params, opt_state = out[:3]
            finite = out[-1] if guarded else jnp.bool_(True)
            return params, acc, opt_state, values, finite

        if build.steps is not None:  # period 1 on a mesh: partitioned by XLA
            return build.steps.jit_period(run, donate)
        return jax.jit(run, donate_argnums=donate)
