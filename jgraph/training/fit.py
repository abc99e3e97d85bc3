"""`epoch` and `fit`: ggml_opt_epoch and ggml_opt_fit over an `Optimizer` and a `Dataset`.

`epoch` trains on the physical batches before `idata_split` and evaluates on the rest, in the
dataset's current order; it neither shuffles nor resets results. `fit` derives the period from a
logical and a physical batch size, splits off a validation tail (whole logical batches), shuffles
everything once and the training part every epoch (explicit JAX key), and shows a progress bar with
loss ± uncertainty, accuracy and ETA (tqdm; `progress=False` turns it off).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import optax

from jgraph.errors import JGraphError
from jgraph.training.dataset import Dataset
from jgraph.training.optimizer import Optimizer, TrainState
from jgraph.training.result import Result


def epoch(opt: Optimizer, state: TrainState, dataset: Dataset, result_train: Result | None,
          result_eval: Result | None, idata_split: int = -1, callback=None,
          batch_size: int | None = None) -> TrainState:
    """One pass over `dataset`: train before `idata_split` (< 0: all), evaluate after it.

    `callback(train, state, result, ibatch, ibatch_max)` runs after every batch (`ibatch` counts
    from 1 within the section). `batch_size` defaults to the optimizer's example batch size.
    """
    bs = batch_size or opt.batch_size
    nbatches = dataset.ndata // bs
    if idata_split < 0:
        split = nbatches
    elif idata_split % bs:
        raise JGraphError(f"epoch: idata_split={idata_split} is not a multiple of the batch size "
                          f"{bs}")
    else:
        split = min(idata_split // bs, nbatches)
    labelled = opt.needs_labels
    for ibatch in range(split):
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
    state: Any = None  # the final TrainState (for save / resume)
    optimizer: Any = None  # the Optimizer that ran

    def record(self, prefix: str, result: Result) -> None:
        loss, loss_unc = result.loss() if result.nbatches else (np.nan, np.nan)
        acc, acc_unc = result.accuracy()
        for name, value in (("loss", loss), ("loss_unc", loss_unc), ("accuracy", acc),
                            ("accuracy_unc", acc_unc)):
            getattr(self, f"{prefix}_{name}").append(value)


def _describe(result: Result) -> str:
    loss, unc = result.loss()
    text = f"loss={loss:.4g}±{unc:.2g}"
    acc, acc_unc = result.accuracy()
    if not np.isnan(acc):
        text += f" acc={100 * acc:.2f}±{100 * acc_unc:.2f}%"
    return text


class _ProgressBar:
    """A tqdm bar over one epoch's batches; refreshed a few dozen times per epoch."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="batch", leave=True)
        self.every = max(1, total // 20)
        self.done = 0

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


def fit(fn, params, dataset: Dataset, loss: str = "mean", tx=None, epochs: int = 1,
        batch_size: int | None = None, physical_batch_size: int | None = None,
        val_split: float = 0.0, progress: bool = True, remat=None, static: bool = True,
        key=None, callback=None):
    """Train `fn`'s params on `dataset`; return `(params, History)` (ggml_opt_fit).

    `batch_size` is the logical batch (default: all data), `physical_batch_size` the micro-batch
    (default: the logical one); their ratio is the accumulation period. `tx` defaults to ggml's
    AdamW (1e-3, 0.9, 0.999, 1e-8, no weight decay). `callback(epoch, history)` runs after each
    epoch.
    """
    ndata = dataset.ndata
    batch_size = batch_size or ndata
    physical = physical_batch_size or batch_size
    if batch_size % physical:
        raise JGraphError(f"fit: batch_size {batch_size} is not a multiple of "
                          f"physical_batch_size {physical}")
    if batch_size > ndata:
        raise JGraphError(f"fit: batch_size {batch_size} exceeds the {ndata} datapoints")
    if not 0.0 <= val_split < 1.0:
        raise JGraphError(f"fit: val_split must be in [0, 1), got {val_split}")
    period = batch_size // physical
    nbatches_logical = ndata // batch_size
    ibatch_split = int((1.0 - val_split) * nbatches_logical) * period
    idata_split = ibatch_split * physical
    if ibatch_split == 0:
        raise JGraphError(f"fit: val_split={val_split} leaves no training batch")
    tx = tx if tx is not None else optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8,
                                               weight_decay=0.0)
    key = key if key is not None else jax.random.PRNGKey(0)
    opt = Optimizer(fn, tx, loss=loss, period=period, static=static, remat=remat)
    x0, y0 = dataset.batch(0, physical)
    state = opt.init(params, x0, y0 if opt.needs_labels else None)
    history = History(optimizer=opt)
    if batch_size < ndata:
        key, sub = jax.random.split(key)
        dataset.shuffle(sub)
    nbatches = ndata // physical
    for e in range(1, epochs + 1):
        if batch_size < idata_split:
            key, sub = jax.random.split(key)
            dataset.shuffle(sub, idata_split)
        train, val = Result(), Result()
        bar = _ProgressBar(nbatches, f"epoch {e}/{epochs}", progress)
        start = time.perf_counter()
        try:
            state = epoch(opt, state, dataset, train, val, idata_split, bar, batch_size=physical)
            jax.block_until_ready(state.params)
        finally:
            bar.close()
        history.seconds.append(time.perf_counter() - start)
        history.record("train", train)
        history.record("val", val)
        if callback is not None:
            callback(e, history)
    history.state = state
    return state.params, history
