"""`epoch` and `fit`: ggml_opt_epoch and ggml_opt_fit over an `Optimizer` and a `Dataset`.

`epoch` trains on the physical batches before `idata_split` and evaluates on the rest, in the
dataset's current order; it neither shuffles nor resets results. `fit` derives the period from a
logical and a physical batch size, splits off a validation tail (whole logical batches), shuffles
everything once and the training part every epoch (explicit JAX key) on its own copy of the
dataset's order (the caller's Dataset is never changed: same key, same run), and shows a progress
bar with loss ± uncertainty, accuracy and ETA (tqdm; `progress=False` turns it off).

Stopping. Ctrl-C stops `fit` at the next step boundary (a second Ctrl-C aborts at once): it writes
`checkpoint_path` if given, and re-raises `KeyboardInterrupt` with `.state`, `.params` and
`.history` attached. A non-finite step (`on_nonfinite="raise"`, the default) raises
`NonFiniteError` naming the epoch and batch, with the last finite state attached (and written to
`checkpoint_path`). `checkpoint_every=N` also writes the checkpoint every N optimizer steps (or
`"epoch"`); `fit` with an existing `checkpoint_path` resumes from it and, given the same
arguments, ends bitwise where the uninterrupted run ends. A checkpoint written by another setup
(another model, optimizer or batch: its fingerprint differs) is refused and left as it is, unless
`strict=False`. `checkpoint_path` is probed for writing before the first step; a write that fails
later raises `CheckpointError` with `.state`, `.params` and `.history` attached.

Many devices: `fit(..., mesh=mesh)` (or a `Dataset` made with a mesh) trains data-parallel on the
mesh (see `Optimizer`); the physical batch must divide evenly over the mesh's `data_axis`.
Checkpoints hold full arrays, so a run may resume on a mesh of another size, or on none.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from jgraph.errors import JGraphError
from jgraph.training.arguments import (
    NONFINITE_MODES,
    ArgumentError,
    CheckpointError,
    NonFiniteError,
    choice,
    integer,
    positive_int,
    real,
)
from jgraph.training.dataset import Dataset
from jgraph.training.fit_state import HISTORY_FIELDS, Position, key_to_json, position_from_json
from jgraph.training.interrupts import StopRequest
from jgraph.training.mesh import MeshPlan
from jgraph.training.optimizer import Optimizer
from jgraph.training.result import Result
from jgraph.training.state_io import StateFileError, check_writable
from jgraph.training.train_state import TrainState


def epoch(opt: Optimizer, state: TrainState, dataset: Dataset, result_train: Result | None,
          result_eval: Result | None, idata_split: int = -1, callback=None,
          batch_size: int | None = None, start: int = 0) -> TrainState:
    """One pass over `dataset`: train before `idata_split`, evaluate after it.

    Args:
        opt: the `Optimizer` (after `init`).
        state: its state.
        dataset: a `Dataset`.
        result_train: a `Result` the training steps' outputs are added to (or None).
        result_eval: a `Result` the evaluations' outputs are added to (or None).
        idata_split: the datapoint where training ends and evaluation starts (< 0: train on
            all).
        callback: `callback(train, state, result, ibatch, ibatch_max)`, run after every batch
            (`ibatch` counts from 1 within the section).
        batch_size: the batch size (default: the optimizer's example batch size).
        start: skip the first training batches (a resumed epoch).

    Returns:
        The new state."""
    bs = opt.batch_size if batch_size is None else positive_int(batch_size, "epoch: batch_size")
    idata_split = integer(idata_split, "epoch: idata_split")
    nbatches = dataset.ndata // bs
    if idata_split < 0:
        split = nbatches
    elif idata_split % bs:
        raise JGraphError(f"epoch: idata_split={idata_split} is not a multiple of the batch size "
                          f"{bs}")
    else:
        split = min(idata_split // bs, nbatches)
    labelled = opt.needs_labels
    for ibatch in range(integer(start, "epoch: start", 0, split), split):
        x, y = dataset.batch(ibatch, bs)
        state, out = opt.step(state, x, y if labelled else None)
        if result_train is not None:
            result_train.add(out)
        if callback is not None:
            callback(True, state, result_train, ibatch + 1, split)
    for ibatch in range(split, nbatches):
        x, y = dataset.batch(ibatch, bs)
        out = opt.evaluate(state, x, y if labelled else None)
        if result_eval is not None:
            result_eval.add(out)
        if callback is not None:
            callback(False, state, result_eval, ibatch - split + 1, nbatches - split)
    return state


@dataclass
class History:
    """Per-epoch statistics of `fit` (loss and accuracy with uncertainties), and its end state."""

    train_loss: list = field(default_factory=list)
    train_loss_unc: list = field(default_factory=list)
    train_accuracy: list = field(default_factory=list)
    train_accuracy_unc: list = field(default_factory=list)
    val_loss: list = field(default_factory=list)
    val_loss_unc: list = field(default_factory=list)
    val_accuracy: list = field(default_factory=list)
    val_accuracy_unc: list = field(default_factory=list)
    seconds: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # non-finite steps dropped (on_nonfinite="skip")
    state: Any = None  # the final TrainState (for save / resume)
    optimizer: Any = None  # the Optimizer that ran
    interrupted: bool = False  # stopped early (Ctrl-C or a non-finite step)

    def record(self, prefix: str, result: Result) -> None:
        loss, loss_unc = result.loss() if result.nbatches else (np.nan, np.nan)
        acc, acc_unc = result.accuracy()
        for name, value in (("loss", loss), ("loss_unc", loss_unc), ("accuracy", acc),
                            ("accuracy_unc", acc_unc)):
            getattr(self, f"{prefix}_{name}").append(value)

    def to_json(self) -> dict:
        """The per-epoch lists (counts as ints, statistics as floats; NaN is kept)."""
        kind = lambda name: int if name == "skipped" else float  # noqa: E731
        return {name: [kind(name)(v) for v in getattr(self, name)] for name in HISTORY_FIELDS}

    @classmethod
    def from_json(cls, obj: dict, optimizer=None) -> History:
        """The inverse of `to_json` (`obj` checked by `fit_state.position_from_json`)."""
        lists = {name: [int(v) if name == "skipped" else float(v) for v in obj[name]]
                 for name in HISTORY_FIELDS}
        return cls(**lists, optimizer=optimizer)


def _describe(result: Result) -> str:
    loss, unc = result.loss()
    text = f"loss={loss:.4g}±{unc:.2g}"
    acc, acc_unc = result.accuracy()
    if not np.isnan(acc):
        text += f" acc={100 * acc:.2f}±{100 * acc_unc:.2f}%"
    return text


class _ProgressBar:
    """A tqdm bar over one epoch's batches; refreshed a few dozen times per epoch."""

    def __init__(self, total: int, desc: str, enabled: bool, done: int = 0):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="batch", leave=True, initial=done)
        self.every = max(1, total // 20)
        self.done = done

    def __call__(self, train, state, result, ibatch, ibatch_max):
        if self.bar is None:
            return
        self.done += 1
        if ibatch == ibatch_max or ibatch % self.every == 0:
            self.bar.update(self.done - self.bar.n)
            if result is not None and result.ndata:
                self.bar.set_postfix_str(("train " if train else "val ") + _describe(result),
                                         refresh=False)

    def close(self):
        if self.bar is not None:
            self.bar.close()


@dataclass
class _Plan:
    """The batch arithmetic of a fit run."""

    ndata: int  # datapoints served per epoch
    batch_size: int  # logical batch
    physical: int  # micro-batch
    period: int  # micro-batches per logical batch
    idata_split: int  # datapoints trained on per epoch; the rest is validation
    ntrain: int  # training micro-batches per epoch
    nbatches: int  # micro-batches per epoch


def _plan(dataset: Dataset, batch_size, physical_batch_size, val_split, devices=1) -> _Plan:
    ndata = dataset.ndata
    batch_size = ndata if batch_size is None else positive_int(batch_size, "fit: batch_size")
    physical = (batch_size if physical_batch_size is None
                else positive_int(physical_batch_size, "fit: physical_batch_size"))
    if batch_size % physical:
        raise ArgumentError(f"fit: batch_size {batch_size} is not a multiple of "
                            f"physical_batch_size {physical}")
    if batch_size > ndata:
        raise ArgumentError(f"fit: batch_size {batch_size} exceeds the {ndata} datapoints")
    if physical % dataset.shard_size:
        raise ArgumentError(f"fit: physical_batch_size {physical} is not a multiple of the "
                            f"dataset's shard size {dataset.shard_size}")
    if physical % devices:
        raise ArgumentError(f"fit: physical_batch_size {physical} is not divisible by the "
                            f"{devices} devices of the mesh's data axis")
    val_split = real(val_split, "fit: val_split", 0.0, 1.0, high_open=True)
    period = batch_size // physical
    ibatch_split = int((1.0 - val_split) * (ndata // batch_size)) * period
    if ibatch_split == 0:
        raise ArgumentError(f"fit: val_split={val_split} leaves no training batch")
    return _Plan(ndata, batch_size, physical, period, ibatch_split * physical, ibatch_split,
                 ndata // physical)


def _placement(dataset: Dataset, mesh, data_axis) -> MeshPlan | None:
    """The mesh fit trains on: `mesh`, else the dataset's; both given, they must agree."""
    if mesh is None:
        return dataset.plan
    plan = MeshPlan(mesh, data_axis)
    if dataset.plan is not None and (dataset.plan.mesh != mesh
                                     or dataset.plan.data_axis != data_axis):
        raise ArgumentError(f"fit: mesh/data_axis {data_axis!r} differ from the dataset's "
                            f"(axis {dataset.plan.data_axis!r}); give one of them")
    return plan


def _checkpoint_every(every, path):
    if every is None:
        return None
    if path is None:
        raise ArgumentError("fit: checkpoint_every needs a checkpoint_path")
    if every == "epoch":
        return every
    return positive_int(every, "fit: checkpoint_every (optimizer steps, or 'epoch')")


class _Stop(Exception):
    """Ctrl-C asked the run to stop (raised at a step boundary, caught by `fit`)."""


def _attach(error, state, history):
    history.state, history.interrupted = state, True
    error.state, error.history, error.params = state, history, state.params
    return error


class _Run:
    """One fit run: the loop over epochs, checkpoints, and the ways it stops."""

    def __init__(self, opt: Optimizer, ds: Dataset, plan: _Plan, epochs: int, every, path,
                 progress: bool, callback, strict: bool = True):
        self.opt, self.ds, self.plan, self.epochs = opt, ds, plan, epochs
        self.every, self.path, self.progress, self.callback = every, path, progress, callback
        self.strict = strict
        self.stop = None
        self.clock = time.perf_counter()

    def begin(self, state, key, config):
        """`(state, position, history)`: resumed from the checkpoint, or a fresh start."""
        if self.path is not None and self.path.exists():
            state, extra = self.opt.load(self.path, dataset=self.ds, extra=True,
                                         strict=self.strict)
            if not isinstance(extra, dict) or "fit" not in extra:
                raise StateFileError(f"{self.path}: field extra.fit is missing: a state file, "
                                     f"but not a fit checkpoint")
            pos = position_from_json(extra["fit"], config, self.plan.ntrain,
                                     f"{self.path}: extra.fit")
            if int(state.counter) != pos.batch % self.plan.period:
                raise StateFileError(f"{self.path}: field counter is {int(state.counter)}, but "
                                     f"{pos.batch} batches into the epoch it is "
                                     f"{pos.batch % self.plan.period}")
            if pos.epoch > self.epochs + 1:
                raise ArgumentError(f"fit: epochs={self.epochs}, but the checkpoint "
                                    f"{self.path} has {pos.epoch - 1} epochs done")
            return state, pos, History.from_json(pos.history, self.opt)
        pos = Position(config, key)
        if self.plan.batch_size < self.plan.ndata:
            pos.key, sub = jax.random.split(pos.key)
            self.ds.shuffle(sub)
        return state, pos, History(optimizer=self.opt)

    def save(self, state, pos: Position, history: History) -> None:
        if self.path is None:
            return
        seconds = pos.seconds + (time.perf_counter() - self.clock if pos.started else 0.0)
        snapshot = Position(**{**pos.__dict__, "history": history.to_json(),
                               "seconds": seconds})
        try:
            self.opt.save(state, self.path, dataset=self.ds, extra={"fit": snapshot.to_json()})
        except Exception as e:  # noqa: BLE001 - whatever failed, the trained state is handed over
            raise _attach(CheckpointError(
                f"fit: cannot write the checkpoint {str(self.path)!r} in epoch {pos.epoch} after "
                f"{pos.step} micro-steps ({type(e).__name__}: {e}); the state, params and history "
                f"at that point are attached (`error.state`, `error.params`, `error.history`): "
                f"save them elsewhere with `error.history.optimizer.save(error.state, path)`"),
                state, history) from e

    def check_stop(self):
        if self.stop is not None and self.stop.requested:
            raise _Stop

    def run(self, state, pos: Position, history: History):
        with StopRequest() as self.stop:
            try:
                return self._loop(state, pos, history)
            except KeyboardInterrupt as e:  # also a second Ctrl-C: abort at once, write nothing
                if not hasattr(e, "state"):
                    _attach(e, self.opt.latest_state, history)
                raise

    def _loop(self, state, pos: Position, history: History):
        plan, opt = self.plan, self.opt
        try:
            while pos.epoch <= self.epochs:
                state = self.one_epoch(state, pos, history)
            self.check_stop()
            history.state = state
            self.save(state, pos, history)  # the final checkpoint; a Ctrl-C only asks
            self.check_stop()
        except _Stop:
            state = opt.latest_state
            self.save(state, pos, history)
            where = ("after its last epoch" if pos.epoch > self.epochs else
                     f"in epoch {pos.epoch} after {pos.batch} of {plan.ntrain} training batches")
            raise _attach(KeyboardInterrupt(
                f"fit stopped by Ctrl-C {where}; state, params and history are attached"
                + (f" and saved to {self.path}" if self.path else "")), state, history) from None
        except NonFiniteError as e:
            state = opt.latest_state
            self.save(state, pos, history)
            raise _attach(NonFiniteError(
                f"fit: non-finite loss, gradient or update in epoch {pos.epoch}, training "
                f"batch {pos.batch + 1} of {plan.ntrain} (micro-step {pos.step + 1} of the "
                f"run); the step was dropped: the attached state, params and history are the "
                f"last finite ones" + (f", saved to {self.path}" if self.path else "")
                + ". on_nonfinite='skip' drops such steps and goes on.", state),
                state, history) from e
        return state.params, history

    def one_epoch(self, state, pos: Position, history: History):
        plan, e = self.plan, pos.epoch
        self.check_stop()
        if not pos.started:
            if plan.batch_size < plan.idata_split:
                pos.key, sub = jax.random.split(pos.key)
                self.ds.shuffle(sub, plan.idata_split)
            pos.started, pos.train, pos.seconds = True, Result(), 0.0
        train, val = pos.train or Result(), Result()
        pos.train = train
        bar = _ProgressBar(plan.nbatches, f"epoch {e}/{self.epochs}", self.progress, pos.batch)
        every = self.every if isinstance(self.every, int) else None

        def after_batch(is_train, state, result, ibatch, ibatch_max):
            bar(is_train, state, result, ibatch, ibatch_max)
            if is_train:
                pos.batch, pos.step = pos.batch + 1, pos.step + 1
                if every and pos.step % (every * plan.period) == 0:
                    self.save(state, pos, history)
            self.check_stop()

        self.clock = time.perf_counter()
        try:
            state = epoch(self.opt, state, self.ds, train, val, plan.idata_split, after_batch,
                          batch_size=plan.physical, start=pos.batch)
            jax.block_until_ready(state.params)
        finally:
            bar.close()
        history.seconds.append(pos.seconds + time.perf_counter() - self.clock)
        history.record("train", train)
        history.record("val", val)
        history.skipped.append(train.nonfinite)
        pos.epoch, pos.started, pos.batch, pos.train, pos.seconds = e + 1, False, 0, None, 0.0
        if self.every == "epoch":
            self.save(state, pos, history)
        if self.callback is not None:
            self.callback(e, history)
        return state


def fit(fn, params, dataset: Dataset, loss: str = "mean", tx=None, epochs: int = 1,
        batch_size: int | None = None, physical_batch_size: int | None = None,
        val_split: float = 0.0, progress: bool = True, remat=None, static: bool = True,
        key=None, callback=None, on_nonfinite: str = "raise", checkpoint_every=None,
        checkpoint_path=None, mesh=None, data_axis: str = "data", param_sharding=None,
        strict: bool = True):
    """Train `fn`'s params on `dataset` (ggml_opt_fit).

    Ctrl-C stops it at the next step boundary (a second one aborts at once), writes
    `checkpoint_path` and re-raises `KeyboardInterrupt` with `.state`, `.params` and `.history`;
    running the same `fit` again resumes from the file. See the module docstring.

    Args:
        fn: the model: `fn(params, inputs)`, its output reduced or compared with labels by `loss`.
        params: the initial params (a pytree of arrays).
        dataset: a `Dataset` (with labels for `"cross_entropy"` / `"mse"`).
        loss: `"mean"`, `"sum"`, `"cross_entropy"` or `"mse"` (as `Optimizer`'s).
        tx: an optax transformation; default ggml's AdamW (1e-3, 0.9, 0.999, 1e-8, no weight
            decay).
        epochs: passes over the data.
        batch_size: the logical batch (default: all data).
        physical_batch_size: the micro-batch (default: the logical one); their ratio is the
            accumulation period.
        val_split: the share of the data held out for evaluation after each epoch.
        progress: show a progress bar.
        remat: as `Optimizer`'s (`{"budget": ...}`, a policy, ...).
        static: as `Optimizer`'s.
        key: the `jax.random` key that shuffles the data (default: `jax.random.PRNGKey(0)`).
        callback: `callback(epoch, history)`, run after each epoch.
        on_nonfinite: `"raise"` (stop with `NonFiniteError`, keeping the last finite state),
            `"skip"` (drop non-finite updates, as `optax.apply_if_finite`), `"ignore"`.
        checkpoint_every: write the state every N optimizer steps (or `"epoch"`).
        checkpoint_path: where the state is written when the run ends or stops; an existing one
            is resumed.
        mesh: train on a `jax.sharding.Mesh` (default: the dataset's mesh, if any), as
            `Optimizer` does.
        data_axis: the mesh axis the batch is split along.
        param_sharding: FSDP-style sharding of params and state, as `Optimizer`'s.
        strict: resume only a checkpoint written by the same setup (its fingerprint: model,
            optimizer, loss, period, batch shapes); `False` resumes another one whose state has
            the same shapes (a deliberate transfer).

    Returns:
        `(params, history)`: the trained params and a `History` (per-epoch `train_loss`,
        `val_loss`, `train_accuracy`, `val_accuracy` with their uncertainties, `seconds`,
        `skipped`, and the end `state`)."""
    if not isinstance(dataset, Dataset):
        raise ArgumentError(f"fit: dataset must be a jg.Dataset, got {type(dataset).__name__}")
    epochs = positive_int(epochs, "fit: epochs")
    placement = _placement(dataset, mesh, data_axis)
    plan = _plan(dataset, batch_size, physical_batch_size, val_split,
                 1 if placement is None else placement.size)
    on_nonfinite = choice(on_nonfinite, "fit: on_nonfinite", NONFINITE_MODES)
    if not isinstance(strict, bool):
        raise ArgumentError(f"fit: strict must be True or False, got {strict!r}")
    if checkpoint_path is not None and not isinstance(checkpoint_path, str | os.PathLike):
        raise ArgumentError(f"fit: checkpoint_path must be a str or a path, got "
                            f"{type(checkpoint_path).__name__}")
    path = None if checkpoint_path is None else Path(checkpoint_path)
    every = _checkpoint_every(checkpoint_every, path)
    if path is not None:  # before the first step (and the compile), not after the last
        check_writable(path, "fit: checkpoint_path")
    tx = tx if tx is not None else optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8,
                                               weight_decay=0.0)
    key = key if key is not None else jax.random.PRNGKey(0)
    try:
        key_json = key_to_json(key)
    except (AttributeError, TypeError, ValueError, JGraphError) as e:
        raise ArgumentError(f"fit: key must be a JAX PRNG key, got {key!r:.60}") from e
    ds = dataset.copy()  # fit shuffles its own order: the caller's dataset never changes
    ds.plan = placement
    mesh, data_axis = (None, "data") if placement is None else (placement.mesh,
                                                                placement.data_axis)
    opt = Optimizer(fn, tx, loss=loss, period=plan.period, static=static, remat=remat,
                    on_nonfinite=on_nonfinite, mesh=mesh, data_axis=data_axis,
                    param_sharding=param_sharding)
    x0, y0 = ds.batch(0, plan.physical)
    state = opt.init(params, x0, y0 if opt.needs_labels else None)
    if opt.needs_labels:
        opt.check_labels(ds.labels)  # every class id, once, before the first step
    config = {"loss": loss, "ndata": plan.ndata, "shard_size": ds.shard_size,
              "batch_size": plan.batch_size, "physical_batch_size": plan.physical,
              "val_split": float(val_split), "key": key_json}
    run = _Run(opt, ds, plan, epochs, every, path, progress, callback, strict)
    state, pos, history = run.begin(state, key, config)
    return run.run(state, pos, history)
