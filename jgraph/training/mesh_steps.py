"""The executables of an `Optimizer` on a mesh: the same graphs, jitted with shardings.

With `period == 1` every step is the graph of the whole micro-batch (`forward`, `grad`, `opt`),
jitted with the batch split along the data axis: XLA's SPMD partitioner runs it on the shards and
reduces the gradients across devices inside the step.

With `period > 1` gradients cross devices once per period. The `grad` graph is traced for one
data shard (the micro-batch divided by the data axis's size) and accumulated over `period x
shards` shard-batches, so per-datapoint losses are scaled by 1 / (period x shards) and the sum of
the per-shard accumulators is the gradient of the whole logical batch. Each micro-step maps that
graph over the shards (`jax.vmap(spmd_axis_name=data_axis)` of its lowering, the shards on the
leading axis, split along the data axis): every device updates its own accumulator and nothing
crosses devices. The last micro-step of a period then sums the accumulators over the shards (the
one reduction of the period: an all-reduce, or a reduce-scatter for sharded params) and applies
the `update` graph (`optimizer_step` of the accumulated gradient). A model whose datapoints
interact (batch statistics) therefore sees one shard per micro-step, as in DDP, and PRNG keys
among the params are folded with the shard index (each shard draws its own random values).

Per-shard outputs (losses, predictions) are combined into the micro-batch's by a small separate
executable, so the step itself stays free of collectives. Non-finite guards follow the
Optimizer's modes; the "raise" mode's check of a micro-step is one all-reduce of a bool (every
shard must agree to keep or drop the step), the only collective such a step has.

Pacing (CPU devices only). XLA:CPU runs each device's part of a multi-device program on a thread
pool as large as the process's device count, and launches them from that pool; a launch that
finds its device's queue of in-flight programs full (32) blocks its pool thread, and a collective
that is running then waits forever for the participant that thread should run. A host loop that
dispatches steps faster than they run gets there (seen with 8 host devices, and with 2 processes
on loopback). So on CPU meshes a step waits for the step before the previous one before it is
dispatched: at most two steps in flight, far below the queue's limit.
"""

from __future__ import annotations

import collections
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jgraph.ir import Graph
from jgraph.lower import as_function, jit_donated
from jgraph.training.mesh import MeshPlan, combine


class Pace:
    """At most `depth` steps in flight: a step waits for the one `depth` steps before it."""

    def __init__(self, depth: int = 2):
        self.depth, self.pending = depth, collections.deque()

    def wait(self) -> None:
        while len(self.pending) >= self.depth:
            try:
                jax.block_until_ready(self.pending.popleft())
            except RuntimeError:  # deleted by its owner: it ran
                pass

    def add(self, value) -> None:
        self.pending.append(value)


class MeshStep:
    """A jitted step on the mesh: paced (see the module docstring), and its per-shard outputs
    combined into the micro-batch's on the way out (`finish`, applied to result `value_at`).

    `lower` and `_cache_size` are the jitted function's (to read XLA's HLO and memory)."""

    def __init__(self, jitted, finish: Callable | None = None, pace: Pace | None = None,
                 value_at: int | None = 0):
        self.jitted, self.finish, self.pace, self.value_at = jitted, finish, pace, value_at

    def __call__(self, *args):
        if self.pace is not None:
            self.pace.wait()
        out = self.jitted(*args)
        if self.finish is not None:
            out = (self.finish(out[0]),) + tuple(out[1:])
        if self.pace is not None:  # the value (never donated) is ready when the step has run
            self.pace.add(out if self.value_at is None else out[self.value_at])
        return out

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def _cache_size(self) -> int:
        return self.jitted._cache_size()


