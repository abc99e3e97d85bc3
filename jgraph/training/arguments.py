"""Checks of the numbers and options users pass to the training API, and the errors they raise.

Every check raises `ArgumentError`, a `JGraphError` that is also a `ValueError` and a `TypeError`
(what Python, NumPy and JAX raise for a bad argument), naming the argument and the value.
Integers are Python or NumPy integers (never `bool`, never a float, even a whole one: `2.0` batches
is a bug upstream, as `range(2.0)` says). Floats must be real and finite unless allowed otherwise.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from jgraph.errors import JGraphError

INT32_MAX = 2**31 - 1


class ArgumentError(JGraphError, ValueError, TypeError):
    """An argument of the training API has the wrong type or is out of range."""


class NonFiniteError(JGraphError, FloatingPointError):
    """A training step produced a non-finite loss or state (`on_nonfinite="raise"`).

    `state` is the last finite state (the step's update was not applied); `fit` also attaches
    `history` and `params`."""

    def __init__(self, message: str, state=None):
        super().__init__(message)
        self.state = state
        self.history = None
        self.params = None


class CheckpointError(JGraphError, OSError):
    """`fit` could not write its checkpoint. Nothing trained is lost: `state`, `params` and
    `history` hold the run as it was when the write failed (the cause is chained)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.state = self.history = self.params = None


NONFINITE_MODES = ("raise", "skip", "ignore")


def integer(value, what: str, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int in [low, high]; `ArgumentError` naming `what` otherwise."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise ArgumentError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = (f">= {low}" if high is None else f"<= {high}" if low is None
                  else f"in [{low}, {high}]")
        raise ArgumentError(f"{what} must be {bounds}, got {value}")
    return value


def positive_int(value, what: str, high: int | None = None) -> int:
    return integer(value, what, 1, high)


def real(value, what: str, low: float | None = None, high: float | None = None,
         high_open: bool = False) -> float:
    """`value` as a finite float in [low, high] (or [low, high)); `ArgumentError` otherwise."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise ArgumentError(f"{what} must be a real number, got {value!r} "
                            f"({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ArgumentError(f"{what} must be finite, got {value}")
    above = high is not None and (value >= high if high_open else value > high)
    if (low is not None and value < low) or above:
        raise ArgumentError(f"{what} must be in [{low}, {high}{')' if high_open else ']'}, "
                            f"got {value}")
    return value


def choice(value, what: str, options) -> str:
    if not isinstance(value, str) or value not in options:
        raise ArgumentError(f"{what} must be one of {list(options)}, got {value!r}")
    return value


def numeric_array(array, what: str) -> np.ndarray:
    """`array` as a NumPy array of booleans or numbers (never strings, objects or dates)."""
    try:
        out = np.asarray(array)
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"{what} cannot be read as an array: {e}") from e
    if out.dtype.kind not in "biufc":
        raise ArgumentError(f"{what} must hold numbers, got dtype {out.dtype} (encode strings "
                            f"or categories as integer class ids first)")
    return out
