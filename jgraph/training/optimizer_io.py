"""`Optimizer.save` / `load` / `checked_state`: the training state to a file and back.

A state file holds full arrays, whatever the mesh: on a mesh the per-device accumulators are
written as their sum (the accumulated gradient, shaped like the params) and sharded leaves are
gathered whole (every process must call `save`, the gathering being collective; process 0
writes). `load` places what it reads on the Optimizer's own mesh, or on none, so a state moves
between meshes of any size: accumulators go to the first data shard (zeros elsewhere, so their
sum is exact). Resuming is bitwise where the arithmetic is the same: a state saved at a period
boundary resumes bitwise on a mesh of the same size (or with no mesh, from a no-mesh run). Within
a period, or on a mesh of another size, the gradients are summed in another order: equal to
rounding.
"""

from __future__ import annotations

import jax
import numpy as np

from jgraph.errors import JGraphError
from jgraph.training.arguments import ArgumentError
from jgraph.training.leaves import deleted, dtype_of
from jgraph.training.mesh import host


class StateFiles:
    """The saving half of `Optimizer` (a mixin: it reads the Optimizer's builds and settings)."""

    def _template(self, what: str):
        if self._last is None or self._last.state_template is None:
            raise JGraphError(f"Optimizer.{what}: call init(params, example_inputs) first, so "
                              f"the optimizer knows the state's structure")
        return self._last.state_template

    def settings(self) -> dict:
        """The settings a state file records and `load` requires to match."""
        return {"format": "jgraph.Optimizer", "loss": self.loss, "period": self.period}

    def checked_state(self, state, what: str = "Optimizer.save"):
        """`state` if it is a state of this Optimizer (structure, shapes, dtypes, counter in
        range), with its counter as `np.int32`; `ArgumentError` naming the leaf otherwise."""
        from jgraph.training.optimizer import TrainState

        template = self._template(what.split(".")[-1])
        if jax.tree.structure(state) != jax.tree.structure(template) or not isinstance(
                state, TrainState):
            raise ArgumentError(f"{what}: not a state of this Optimizer: its structure is "
                                f"{jax.tree.structure(state)}, expected "
                                f"{jax.tree.structure(template)}")
        state = state._replace(counter=np.int32(self._micro_step(state, what)))
        for (path, leaf), like in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                                      jax.tree.leaves(template), strict=True):
            if tuple(np.shape(leaf)) != tuple(like.shape) or dtype_of(leaf) != like.dtype:
                raise ArgumentError(f"{what}: state{jax.tree_util.keystr(path)} is "
                                    f"{dtype_of(leaf)}{list(np.shape(leaf))}, expected "
                                    f"{like.dtype}{list(like.shape)}")
        return state

    def _file_template(self, what: str):
        """The state as a file holds it: accumulators shaped like the params."""
        template = self._template(what)
        if self.plan is None or template.grad_acc is None:
            return template
        return template._replace(grad_acc=jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), template.grad_acc))

    def _to_file(self, state):
        """A checked mesh state as full host arrays, accumulators summed."""
        if deleted(state):
            raise ArgumentError("Optimizer.save: the state's buffers were donated to a later "
                                "step and deleted; save the Optimizer's `latest_state` instead")
        if state.grad_acc is not None:
            state = state._replace(grad_acc=self._last.steps.summed(state.grad_acc))
        return jax.tree.map(host, state)

    def _from_file(self, state):
        """A state read from a file, placed on the mesh."""
        steps, plan = self._last.steps, self.plan
        trainable, keys = self._split(state.params)
        params = self._merge(plan.put_tree(trainable, steps.params),
                             None if keys is None else plan.put_tree(
                                 keys, jax.tree.map(lambda _: plan.replicated, keys)))
        acc = None if state.grad_acc is None else plan.put_tree(plan.spread(state.grad_acc),
                                                               steps.acc)
        return state._replace(params=params, opt_state=plan.put_tree(state.opt_state,
                                                                     steps.opt_state),
                              grad_acc=acc)

    def save(self, state, path, dataset=None, extra=None) -> None:
        """Write the whole training state (and a dataset's order) atomically to `path`.

        The state is checked first (a donated, foreign or malformed state raises
        `ArgumentError` and writes nothing); `extra` is any JSON-serialisable value."""
        from jgraph.training.state_io import save_state

        state = self.checked_state(state)
        if self.plan is None:
            save_state(path, state, dataset=dataset, extra=extra, meta=self.settings())
            return
        state = self._to_file(state)
        if jax.process_index() == 0:
            save_state(path, state, dataset=dataset, extra=extra, meta=self.settings())
        _barrier("jgraph.Optimizer.save")

    def load(self, path, dataset=None, extra: bool = False):
        """Read a state written by `save` (and set `dataset`'s order); with `extra=True`, return
        `(state, extra)`. Everything read is checked (see `state_io`); a bad file raises
        `StateFileError` naming the field and changes nothing."""
        from jgraph.training.state_io import StateFileError, read_state

        template = self._file_template("load")
        nshards = None if dataset is None else dataset.nshards
        on_host = self.plan is not None
        state, permutation, header = read_state(path, template, nshards, meta=self.settings(),
                                                on_host=on_host)
        if not 0 <= int(state.counter) < self.period:
            raise StateFileError(f"{path}: field counter is {int(state.counter)}, outside "
                                 f"[0, {self.period}) for period {self.period}")
        if on_host:
            state = self._from_file(state)
        if dataset is not None:
            dataset.permutation = permutation
        self._record(state)
        return (state, header.get("extra")) if extra else state


def _barrier(name: str) -> None:
    """Wait for every process (no-op in a single-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