def _keep_if(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class MeshSteps:
    """Builds the jitted steps of one Optimizer build on `plan`'s mesh.

    `data` below is the step's data arguments as the graphs take them: `(x,)` or `(x, labels)`,
    `x` being `(inputs, keys)` when the params hold PRNG keys (`keyed`)."""

    def __init__(self, plan: MeshPlan, params, tx, *, keyed: bool, labelled: bool, mode: str,
                 period: int):
        self.plan, self.keyed, self.labelled = plan, keyed, labelled
        self.mode, self.period = mode, period
        self.params = plan.param_shardings(params)
        self.opt_state = plan.opt_state_shardings(tx, jax.eval_shape(tx.init, params),
                                                  self.params)
        self.acc = plan.local_shardings(self.params)
        rep = plan.replicated
        x = (plan.batched, rep) if keyed else plan.batched
        self.data = (x, plan.batched) if labelled else (x,)
        self.stats = jax.jit(combine, out_shardings=rep)
        cpu = plan.mesh.devices.flat[0].platform == "cpu"
        self.pace = Pace() if cpu else None
        self.summed = jax.jit(lambda acc: jax.tree.map(lambda a: jnp.sum(a, 0), acc),
                              out_shardings=rep)  # the accumulated gradient, whole

    # -- the period-1 steps and the forward pass: the whole micro-batch, partitioned by XLA --------
    def forward(self, graph: Graph):
        rep = self.plan.replicated
        return MeshStep(jax.jit(as_function(graph), in_shardings=(self.params, *self.data),
                                out_shardings=rep), pace=self.pace, value_at=None)

    def whole(self, graph: Graph, has_opt: bool, donate=()):
        """`grad` (value, grads) or `opt` (value, grads, params, opt_state) of period 1; the
        grads are None in a step that leaves them out (`without_grads`: planned whole)."""
        rep = self.plan.replicated
        ins = (self.params, *self.data) + ((self.opt_state,) if has_opt else ())
        grads = self.params if "grad" in graph.output_roles else None
        outs = (rep, grads) + ((self.params, self.opt_state) if has_opt else ())
        if graph.info.get("finite_output") is not None:
            outs += (rep,)
        return MeshStep(jit_donated(graph, donate, in_shardings=ins, out_shardings=outs),
                        pace=self.pace)

    def reset(self, graph: Graph, params):
        """`params -> {state part: reset value}`; accumulators per device when period > 1."""
        fn = as_function(graph)
        size = self.plan.size

        def fresh(p):
            out = dict(fn(p))
            if "grad_acc" in out:
                out["grad_acc"] = jax.tree.map(
                    lambda a: jnp.zeros((size,) + a.shape, a.dtype), out["grad_acc"])
            return out

        parts = {"grad_acc": self.acc, "opt_state": self.opt_state}
        shapes = jax.eval_shape(fresh, params)
        outs = {k: parts.get(k, self.plan.replicated) for k in shapes}
        return jax.jit(fresh, in_shardings=(self.params,), out_shardings=outs)

    # -- period > 1: per-device micro-steps, one reduction per period ------------------------------
    def _local(self, graph: Graph):
        """`(params, data, acc, counter) -> the graph's outputs, one per shard on axis 0`.

        PRNG keys among the params are folded with the shard's index, so that shards draw
        independent random values (one device's draws over the whole micro-batch cannot be
        reproduced shard by shard)."""
        fn, keyed, axis = as_function(graph), self.keyed, self.plan.data_axis

        def one_shard(batch, acc, shard, params, keys, counter):
            x, *labels = batch
            if keyed:
                x = (x, jax.tree.map(lambda k: jax.random.fold_in(k, shard), keys))
            return fn(params, x, *labels, acc, counter)

        mapped = jax.vmap(one_shard, in_axes=(0, 0, 0, None, None, None), spmd_axis_name=axis)

        def run(params, data, acc, counter):
            (x, keys), labels = (data[0] if keyed else (data[0], None)), data[1:]
            shards = jnp.arange(self.plan.size, dtype=jnp.uint32)
            return mapped(self.plan.split((x, *labels)), acc, shards, params, keys, counter)

        return run

    def _reduce(self, acc):
        """The period's one reduction: the sum of the per-device accumulators."""
        return jax.tree.map(lambda a, s: lax.with_sharding_constraint(jnp.sum(a, 0), s),
                            acc, self.params)

    def grad(self, graph: Graph, donate=()):
        """`(params, *data, acc, counter) -> (value, acc, None[, finite])`: no collective."""
        local, raising = self._local(graph), self.mode == "raise"

        def step(params, *args):
            *data, acc, counter = args
            out = local(params, data, acc, counter)
            value, new_acc = out[0], out[1]
            if not raising:
                return value, new_acc, None
            ok = jnp.all(out[-1])
            return value, _keep_if(ok, new_acc, acc), None, ok

        rep, batched = self.plan.replicated, self.plan.batched
        outs = (batched, self.acc, None) + ((rep,) if raising else ())
        jitted = jax.jit(step, in_shardings=(self.params, *self.data, self.acc, rep),
                         out_shardings=outs, donate_argnums=donate)
        return MeshStep(jitted, self.stats, self.pace)

    def opt(self, graph: Graph, update: Graph, donate=()):
        """`(params, *data, acc, counter, opt_state) -> (value, acc, None, params, opt_state
        [, finite])`: the last micro-step, the reduction, the update."""
        local, update_fn, mode = self._local(graph), as_function(update), self.mode

        def step(params, *args):
            *data, acc, counter, opt_state = args
            out = local(params, data, acc, counter)
            value, new_acc = out[0], out[1]
            up = update_fn(params, self._reduce(new_acc), opt_state)
            new_params, new_opt = up[1], up[2]
            if mode == "ignore":
                return value, new_acc, None, new_params, new_opt
            ok = jnp.logical_and(up[-1], jnp.all(out[-1]))
            new_params, new_opt = _keep_if(ok, new_params, params), _keep_if(ok, new_opt,
                                                                             opt_state)
            if mode == "raise":
                new_acc = _keep_if(ok, new_acc, acc)
            return value, new_acc, None, new_params, new_opt, ok

        rep, batched = self.plan.replicated, self.plan.batched
        outs = (batched, self.acc, None, self.params, self.opt_state)
        outs += () if mode == "ignore" else (rep,)
        jitted = jax.jit(step, in_shardings=(self.params, *self.data, self.acc, rep,
                                             self.opt_state),
                         out_shardings=outs, donate_argnums=donate)
        return MeshStep(jitted, self.stats, self.pace)

    def period_function(self, graph: Graph, update: Graph, donate=()):
        """`step_period`'s function on the mesh: the micro-steps scanned, then one reduction and
        the update (checked as `Optimizer.period_function` checks it: the update only)."""
        local, update_fn, mode = self._local(graph), as_function(update), self.mode
        keyed, labelled = self.keyed, self.labelled

        def run(params, acc, opt_state, xs, ys, keys=None):
            def body(carry, batch):
                acc, counter = carry
                data = ((batch[0], keys) if keyed else batch[0],) + tuple(batch[1:])
                out = local(params, data, acc, counter)
                return (out[1], counter + 1), out[0]

            batches = (xs, ys) if labelled else (xs,)
            (new_acc, _), values = lax.scan(body, (acc, jnp.int32(0)), batches)
            up = update_fn(params, self._reduce(new_acc), opt_state)
            new_params, new_opt = up[1], up[2]
            ok = up[-1] if mode != "ignore" else jnp.bool_(True)
            if mode != "ignore":
                new_params, new_opt = (_keep_if(ok, new_params, params),
                                       _keep_if(ok, new_opt, opt_state))
            if mode == "raise":
                new_acc = _keep_if(ok, new_acc, acc)
            return new_params, new_acc, new_opt, jax.vmap(combine)(values), ok

        return self.jit_period(run, donate)

    def jit_period(self, run, donate=()):
        """`jax.jit` of a period function `(params, acc, opt_state, xs, ys[, keys])`, the stacked
        micro-batches split along the data axis on their axis 1."""
        rep = self.plan.replicated
        stacked = self.plan.sharding(None, self.plan.data_axis)
        acc = self.acc if self.period > 1 else None
        ins = (self.params, acc, self.opt_state, stacked,
               stacked if self.labelled else None) + ((rep,) if self.keyed else ())
        return MeshStep(jax.jit(run, in_shardings=ins,
                                out_shardings=(self.params, acc, self.opt_state, rep, rep),
                                donate_argnums=donate), pace=self.pace, value_at=3)
