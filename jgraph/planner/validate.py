"""Budgets, and what XLA allocates for a plan.

A budget is a number of bytes of the figure that bounds the step on the target it is planned for
(`jgraph.target`: `temp_size_in_bytes` on CPU, HBM on TPU, `peak_memory_in_bytes` on GPU), or a
string "NN%" (a fraction of that figure for the graph's donated training step without remat).
`xla_temp(graph)` compiles that donated step (`jgraph.memory.donated_step`) for the target in
force (`jgraph.target.measuring_on`) from the graph's input avals, as `jax.ShapeDtypeStruct`s
placed on it, so no example arguments and no device are needed, and reads the budget's figure; a
step whose HLO was compiled before for the same kind of target is not compiled again
(`jgraph.memory.compiled`'s cache: the search, and a period's two orders, meet the same program
under different graphs). On TPU, while a budget is in force (`at_budget`), a graph is compiled
at that HBM size: one compile says whether it fits.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import re
import warnings

import jax
import numpy as np

from jgraph.errors import TransformError
from jgraph.ir import Graph
from jgraph.memory import STATE_ROLES
from jgraph.memory.compiled import CompiledMemory, lowered_step, read_figures
from jgraph.memory.model import calibration
from jgraph.target import TargetError, current

seconds = 0.0  # compile seconds of the current planning (`jgraph.planner.search` resets it)
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


def parse_budget(budget) -> tuple[str, float]:
    """("bytes", n) or ("fraction", f) from `budget`; a clear error for anything else. Bytes
    may be any real number, numpy's and 0-d JAX arrays included (`np.int64(2**30)`); a count
    beyond what a float holds (`10**400`) is refused as infinite."""
    if isinstance(budget, str):
        match = _PERCENT.match(budget)
        if match is None:
            raise TransformError(
                f"remat(budget={budget!r}): a budget string is a percentage of the no-remat "
                "compiled temp such as '50%' (give bytes as a number: 8 * 2**20)")
        fraction = float(match.group(1)) / 100
        if not 0 < fraction <= 1:
            raise TransformError(f"remat(budget={budget!r}): a percentage budget lies in "
                                 "(0%, 100%]")
        return "fraction", fraction
    amount = _real_scalar(budget)
    if amount is None or not (math.isfinite(amount) and amount >= 0):
        raise TransformError(f"remat(budget={budget!r:.80}): the budget is a finite, "
                             "non-negative number of bytes (e.g. 8 * 2**20) or a percentage "
                             "string such as '50%'")
    return "bytes", amount


def _real_scalar(value) -> float | None:
    """`value` as a float if it is a real number (Python, numpy, or a 0-d integer or floating
    array), else None; booleans are not numbers of bytes."""
    if isinstance(value, bool | np.bool_):
        return None
    if not isinstance(value, numbers.Real):
        dtype = getattr(value, "dtype", None)
        if dtype is None or np.ndim(value) != 0 or np.dtype(dtype).kind not in "iuf":
            return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range
        return math.inf
    except TypeError:  # a traced value (under jax.jit) has no number yet
        return None


def abstract_step_args(graph: Graph):
    """(state, rest) of `donated_step(graph)`'s step, as ShapeDtypeStructs."""
    structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in graph.inputs]
    state = [s for s, r in zip(structs, graph.input_roles, strict=True) if r in STATE_ROLES]
    rest = [s for s, r in zip(structs, graph.input_roles, strict=True) if r not in STATE_ROLES]
    return state, rest


_LIMIT: contextvars.ContextVar[int | None] = contextvars.ContextVar("jgraph_budget_in_force",
                                                                     default=None)


@contextlib.contextmanager
def at_budget(budget_bytes: int | None):
    """Measurements inside are compiled at an HBM size of `budget_bytes` on TPU (rounded down to
    MiB): one compile says on which side of the budget a graph lies, and what it used or needed
    there (`jgraph.memory.hbm`); elsewhere nothing changes."""
    token = _LIMIT.set(budget_bytes)
    try:
        yield
    finally:
        _LIMIT.reset(token)


_MODEL: contextvars.ContextVar = contextvars.ContextVar("jgraph_model_in_force", default=None)


@contextlib.contextmanager
def on_model(fitted):
    """`xla_temp` inside gives the model's prediction (`jgraph.memory.model.Calibration`), not
    a compile's figure (None: compiles)."""
    token = _MODEL.set(fitted)
    try:
        yield
    finally:
        _MODEL.reset(token)


def on_the_model() -> bool:
    """Whether `xla_temp` gives the model's prediction here (`on_model`)."""
    return _MODEL.get() is not None


def model_in_force():
    """The model (`jgraph.memory.model.Calibration`) `on_model` put in force here, or None."""
    return _MODEL.get()


def xla_temp(graph: Graph) -> int:
    """The budget's figure (`jgraph.target`) of the compiled donated training step of `graph` on
    the target in force: its temp on CPU, its HBM need on TPU, its peak on GPU; predicted by the
    model instead while one is in force (`on_model`)."""
    fitted = _MODEL.get()
    if fitted is not None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return fitted.predict(graph)
    return xla_figures(graph).budget_bytes


def predicted_no_larger(graph: Graph, than: Graph) -> bool:
    """Whether `graph`'s figure is not clearly over `than`'s (a step and its twin computing the
    same values) on the target in force, predicted by the model calibrated on `than`'s compile,
    which the caller has made anyway: within `CLEAR`, the model's error, the two are as good as
    equal and `graph` is taken (no compile decides a difference that small; the plan made of it
    is compiled anyway). Compiled only where the target has no model (GPU)."""
    try:
        fitted = calibration(than, current())
    except TargetError:
        return xla_temp(graph) < xla_temp(than)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        predicted = fitted.predict(graph)
    return predicted < (1 + CLEAR) * fitted.figure


CLEAR = 0.04  # the model's error on training steps (`bench_memory --target cpu`: within 3.6 %)


def xla_figures(graph: Graph) -> CompiledMemory:
    """XLA's figures for the compiled donated step of `graph` on the target in force, compiled
    once per program, kind of target and budget in force (`at_budget`)."""
    with warnings.catch_warnings():  # a measurement: which donations XLA uses is not news here
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        return read_figures(lowered_step(graph, current()), hbm_limit=_LIMIT.get())
