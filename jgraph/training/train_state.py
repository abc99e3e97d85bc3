"""The NamedTuples a training run passes around: `TrainState` (what `Optimizer.step` carries
from step to step) and `StepOutput` (what a step reports to a `Result`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class TrainState(NamedTuple):
    """Everything a training run carries from step to step."""

    params: Any  # the model parameters
    opt_state: Any  # the optax state (`tx.init(params)` after a full reset)
    grad_acc: Any  # gradient accumulators shaped like params (on a mesh: one per data shard,
    #                stacked on a leading axis); None when the period is 1
    counter: np.ndarray  # np.int32 on the host: the next micro-step's index in the period


class StepOutput(NamedTuple):
    """What one `step`/`evaluate` (or one `step_period`, stacked) reports to a `Result`."""

    loss: Any  # the graph's loss: scaled by 1/period for per-datapoint losses in grad/opt graphs
    pred: Any  # predicted classes (cross_entropy) or None
    ncorrect: Any  # number of correct predictions (cross_entropy) or None
    ndata: int  # datapoints per micro-batch, counted as ggml-opt does
    period: int  # the period the loss is scaled by (1 for forward evaluations)
    per_datapoint: bool  # the loss is a mean over datapoints (not a sum)
    finite: Any = None  # the step's finite check (device bool); None when not guarded
