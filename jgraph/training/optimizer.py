"""`Optimizer`: ggml_opt_context as explicit state and three compiled graphs.

Graphs (ggml's nesting): `forward` (loss only), `grad` (forward + backward + accumulate) and `opt`
(grad + optimizer step, run on the last micro-step of each period), plus `reset`, which builds the
state. With `period == 1` there are no accumulators (as in ggml's static mode) and `grad` is the
plain joint graph. Static mode builds and compiles every graph once, for the example input shapes,
donating state buffers; dynamic mode rebuilds per input shape and donates nothing.

The state is a `TrainState` pytree; `step` returns a new one and invalidates the old one's donated
buffers (ggml updates in place). The micro-step counter is a host `np.int32`, so choosing between
the `grad` and `opt` executables never waits for the device; the graphs take it as their `counter`
input and zero the accumulators when it is 0 (every period, in both modes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jgraph.backward import backward
from jgraph.errors import JGraphError, TransformError
from jgraph.ir import Graph, Var
from jgraph.lower import as_function
from jgraph.trace import trace
from jgraph.training.accumulate import LOSS_SCALED_BY_PERIOD, accumulate
from jgraph.training.graphs import grad_params, grads_tree, tuple_tree
from jgraph.training.losses import NEEDS_LABELS, loss_function, ndata_of
from jgraph.training.optimizer_step import optimizer_step
from jgraph.training.reset import reset


class TrainState(NamedTuple):
    """Everything a training run carries from step to step."""

    params: Any  # the model parameters
    opt_state: Any  # the optax state (`tx.init(params)` after a full reset)
    grad_acc: Any  # gradient accumulators shaped like params; None when the period is 1
    counter: np.ndarray  # np.int32 on the host: the next micro-step's index in the period


class StepOutput(NamedTuple):
    """What one `step`/`evaluate` (or one `step_period`, stacked) reports to a `Result`."""

    loss: Any  # the graph's loss: scaled by 1/period for per-datapoint losses in grad/opt graphs
    pred: Any  # predicted classes (cross_entropy) or None
    ncorrect: Any  # number of correct predictions (cross_entropy) or None
    ndata: int  # datapoints per micro-batch, counted as ggml-opt does
    period: int  # the period the loss is scaled by (1 for forward evaluations)
    per_datapoint: bool  # the loss is a mean over datapoints (not a sum)


@dataclass
class _Build:
    """The graphs and executables for one input signature."""

    graphs: dict[str, Graph]
    executables: dict[str, Callable]
    ndata: int
    period_fn: Callable | None = None
    state_template: Any = field(default=None)


_SHARED_BUILDS: dict[tuple, _Build] = {}  # see Optimizer._shared_build
_MAX_SHARED_BUILDS = 64


def _dtype(a) -> np.dtype:
    return np.dtype(a.dtype) if hasattr(a, "dtype") else np.asarray(a).dtype


def _signature(x, y):
    return tuple((tuple(np.shape(a)), _dtype(a).name) for a in jax.tree.leaves((x, y)))


def _apply_remat(graph: Graph, remat):
    if remat is None or remat is False:
        return graph
    try:
        from jgraph.remat import remat as remat_transform
    except ImportError as e:
        raise TransformError(f"Optimizer(remat={remat!r}) needs jgraph.remat, which is not "
                             f"available: {e}") from e
    if remat is True:
        return remat_transform(graph)
    if isinstance(remat, dict):
        return remat_transform(graph, **remat)
    return remat_transform(graph, policy=remat)


def update_only(grad_graph: Graph) -> Graph:
    """`(params, acc) -> acc`: the accumulated gradient alone, for `optimizer_step` to update."""
    params = tuple(Var(p.aval) for p in grad_params(grad_graph))
    accs = tuple(Var(a.aval) for a in grad_graph.inputs_with_role("accumulator"))
    tree = grads_tree(grad_graph)
    return Graph(inputs=params + accs, eqns=(), outputs=accs,
                 input_roles=("param",) * len(params) + ("accumulator",) * len(accs),
                 output_roles=("new_accumulator",) * len(accs),
                 in_tree=tuple_tree([tree, tree]), out_tree=tuple_tree([tree]), param_argnums=0,
                 info={"grads_tree": tree})


def _copy(tree):
    return jax.tree.map(lambda a: jax.device_put(np.array(a)), tree)


class Optimizer:
    """Training context: `init`, `step`, `step_period`, `evaluate`, `reset`, `save`/`load`."""

    def __init__(self, fn, tx, loss: str = "mean", period: int = 1, static: bool = True,
                 remat=None):
        if loss not in LOSS_SCALED_BY_PERIOD:
            raise TransformError(f"unknown loss type {loss!r}; known: "
                                 f"{sorted(LOSS_SCALED_BY_PERIOD)}")
        if not isinstance(period, (int, np.integer)) or period < 1:
            raise TransformError(f"period must be a positive int, got {period!r}")
        self.fn, self.tx, self.loss, self.period = fn, tx, loss, int(period)
        self.static, self.remat = bool(static), remat
        self.needs_labels = loss in NEEDS_LABELS
        self._builds: dict[tuple, _Build] = {}
        self._last: _Build | None = None
        self._params_shape = None
        self._counters: dict[int, jax.Array] = {}  # micro-step index -> device scalar

    # -- building -------------------------------------------------------------------------------
    def _build(self, params, x, y) -> _Build:
        loss_fn, has_aux = loss_function(self.fn, self.loss)
        args = (params, x) if y is None else (params, x, y)
        fwd = trace(loss_fn, *args, param_argnums=0, has_aux=has_aux)
        grad = _apply_remat(backward(fwd), self.remat)
        if self.period > 1:
            grad = accumulate(grad, self.period, self.loss)
        opt = optimizer_step(grad, self.tx)
        graphs = {"forward": fwd, "grad": grad, "opt": opt, "reset": reset(opt)}
        nargs = len(args)
        donate = self.static
        if self.period > 1:  # grad: (*args, acc, counter); opt: (*args, acc, counter, opt_state)
            grad_donate, opt_donate = (nargs,), (0, nargs, nargs + 2)
        else:  # opt: (*args, opt_state)
            grad_donate, opt_donate = (), (0, nargs)
        executables = {
            "forward": jax.jit(as_function(fwd)),
            "grad": jax.jit(as_function(grad), donate_argnums=grad_donate if donate else ()),
            "opt": jax.jit(as_function(opt), donate_argnums=opt_donate if donate else ()),
            "reset": jax.jit(as_function(graphs["reset"])),
        }
        return _Build(graphs, executables, ndata_of(self.fn, params, x))

    def _for(self, x, y) -> _Build:
        if self.needs_labels and y is None:
            raise JGraphError(f"loss {self.loss!r} needs labels")
        if not self.needs_labels:
            y = None
        key = _signature(x, y)
        build = self._builds.get(key)
        if build is None:
            if self._params_shape is None:
                raise JGraphError("Optimizer: call init(params, example_inputs, ...) first")
            if self.static and self._builds:
                (known,) = self._builds
                raise JGraphError(f"static Optimizer was built for inputs {known}, got {key}; "
                                  f"use Optimizer(..., static=False) for varying shapes")
            build = self._builds[key] = self._shared_build(x, y, key)
        self._last = build
        return build

    def _shared_build(self, x, y, key) -> _Build:
        """Optimizers with the same model, transformation, settings and shapes share graphs and
        executables (as `jax.jit` shares by function identity), so each compiles once."""
        params_key = jax.tree.structure(self._params_shape), tuple(
            (s.shape, s.dtype) for s in jax.tree.leaves(self._params_shape))
        shared_key = (self.fn, self.tx, self.loss, self.period, self.static, self.remat,
                      params_key, key)
        try:
            build = _SHARED_BUILDS.get(shared_key)
        except TypeError:  # an unhashable part (a remat dict): no sharing
            return self._build(self._params_shape, x, y)
        if build is None:
            build = _SHARED_BUILDS[shared_key] = self._build(self._params_shape, x, y)
            while len(_SHARED_BUILDS) > _MAX_SHARED_BUILDS:
                _SHARED_BUILDS.pop(next(iter(_SHARED_BUILDS)))
        return build

    def _counter(self, i: int):
        if i not in self._counters:
            self._counters[i] = jax.device_put(np.int32(i))
        return self._counters[i]

    def _data(self, x, y):
        return (x, y) if self.needs_labels else (x,)

    # -- the ggml_opt_* operations ----------------------------------------------------------------
    def init(self, params, example_inputs, example_labels=None) -> TrainState:
        """Build (and in static mode compile) the graphs; return the reset state for `params`."""
        self._params_shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), _dtype(a)),
                                          params)
        self._builds.clear()
        build = self._for(example_inputs, example_labels)
        lead = jax.tree.leaves(example_inputs)[0]
        self.batch_size = int(np.shape(lead)[0]) if np.ndim(lead) else 1
        fresh = build.executables["reset"](params)
        state = TrainState(_copy(params), fresh["opt_state"], fresh.get("grad_acc"), np.int32(0))
        build.state_template = jax.tree.map(
            lambda a: a if isinstance(a, np.ndarray | np.generic) else jax.ShapeDtypeStruct(
                a.shape, a.dtype), state)
        return state

    def step(self, state: TrainState, inputs, labels=None):
        """One backward micro-step; on the last micro-step of a period also the optimizer step."""
        build = self._for(inputs, labels)
        ex, data = build.executables, self._data(inputs, labels)
        i = int(state.counter)
        if self.period == 1:
            value, _, params, opt_state = ex["opt"](state.params, *data, state.opt_state)
            new = TrainState(params, opt_state, None, np.int32(0))
        elif i + 1 == self.period:
            value, acc, _, params, opt_state = ex["opt"](
                state.params, *data, state.grad_acc, self._counter(i), state.opt_state)
            new = TrainState(params, opt_state, acc, np.int32(0))
        else:
            value, acc, _ = ex["grad"](state.params, *data, state.grad_acc, self._counter(i))
            new = state._replace(grad_acc=acc, counter=np.int32(i + 1))
        return new, self._output(value, build, self.period)

    def evaluate(self, state: TrainState, inputs, labels=None) -> StepOutput:
        """Forward only: the loss (and predictions) at the current params; state is unchanged."""
        build = self._for(inputs, labels)
        value = build.executables["forward"](state.params, *self._data(inputs, labels))
        return self._output(value, build, 1)

    def reset(self, state: TrainState, optimizer: bool = False) -> TrainState:
        """ggml_opt_reset: zero accumulators and the counter; with `optimizer`, also `tx.init`."""
        if self._last is None:
            raise JGraphError("Optimizer.reset: call init first")
        fresh = self._last.executables["reset"](state.params)
        new = state._replace(grad_acc=fresh.get("grad_acc"), counter=np.int32(0))
        return new._replace(opt_state=fresh["opt_state"]) if optimizer else new

    def grad_acc(self, state: TrainState):
        """The accumulated gradients (None when the period is 1: there are no accumulators)."""
        return state.grad_acc

    @property
    def graphs(self) -> dict[str, Graph]:
        """The graphs of the latest build: `forward`, `grad`, `opt` and `reset`."""
        if self._last is None:
            raise JGraphError("Optimizer: no graphs yet; call init first")
        return dict(self._last.graphs)

    @property
    def executables(self) -> dict[str, Callable]:
        """The jitted functions of the latest build (their `_cache_size()` counts compilations)."""
        if self._last is None:
            raise JGraphError("Optimizer: nothing compiled yet; call init first")
        out = dict(self._last.executables)
        if self._last.period_fn is not None:
            out["period"] = self._last.period_fn
        return out

    def _output(self, value, build: _Build, period: int) -> StepOutput:
        loss, aux = value if isinstance(value, tuple) else (value, (None, None))
        return StepOutput(loss, aux[0], aux[1], build.ndata, period,
                          LOSS_SCALED_BY_PERIOD[self.loss])

    # -- a whole period in one call ---------------------------------------------------------------
    def step_period(self, state: TrainState, inputs_stack, labels_stack=None):
        """Run the `period` micro-steps of one period (stacked on axis 0) in one compiled call."""
        if int(state.counter) != 0:
            raise JGraphError(f"step_period must start a period; the state is at micro-step "
                              f"{int(state.counter)} of {self.period}")
        lead = {np.shape(a)[0] for a in jax.tree.leaves((inputs_stack, labels_stack))}
        if lead != {self.period}:
            raise JGraphError(f"step_period needs inputs stacked {self.period} deep on axis 0, "
                              f"got leading sizes {sorted(lead)}")
        run = self.period_function(inputs_stack, labels_stack)
        ys = labels_stack if self.needs_labels else None
        params, acc, opt_state, value = run(state.params, state.grad_acc, state.opt_state,
                                            inputs_stack, ys)
        return TrainState(params, opt_state, acc, np.int32(0)), self._output(
            value, self._last, self.period)

    def period_function(self, inputs_stack, labels_stack=None):
        """The jitted `(params, grad_acc, opt_state, inputs_stack, labels_stack) -> (params,
        grad_acc, opt_state, stacked outputs)` behind `step_period` (`.lower(...)` it to read
        XLA's memory figures). All three state parts are donated (static mode); the outputs come
        in the order of the inputs, because jax pairs donated buffers with outputs of the same
        shape in order: any other order makes XLA copy every state buffer into its place."""
        index = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731 - one example batch
        build = self._for(index(inputs_stack), None if labels_stack is None else
                          index(labels_stack))
        if build.period_fn is None:
            build.period_fn = self._period_function(build)
        return build.period_fn

    def _period_function(self, build: _Build):
        period, labelled = self.period, self.needs_labels
        if period == 1:
            opt_f = as_function(build.graphs["opt"])
        else:  # scan the grad graph over all micro-batches, then apply the update alone
            grad_f = as_function(build.graphs["grad"])
            build.graphs["update"] = optimizer_step(update_only(build.graphs["grad"]), self.tx)
            update_f = as_function(build.graphs["update"])

        def data(xs, ys, i):
            pick = lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False)  # noqa: E731
            return (jax.tree.map(pick, xs),) + ((jax.tree.map(pick, ys),) if labelled else ())

        def run(params, acc, opt_state, xs, ys):
            if period == 1:
                value, _, params, opt_state = opt_f(params, *data(xs, ys, 0), opt_state)
                return params, acc, opt_state, jax.tree.map(lambda v: v[None], value)

            def body(carry, batch):
                acc, counter = carry
                value, acc, counter = grad_f(params, *batch, acc, counter)
                return (acc, counter), value

            batches = (xs, ys) if labelled else (xs,)
            (acc, _), values = lax.scan(body, (acc, jnp.int32(0)), batches)
            acc, params, opt_state = update_f(params, acc, opt_state)
            return params, acc, opt_state, values

        return jax.jit(run, donate_argnums=(0, 1, 2) if self.static else ())

    # -- saving -----------------------------------------------------------------------------------
    def save(self, state: TrainState, path, dataset=None, extra=None) -> None:
        """Write the whole training state (and a dataset's order) atomically to `path`."""
        from jgraph.training.state_io import save_state

        save_state(path, state, dataset=dataset, extra=extra)

    def load(self, path, dataset=None) -> TrainState:
        """Read a state written by `save`; checks version, checksum, structure, shapes, dtypes."""
        from jgraph.training.state_io import load_state

        if self._last is None or self._last.state_template is None:
            raise JGraphError("Optimizer.load: call init(params, example_inputs) first, so the "
                              "optimizer knows the state's structure")
        return load_state(path, self._last.state_template, dataset=dataset)
