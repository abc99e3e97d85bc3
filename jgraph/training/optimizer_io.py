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

Each file also records a fingerprint of what produced the state (`jgraph.training.fingerprint`:
the forward graph, the optax transformation and its state's structure, loss, period, batch
shapes). `load(path, strict=True)` refuses a file whose fingerprint differs from this Optimizer's,
saying what differs; `strict=False` loads it anyway (a deliberate transfer: the shapes must still
agree). A file of the previous format version, which has no fingerprint, loads with a warning.
"""

from __future__ import annotations

import re
import warnings

import jax
import numpy as np
from jax.experimental import multihost_utils

from jgraph.errors import JGraphError
from jgraph.training import fingerprint
from jgraph.training.arguments import ArgumentError
from jgraph.training.fingerprint import differences
from jgraph.training.leaves import deleted, dtype_of, split_keys
from jgraph.training.mesh import host
from jgraph.training.state_io import (
    StateFileError,
    StateFileWarning,
    as_path,
    dataset_order,
    is_folder,
    read_state,
    save_state,
)
from jgraph.training.train_state import TrainState


class StateFiles:
    """The saving half of `Optimizer` (a mixin: it reads the Optimizer's builds and settings)."""

    def _init_build(self, what: str):
        """The build `init` made (its state template; in dynamic mode, later builds have none)."""
        if self._init is None or self._init.state_template is None:
            raise JGraphError(f"Optimizer.{what}: call init(params, example_inputs) first, so "
                              f"the optimizer knows the state's structure")
        return self._init

    def _template(self, what: str):
        return self._init_build(what).state_template

    def settings(self) -> dict:
        """The settings a state file records and `load` requires to match (whatever `strict`)."""
        return {"format": "jgraph.Optimizer", "loss": self.loss, "period": self.period}

    def fingerprint(self) -> dict:
        """What this Optimizer's states come from, as its state files record it (computed once
        per `init`; see `jgraph.training.fingerprint`)."""
        build = self._init_build("fingerprint")
        if self._fingerprint is None:
            template = self._file_template("fingerprint")
            self._fingerprint = fingerprint.fingerprint(
                forward=build.graphs["forward"], tx=self.tx,
                trainable=split_keys(template.params)[0], opt_state=template.opt_state,
                loss=self.loss, period=self.period, static=self.static, batch=self._batch)
        return self._fingerprint

    def _check_fingerprint(self, header: dict, path, strict: bool) -> None:
        """`StateFileError` saying what differs if the file was written by another setup."""
        found = header.get("meta", {}).get("fingerprint")
        if header.get("version") == 2:
            warnings.warn(f"{path} has state file format version 2, which records no "
                          f"fingerprint of the model and optimizer that wrote it: loaded "
                          f"without checking where it came from (save it again to add one)",
                          StateFileWarning, stacklevel=5)  # at the caller of load
            return
        if not strict:
            return
        if found is None:
            raise StateFileError(f"{path}: field meta.fingerprint is missing (a file not written "
                                 f"by Optimizer.save); load it with strict=False to accept it")
        diffs = differences(found, self.fingerprint())
        if diffs:
            raise StateFileError(f"{path} was written by another training setup:\n  "
                                 + "\n  ".join(diffs) + "\nload it with strict=False (fit(..., "
                                 "strict=False)) to transfer the state deliberately")

    def checked_state(self, state, what: str = "Optimizer.save"):
        """`state` if it is a state of this Optimizer (structure, shapes, dtypes, counter in
        range), with its counter as `np.int32`; `ArgumentError` saying what differs otherwise."""
        template = self._template(what.split(".")[-1])
        if not isinstance(state, TrainState):
            raise ArgumentError(f"{what}: expected a TrainState (from init, step or load), got "
                                f"{type(state).__name__}")
        problem = foreign_state(state, template)
        if problem:
            raise ArgumentError(f"{what}: this is the state of a different Optimizer: {problem}")
        return state._replace(counter=np.int32(self._micro_step(state, what)))

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
            state = state._replace(grad_acc=self._init.steps.summed(state.grad_acc))
        return jax.tree.map(host, state)

    def _from_file(self, state):
        """A state read from a file, placed on the mesh."""
        steps, plan = self._init.steps, self.plan
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
        path = as_path(path, "Optimizer.save")  # checked by every process (only 0 writes)
        if is_folder(path, "Optimizer.save:"):
            raise ArgumentError(f"Optimizer.save: {str(path)!r} is a folder, not a file path")
        dataset_order(dataset, "Optimizer.save")
        state = self.checked_state(state)
        meta = {**self.settings(), "fingerprint": self.fingerprint()}
        if self.plan is None:
            save_state(path, state, dataset=dataset, extra=extra, meta=meta)
            return
        state = self._to_file(state)
        if jax.process_index() == 0:
            save_state(path, state, dataset=dataset, extra=extra, meta=meta)
        _barrier("jgraph.Optimizer.save")

    def load(self, path, dataset=None, extra: bool = False, strict: bool = True):
        """Read a state written by `save` (and set `dataset`'s order); with `extra=True`, return
        `(state, extra)`. Everything read is checked (see `state_io`); a bad file raises
        `StateFileError` naming the field and changes nothing. With `strict` (the default), the
        file must have been written by the same setup (model, optimizer, loss, period, batch
        shapes: its fingerprint); `strict=False` accepts another one whose state has the same
        structure and shapes (a deliberate transfer)."""
        for name, value in (("strict", strict), ("extra", extra)):
            if not isinstance(value, bool):
                raise ArgumentError(f"Optimizer.load: {name} must be True or False, got "
                                    f"{value!r}")
        dataset_order(dataset, "Optimizer.load")
        template = self._file_template("load")
        nshards = None if dataset is None else dataset.nshards
        on_host = self.plan is not None
        state, permutation, header = read_state(
            path, template, nshards, meta=self.settings(), on_host=on_host,
            check=lambda header: self._check_fingerprint(header, path, strict))
        if not 0 <= int(state.counter) < self.period:
            raise StateFileError(f"{path}: field counter is {int(state.counter)}, outside "
                                 f"[0, {self.period}) for period {self.period}")
        if on_host:
            state = self._from_file(state)
        if dataset is not None:
            dataset.permutation = permutation
        self._record(state)
        return (state, header.get("extra")) if extra else state


def _leaf_text(leaf) -> str:
    return f"{getattr(dtype_of(leaf), 'name', dtype_of(leaf))}{list(np.shape(leaf))}"


def _listed(names: list, limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit
                                       else "")


def foreign_state(state, template) -> str | None:
    """What makes `state` differ from `template` (another Optimizer's state), in words; None if
    it has the template's structure, shapes and dtypes."""
    got = {jax.tree_util.keystr(p): leaf
           for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    want = {jax.tree_util.keystr(p): like
            for p, like in jax.tree_util.tree_flatten_with_path(template)[0]}
    problems = []
    kinds = lambda tree: re.findall(r"namedtuple\[(\w+)\]",  # noqa: E731
                                    str(jax.tree.structure(tree)))
    theirs, ours = kinds(getattr(state, "opt_state", None)), kinds(template.opt_state)
    if theirs != ours:
        problems.append(f"its optimizer state is {', '.join(theirs) or 'no optax state'}, this "
                        f"Optimizer's is {', '.join(ours)}")
    missing = [k for k in want if k not in got]
    unexpected = [k for k in got if k not in want]
    if missing:
        problems.append(f"it lacks {_listed(['state' + k for k in missing])}")
    if unexpected:
        problems.append(f"it has {_listed(['state' + k for k in unexpected])}, which this "
                        f"Optimizer's has not")
    shapes = [f"state{k} is {_leaf_text(got[k])}, this Optimizer's is {_leaf_text(want[k])}"
              for k in want if k in got and k != ".counter"
              and (tuple(np.shape(got[k])) != tuple(want[k].shape)
                   or dtype_of(got[k]) != want[k].dtype)]
    problems += shapes[:4] + ([f"{len(shapes) - 4} more leaves differ"] if len(shapes) > 4
                              else [])
    if not problems and jax.tree.structure(state) != jax.tree.structure(template):
        problems.append(f"its structure is {jax.tree.structure(state)}, this Optimizer's is "
                        f"{jax.tree.structure(template)}")
    return "; ".join(problems) or None


def _barrier(name: str) -> None:
    """Wait for every process (no-op in a single-process run)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)
