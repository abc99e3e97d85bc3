"""Training as pure graph transforms (ggml-opt rebuilt): `accumulate`, `optimizer_step`, `reset`,
and what is built on them: `Optimizer`, `Dataset`, `Result`, `epoch`, `fit`, state files."""

from jgraph.training.accumulate import accumulate
from jgraph.training.arguments import ArgumentError, CheckpointError, NonFiniteError
from jgraph.training.dataset import Dataset
from jgraph.training.fit import History, epoch, fit
from jgraph.training.guard import guard_nonfinite
from jgraph.training.optimizer import Optimizer
from jgraph.training.optimizer_step import optimizer_step
from jgraph.training.reset import first_micro_step, reset
from jgraph.training.result import Result
from jgraph.training.state_io import StateFileError, StateFileWarning, StateWriteError
from jgraph.training.train_state import StepOutput, TrainState

__all__ = [
    "ArgumentError", "CheckpointError", "Dataset", "History", "NonFiniteError", "Optimizer",
    "Result", "StateFileError", "StateFileWarning", "StateWriteError", "StepOutput", "TrainState",
    "accumulate",
    "epoch", "first_micro_step", "fit", "guard_nonfinite", "optimizer_step", "reset",
]
