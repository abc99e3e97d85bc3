"""Where a `fit` run is, so that a run resumed from its checkpoint equals the uninterrupted one.

A fit checkpoint is an ordinary state file (`Optimizer.save`): the `TrainState`, the dataset's
current order, and, in the header's `extra["fit"]`, a `Position` as JSON: the run's settings
(which a resume must match), the epoch in progress and whether its shuffle is done, the training
batches done in it, the current PRNG key, the finished epochs' history and the running epoch's
training statistics. Everything read back is checked and a mismatch raises `StateFileError`
naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jgraph.errors import JGraphError
from jgraph.training.result import Result
from jgraph.training.state_io import KEY_IMPLS, StateFileError

VERSION = 1
HISTORY_FIELDS = ("train_loss", "train_loss_unc", "train_accuracy", "train_accuracy_unc",
                  "val_loss", "val_loss_unc", "val_accuracy", "val_accuracy_unc", "seconds",
                  "skipped")


def key_to_json(key) -> dict:
    """A PRNG key (typed, or raw uint32 data) as JSON."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        impl, data = str(jax.random.key_impl(key)), np.asarray(jax.random.key_data(key))
    else:
        impl, data = None, np.asarray(key)
    if data.dtype != np.uint32:
        raise JGraphError(f"fit: key must be a JAX PRNG key, got dtype {data.dtype}")
    return {"impl": impl, "shape": list(np.shape(key)), "data": [int(v) for v in data.ravel()]}


def key_from_json(obj, like: dict, where: str):
    """The key stored in `obj`, which must be of the same kind and shape as `like`."""
    if not isinstance(obj, dict) or set(obj) != {"impl", "shape", "data"}:
        raise StateFileError(f"{where} must be an object with impl, shape and data")
    if obj["impl"] != like["impl"] or obj["shape"] != like["shape"]:
        raise StateFileError(f"{where} is a {obj['impl']!r:.40} key of shape "
                             f"{obj['shape']!r:.40}, expected {like['impl']!r} {like['shape']}")
    data = obj["data"]
    if (not isinstance(data, list) or len(data) != len(like["data"])
            or not all(type(v) is int and 0 <= v < 2**32 for v in data)):
        raise StateFileError(f"{where}.data must be {len(like['data'])} uint32 values")
    raw = np.asarray(data, np.uint32)
    if obj["impl"] is None:
        return jax.numpy.asarray(raw.reshape(like["shape"]))
    if obj["impl"] not in KEY_IMPLS:
        raise StateFileError(f"{where}.impl {obj['impl']!r:.40} is not a JAX key implementation")
    return jax.random.wrap_key_data(raw.reshape(like["shape"] + [-1]), impl=obj["impl"])


@dataclass
class Position:
    """Where a fit run is: everything beyond the TrainState and the dataset order."""

    config: dict  # the run's settings; a resume must match them
    key: Any  # the current PRNG key (after the splits made so far)
    epoch: int = 1  # the epoch in progress, or the next one to start (1-based)
    started: bool = False  # the epoch's shuffle is done
    batch: int = 0  # physical training batches done in this epoch
    step: int = 0  # micro-steps done in the whole run
    history: dict = field(default_factory=lambda: {f: [] for f in HISTORY_FIELDS})
    train: Result | None = None  # the running epoch's training statistics
    seconds: float = 0.0  # time spent in the running epoch before the checkpoint

    def to_json(self) -> dict:
        return {"version": VERSION, "config": self.config, "key": key_to_json(self.key),
                "epoch": self.epoch, "started": self.started, "batch": self.batch,
                "step": self.step, "history": self.history, "seconds": self.seconds,
                "train": None if self.train is None else self.train.to_json()}


def _int(obj: dict, name: str, low: int, high: int, where: str) -> int:
    value = obj.get(name)
    if type(value) is not int or not low <= value <= high:
        raise StateFileError(f"{where}.{name} is {value!r:.40}, expected an int in "
                             f"[{low}, {high}]")
    return value


def position_from_json(obj, config: dict, ntrain: int, where: str) -> Position:
    """Read back `Position.to_json()`, checked against this run's `config`."""
    fields = {"version", "config", "key", "epoch", "started", "batch", "step", "history",
              "seconds", "train"}
    if not isinstance(obj, dict) or set(obj) != fields:
        raise StateFileError(f"{where} is not a fit checkpoint (fields {sorted(fields)})")
    if obj["version"] != VERSION:
        raise StateFileError(f"{where}.version is {obj['version']!r:.20}, expected {VERSION}")
    found = obj["config"] if isinstance(obj["config"], dict) else {}
    for name, want in config.items():
        if found.get(name) != want:
            raise StateFileError(f"{where}.config.{name} is {found.get(name)!r:.60}, this run "
                                 f"has {want!r:.60}: the checkpoint is of another run")
    epoch = _int(obj, "epoch", 1, 2**31, where)
    batch = _int(obj, "batch", 0, ntrain, where)
    step = _int(obj, "step", 0, 2**62, where)
    if not isinstance(obj["started"], bool) or (batch and not obj["started"]):
        raise StateFileError(f"{where}.started must be a bool (true once batches are done)")
    if step != (epoch - 1) * ntrain + batch:
        raise StateFileError(f"{where}.step is {step}, but epoch {epoch} batch {batch} with "
                             f"{ntrain} batches per epoch is step {(epoch - 1) * ntrain + batch}")
    history = obj["history"]
    if not isinstance(history, dict) or set(history) != set(HISTORY_FIELDS):
        raise StateFileError(f"{where}.history must hold the lists {list(HISTORY_FIELDS)}")
    for name in HISTORY_FIELDS:
        values = history[name]
        if (not isinstance(values, list) or len(values) != epoch - 1
                or not all(type(v) in (int, float) for v in values)):
            raise StateFileError(f"{where}.history.{name} must be {epoch - 1} numbers")
    seconds = obj["seconds"]
    if type(seconds) not in (int, float) or not math.isfinite(seconds) or seconds < 0:
        raise StateFileError(f"{where}.seconds must be a non-negative number")
    train = None
    if obj["train"] is not None:
        try:
            train = Result.from_json(obj["train"], f"{where}.train")
        except JGraphError as e:
            raise StateFileError(str(e)) from None
    key = key_from_json(obj["key"], config["key"], f"{where}.key")
    return Position(config, key, epoch, obj["started"], batch, step, history, train,
                    float(seconds))
