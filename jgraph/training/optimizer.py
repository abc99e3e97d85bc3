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

Interrupts: the Optimizer records every state it produces in `latest_state`, and a step holds
SIGINT from the compiled call until that record is made, so after a Ctrl-C at any point of a step
loop `opt.save(opt.latest_state, path)` saves the last complete step (never a donated state).

Non-finite steps (`on_nonfinite`): "ignore" (the default, as in optax) runs the graphs as built;
"raise" and "skip" run them through `guard_nonfinite`, whose step returns one finite flag. "raise"
reads it after every step and, when false, raises `NonFiniteError` with the state as it was before
the step (the update is dropped in the graph, so nothing is lost to donation). "skip" drops
non-finite updates of params and optimizer state, as `optax.apply_if_finite` does, without waiting
for the flag: a period with a non-finite micro-batch makes no update (`apply_if_finite` applied to
the period's mean gradient), and the next period starts from zeroed accumulators;
`StepOutput.finite` holds the flag.

Many devices (`mesh`): the same graphs run on a `jax.sharding.Mesh`, the batch split along
`data_axis`, params and optimizer state replicated or sharded by `param_sharding` (see
`jgraph.training.mesh` for where everything lives and `mesh_steps` for the executables). With
`period > 1` each device accumulates its own shard's gradients and they cross devices once per
period, in the optimizer step; `state.grad_acc` then holds one partial sum per data shard
(`opt.grad_acc(state)` is their sum). State files hold full arrays and load onto any mesh.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jgraph.backward import backward
from jgraph.errors import BudgetWarning, JGraphError, TransformError
from jgraph.ir import Graph
from jgraph.lower import as_function, jit_donated
from jgraph.trace import trace
from jgraph.training.accumulate import LOSS_SCALED_BY_PERIOD, accumulate
from jgraph.training.arguments import (
    INT32_MAX,
    NONFINITE_MODES,
    ArgumentError,
    NonFiniteError,
    choice,
    integer,
    positive_int,
)
from jgraph.training.dataset import check_class_ids
from jgraph.training.graphs import update_only, with_labels
from jgraph.training.guard import guard_nonfinite, with_guard
from jgraph.training.interrupts import held_sigint
from jgraph.training.leaves import (
    check_leaves,
    deleted,
    dtype_of,
    fresh_copy,
    has_keys,
    merge_keys,
    signature,
    split_keys,
)
from jgraph.training.losses import NEEDS_LABELS, class_count, loss_function, ndata_of
from jgraph.training.mesh import MeshPlan, without_data_axis
from jgraph.training.mesh_steps import MeshSteps
from jgraph.training.optimizer_io import StateFiles
from jgraph.training.optimizer_step import optimizer_step
from jgraph.training.period import WholePeriods
from jgraph.training.remat_step import grad_step, one_warning, period_step, whole_step
from jgraph.training.reset import reset
from jgraph.training.train_state import StepOutput, TrainState


@dataclass
class _Build:
    """The graphs and executables for one input signature."""

    graphs: dict[str, Graph]
    executables: dict[str, Callable]
    ndata: int
    nclasses: int | None = None  # cross_entropy with class-id labels: the number of classes
    plain_grad: Graph | None = None  # the grad graph before `guard_nonfinite`
    period_fn: Callable | None = None
    state_template: Any = field(default=None)
    steps: MeshSteps | None = None  # on a mesh: the shardings and the jitted steps


_SHARED_BUILDS: dict[tuple, _Build] = {}  # see Optimizer._shared_build
_MAX_SHARED_BUILDS = 64


def _train_state(state, what: str) -> None:
    if not isinstance(state, TrainState):
        raise ArgumentError(f"{what}: expected a TrainState (from init, step or load), got "
                            f"{type(state).__name__}")


def _signature_text(key) -> str:
    return ", ".join(f"{dtype}{list(shape)}" for shape, dtype in key)


def batch_text(inputs, labels) -> str:
    """`inputs float32[8, 5]; labels int32[8]`: the shapes a static build is specialised to."""
    text = lambda t: ", ".join(f"{dtype_of(a)}{list(np.shape(a))}"  # noqa: E731
                               for a in jax.tree.leaves(t))
    return f"inputs {text(inputs)}" + ("" if labels is None else f"; labels {text(labels)}")


def _labelled(graph: Graph, labels) -> Graph:
    """The loss graph with its third argument's inputs in the role `label` (when it has labels)."""
    return graph if labels is None else with_labels(graph, 2)


def _with_keys(fn):
    """`fn` for params without their keys, the keys coming with the inputs."""
    return lambda params, inputs: fn(merge_keys(params, inputs[1]), inputs[0])


class Optimizer(StateFiles, WholePeriods):
    """Training context (ggml_opt_context): `init`, `step`, `step_period`, `evaluate`, `reset`,
    `save`/`load`.

    It builds and compiles the graphs (`forward`, `grad`, `opt`, `reset`: `opt.graphs`) and carries
    the state between steps as an explicit `TrainState` (`params`, `opt_state`, `grad_acc`,
    `counter`); `step` returns a new state and donates the old one's buffers (module docstring).

    Args:
        fn: the model, `fn(params, inputs)`: with `loss` `"sum"` / `"mean"` it returns what is
            reduced (or a scalar); with `"cross_entropy"` / `"mse"` it returns predictions
            (logits) compared with the labels.
        tx: an optax `GradientTransformation`, applied at the end of each period.
        loss: `"mean"`, `"sum"`, `"cross_entropy"` or `"mse"`.
        period: micro-steps per optimizer step (gradient accumulation).
        static: build and compile every graph once, for the example shapes, donating the state
            (ggml's static mode); `False` rebuilds per input shape and donates nothing.
        remat: None; True (the graph's own regions); a policy; or the keyword arguments of
            `jg.remat` as a dict (`{"budget": "50%", "target": ...}`: the micro-step that runs
            is planned, accumulation included).
        on_nonfinite: `"ignore"` (as optax), `"raise"` (`NonFiniteError`, the state as it was
            before the step) or `"skip"` (drop non-finite updates, as `optax.apply_if_finite`).
        mesh: a `jax.sharding.Mesh`: the batch is split along `data_axis`, params and state
            replicated (or sharded by `param_sharding`).
        data_axis: the mesh axis the batch is split along.
        param_sharding: a pytree of `PartitionSpec`s, or a function `leaf -> PartitionSpec`
            (FSDP-style)."""

    def __init__(self, fn, tx, loss: str = "mean", period: int = 1, static: bool = True,
                 remat=None, on_nonfinite: str = "ignore", mesh=None, data_axis: str = "data",
                 param_sharding=None):
        if loss not in LOSS_SCALED_BY_PERIOD:
            raise TransformError(f"unknown loss type {loss!r}; known: "
                                 f"{sorted(LOSS_SCALED_BY_PERIOD)}")
        if not callable(fn):
            raise ArgumentError(f"Optimizer: fn must be callable, got {type(fn).__name__}")
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise ArgumentError(f"Optimizer: tx must be an optax GradientTransformation (with "
                                f"init and update), got {type(tx).__name__}")
        # the counter is an int32 and reaches period - 1; `counter + 1` must not overflow
        period = positive_int(period, "Optimizer: period", high=INT32_MAX)
        self.fn, self.tx, self.loss, self.period = fn, tx, loss, period
        self.static, self.remat = bool(static), remat
        self.on_nonfinite = choice(on_nonfinite, "Optimizer: on_nonfinite", NONFINITE_MODES)
        self.needs_labels = loss in NEEDS_LABELS
        if mesh is None and param_sharding is not None:
            raise ArgumentError("Optimizer: param_sharding needs a mesh")
        self.plan = None if mesh is None else MeshPlan(mesh, data_axis, param_sharding)
        self._builds: dict[tuple, _Build] = {}
        self._last: _Build | None = None
        self._init: _Build | None = None  # the build `init` made: the state's template
        self._fingerprint: dict | None = None  # what state files record (computed on demand)
        self._batch: str | None = None  # the example batch's shapes, as the fingerprint says
        self._latest: TrainState | None = None
        self._keyed = False  # the params hold typed PRNG keys (set by init)
        self._params_shape = None
        self._counters: dict[int, jax.Array] = {}  # micro-step index -> device scalar

    # -- building -------------------------------------------------------------------------------
    def _build(self, params, x, y) -> _Build:
        model, keys, plan = self.fn, None, self.plan
        if has_keys(params):  # keys in params are not trained: the graphs take them as data
            params, keys = split_keys(params)
            model = _with_keys(self.fn)
        loss_fn, has_aux = loss_function(model, self.loss)

        def arguments(x, y):
            x = x if keys is None else (x, keys)
            return (params, x) if y is None else (params, x, y)

        args = arguments(x, y)
        fwd = _labelled(trace(loss_fn, *args, param_argnums=0, has_aux=has_aux), y)
        if plan is not None and self.period > 1:
            return self._mesh_build(fwd, loss_fn, has_aux, arguments, model, keys, x, y)
        bwd = backward(fwd)
        whole = self.period == 1  # the step reads its gradients, nobody else
        mode = self.on_nonfinite
        # "skip" checks updates only: a bad micro-batch poisons its period's accumulated gradient
        grad_mode = "ignore" if mode == "skip" else mode
        # each step planned as it runs, guarded (`grad_step`, `whole_step`)
        guard = None if mode == "ignore" else lambda g: with_guard(g, mode)  # noqa: E731
        summed = None if self.period == 1 else lambda g: accumulate(g, self.period, self.loss)
        with warnings.catch_warnings(record=True) as caught:  # one warning for both steps
            warnings.simplefilter("always", BudgetWarning)
            grad = grad_step(bwd, self.remat, summed, whole,
                             None if grad_mode == "ignore" else lambda g: with_guard(g, grad_mode))
            opt = optimizer_step(grad, self.tx)
            if whole:
                run = whole_step(bwd, opt, self.tx, self.remat, guard)
            elif summed is not None and plan is None:
                run = period_step(bwd, opt, summed, self.tx, self.remat, guard)
            else:
                run = with_guard(opt, mode)
        one_warning(caught)
        graphs = {"forward": fwd, "grad": with_guard(grad, grad_mode),
                  "opt": run, "reset": reset(opt, self.tx)}
        nargs = len(args)
        donate = self.static
        if self.period > 1:  # grad: (*args, acc, counter); opt: (*args, acc, counter, opt_state)
            grad_donate, opt_donate = (nargs,), (0, nargs, nargs + 2)
        else:  # opt: (*args, opt_state)
            grad_donate, opt_donate = (), (0, nargs)
        grad_donate, opt_donate = (grad_donate, opt_donate) if donate else ((), ())
        steps = None
        if plan is None:
            executables = {
                "forward": jax.jit(as_function(fwd)),
                "grad": jit_donated(graphs["grad"], grad_donate),
                "opt": jit_donated(graphs["opt"], opt_donate),
                "reset": jax.jit(as_function(graphs["reset"])),
            }
        else:  # period 1: the whole micro-batch's graphs, partitioned by XLA
            steps = self._mesh_steps(params, keys, y)
            executables = {"forward": steps.forward(fwd),
                           "grad": steps.whole(graphs["grad"], False),
                           "opt": steps.whole(graphs["opt"], True, opt_donate),
                           "reset": steps.reset(graphs["reset"], params)}
        nclasses = class_count(model, self.loss, params, args[1], y)
        return _Build(graphs, executables, ndata_of(model, params, args[1]), nclasses, grad,
                      steps=steps)

    def _mesh_steps(self, params, keys, y) -> MeshSteps:
        return MeshSteps(self.plan, params, self.tx, keyed=keys is not None,
                         labelled=y is not None, mode=self.on_nonfinite, period=self.period)

    def _mesh_build(self, fwd, loss_fn, has_aux, arguments, model, keys, x, y) -> _Build:
        """Period > 1 on a mesh: `grad` is one data shard's micro-step, accumulated over
        `period x shards` shard-batches; `update` applies the optimizer to their sum."""
        plan, mode = self.plan, self.on_nonfinite
        shard = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(  # noqa: E731
            (np.shape(a)[0] // plan.size,) + tuple(np.shape(a)[1:]), dtype_of(a)), t)
        args = arguments(shard(x), shard(y))
        one = without_data_axis(_labelled(trace(loss_fn, *args, param_argnums=0,
                                                has_aux=has_aux), y), plan.data_axis)
        grad = grad_step(backward(one), self.remat,
                         lambda g: accumulate(g, self.period * plan.size, self.loss))
        flag = (lambda g: g) if mode == "ignore" else (lambda g: guard_nonfinite(g))
        graphs = {"forward": fwd, "grad": flag(grad),
                  "update": flag(optimizer_step(update_only(grad), self.tx)),
                  "reset": reset(optimizer_step(grad, self.tx), self.tx)}
        params = args[0]
        steps = self._mesh_steps(params, keys, y)
        nargs = len(args)
        donate = self.static
        executables = {
            "forward": steps.forward(fwd),
            "grad": steps.grad(graphs["grad"], (nargs,) if donate else ()),
            "opt": steps.opt(graphs["grad"], graphs["update"],
                             (0, nargs, nargs + 2) if donate else ()),
            "reset": steps.reset(graphs["reset"], params)}
        data = arguments(x, y)[1]
        nclasses = class_count(model, self.loss, params, data, y)
        return _Build(graphs, executables, ndata_of(model, params, data), nclasses, grad,
                      steps=steps)

    def _for(self, x, y) -> _Build:
        if self.needs_labels and y is None:
            raise JGraphError(f"loss {self.loss!r} needs labels")
        if not self.needs_labels:
            y = None
        key = signature((x, y))
        build = self._builds.get(key)
        if build is None:
            check_leaves(x, "inputs")
            check_leaves(y, "labels")
            if self._params_shape is None:
                raise JGraphError("Optimizer: call init(params, example_inputs, ...) first")
            if self.plan is not None:
                self.plan.batch_size((x, y), "Optimizer")
            if self.static and self._builds:
                (known,) = self._builds
                lists = any(isinstance(t, list | tuple) and t and not isinstance(t[0], np.ndarray
                                                                                | jax.Array)
                            for t in (x, y))
                raise JGraphError(
                    f"static Optimizer was built for inputs (and labels) {_signature_text(known)}"
                    f", got {_signature_text(key)}; use Optimizer(..., static=False) for varying "
                    f"shapes" + ("; a Python list is a pytree of one input per element: pass "
                                 "np.asarray(...)" if lists else ""))
            build = self._builds[key] = self._shared_build(x, y, key)
        self._last = build
        return build

    def _shared_build(self, x, y, key) -> _Build:
        """Optimizers with the same model, transformation, settings and shapes share graphs and
        executables (as `jax.jit` shares by function identity), so each compiles once."""
        params_key = jax.tree.structure(self._params_shape), tuple(
            (s.shape, s.dtype) for s in jax.tree.leaves(self._params_shape))
        mesh_key = None if self.plan is None else (
            self.plan.mesh, self.plan.data_axis, self.plan.param_sharding)
        shared_key = (self.fn, self.tx, self.loss, self.period, self.static, self.remat,
                      self.on_nonfinite, params_key, key, mesh_key)
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
            self._counters[i] = (jax.device_put(np.int32(i)) if self.plan is None else
                                 self.plan.put(np.int32(i), self.plan.replicated))
        return self._counters[i]

    def _data(self, x, y, keys=None):
        if self.plan is not None:  # the batch as global arrays, split along the data axis
            x = self.plan.put_batch(x, "Optimizer: inputs")
            y = self.plan.put_batch(y, "Optimizer: labels") if self.needs_labels else y
        x = x if keys is None else (x, keys)
        return (x, y) if self.needs_labels else (x,)

    def _split(self, params):
        """`(trainable params, PRNG keys among them or None)`."""
        return split_keys(params) if self._keyed else (params, None)

    def _merge(self, params, keys):
        return params if keys is None else merge_keys(params, keys)

    def _check_labels(self, build: _Build, labels) -> None:
        """Class ids on the host must lie in [0, nclasses): one-hot encoding would silently turn
        any other id into a zero row. JAX arrays are not read back (that would wait for the
        device every step): there such ids make the loss NaN, which `on_nonfinite` reports."""
        if build.nclasses is None or labels is None or isinstance(labels, jax.Array):
            return
        labels = np.asarray(labels)
        if labels.dtype.kind in "iu":
            check_class_ids(labels, build.nclasses, f"labels (for {self.loss!r} over "
                                                    f"{build.nclasses} outputs)")

    def check_labels(self, labels) -> None:
        """`ArgumentError` if host labels hold a class id the model's outputs cannot match."""
        if self._last is None:
            raise JGraphError("Optimizer.check_labels: call init first")
        self._check_labels(self._last, np.asarray(labels))

    def _micro_step(self, state, what: str) -> int:
        """The state's counter as an int in [0, period) (a Python int is fine)."""
        _train_state(state, what)
        counter = state.counter
        if type(counter) is np.int32 and 0 <= counter < self.period:  # what steps produce
            return int(counter)
        if np.ndim(counter) != 0:
            raise ArgumentError(f"{what}: state.counter must be a scalar, got shape "
                                f"{np.shape(counter)}")
        if isinstance(counter, np.ndarray | np.generic | jax.Array):
            if not jnp.issubdtype(counter.dtype, jnp.integer):
                raise ArgumentError(f"{what}: state.counter must be an integer, got "
                                    f"{counter.dtype}")
            counter = counter.item()
        return integer(counter, f"{what}: state.counter", 0, self.period - 1)

    @property
    def latest_state(self) -> TrainState:
        """The last state this Optimizer produced (init, step, step_period, reset or load):
        complete and never donated, so it can be saved after a Ctrl-C anywhere in a step loop."""
        if self._latest is None:
            raise JGraphError("Optimizer.latest_state: no state yet; call init first")
        return self._latest

    def _record(self, state: TrainState) -> TrainState:
        self._latest = state
        return state

    # -- the ggml_opt_* operations ----------------------------------------------------------------
    def init(self, params, example_inputs, example_labels=None) -> TrainState:
        """Build (and in static mode compile) the graphs; return the reset state for `params`."""
        check_leaves(params, "params")
        self._params_shape = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), dtype_of(a)), params)
        self._keyed = has_keys(params)
        self._builds.clear()
        build = self._for(example_inputs, example_labels)
        if self.needs_labels:
            self._check_labels(build, example_labels)
        lead = jax.tree.leaves(example_inputs)[0]
        self.batch_size = int(np.shape(lead)[0]) if np.ndim(lead) else 1
        params = fresh_copy(params) if self.plan is None else self._place(params, build)
        fresh = build.executables["reset"](self._split(params)[0])
        state = TrainState(params, fresh["opt_state"], fresh.get("grad_acc"), np.int32(0))
        build.state_template = jax.tree.map(
            lambda a: a if isinstance(a, np.ndarray | np.generic) else jax.ShapeDtypeStruct(
                a.shape, a.dtype), state)
        # one assignment: a Ctrl-C inside init leaves the previous init's template in place
        self._init, self._fingerprint, self._batch = build, None, batch_text(
            example_inputs, example_labels if self.needs_labels else None)
        return self._record(state)

    def _place(self, params, build: _Build):
        """Fresh global arrays of `params` on the mesh (keys replicated)."""
        trainable, keys = split_keys(params) if self._keyed else (params, None)
        trainable = self.plan.put_tree(trainable, build.steps.params)
        if keys is not None:
            keys = jax.tree.map(lambda k: self.plan.put(k, self.plan.replicated), keys)
        return self._merge(trainable, keys)

    def step(self, state: TrainState, inputs, labels=None):
        """One backward micro-step; on the last micro-step of a period also the optimizer step."""
        build = self._for(inputs, labels)
        self._check_labels(build, labels)
        i = self._micro_step(state, "Optimizer.step")
        if (state.grad_acc is None) != (self.period == 1):  # the executables would not notice
            self.checked_state(state, "Optimizer.step")
        trainable, keys = self._split(state.params)
        ex, data = build.executables, self._data(inputs, labels, keys)
        name = "opt" if i + 1 == self.period else "grad"
        # "raise" checks every micro-step; "skip" the optimizer steps only
        guarded = self.on_nonfinite == "raise" or (self.on_nonfinite == "skip" and name == "opt")
        raising = guarded and self.on_nonfinite == "raise"
        with held_sigint():  # from the donating call until the new state is recorded
            if self.period == 1:
                res = self._run(ex["opt"], state, trainable, *data, state.opt_state)
                value, _, params, opt_state = res[:4]
                new = TrainState(self._merge(params, keys), opt_state, None, np.int32(0))
            elif name == "opt":
                res = self._run(ex["opt"], state, trainable, *data, state.grad_acc,
                                self._counter(i), state.opt_state)
                value, acc, _, params, opt_state = res[:5]
                new = TrainState(self._merge(params, keys), opt_state, acc, np.int32(0))
            else:
                res = self._run(ex["grad"], state, trainable, *data, state.grad_acc,
                                self._counter(i))
                value, acc, _ = res[:3]
                new = state._replace(grad_acc=acc, counter=np.int32(i + 1))
            finite = res[-1] if guarded else None
            if raising:  # one bool per step; a Ctrl-C could not interrupt this wait anyway
                finite = bool(finite)
                if not finite:  # the graph kept the old values; so does the counter
                    new = new._replace(counter=np.int32(i))
            self._record(new)
        if raising:
            self._raise_if_nonfinite(finite, f"micro-step {i} of period {self.period}")
        return new, self._output(value, build, self.period, finite)

    def _run(self, executable, state, *args, what: str = "Optimizer.step"):
        try:
            return executable(*args)
        except (RuntimeError, TypeError, ValueError, JGraphError) as e:
            if deleted(state):  # jax raises RuntimeError or ValueError for a deleted buffer
                raise ArgumentError("Optimizer: this state's buffers were donated to a later step "
                                    "and deleted; continue from the state that step returned "
                                    "(or `opt.latest_state`)") from e
            if self._init is not None:  # a state that does not fit the executable: whose is it?
                self.checked_state(state, what)
            raise

    def _raise_if_nonfinite(self, finite: bool, where: str) -> None:
        if not finite:
            raise NonFiniteError(f"Optimizer.step: non-finite loss, gradient or update at {where}; "
                                 f"the update was dropped and the state is the one before the "
                                 f"step (`error.state`, `opt.latest_state`). "
                                 f"on_nonfinite='skip' drops such steps and goes on.",
                                 state=self._latest)

    def evaluate(self, state: TrainState, inputs, labels=None) -> StepOutput:
        """Forward only: the loss (and predictions) at the current params; state is unchanged."""
        _train_state(state, "Optimizer.evaluate")
        build = self._for(inputs, labels)
        self._check_labels(build, labels)
        trainable, keys = self._split(state.params)
        value = self._run(build.executables["forward"], state, trainable,
                          *self._data(inputs, labels, keys), what="Optimizer.evaluate")
        return self._output(value, build, 1)

    def reset(self, state: TrainState, optimizer: bool = False) -> TrainState:
        """ggml_opt_reset: zero accumulators and the counter; with `optimizer`, also `tx.init`."""
        if self._last is None:
            raise JGraphError("Optimizer.reset: call init first")
        if not isinstance(optimizer, bool):
            raise ArgumentError(f"Optimizer.reset: optimizer must be True or False, got "
                                f"{optimizer!r}")
        if not optimizer:  # the state's optimizer state is kept: it must be this Optimizer's
            self.checked_state(state, "Optimizer.reset")
        _train_state(state, "Optimizer.reset")
        fresh = self._run(self._last.executables["reset"], state, self._split(state.params)[0],
                          what="Optimizer.reset")
        new = state._replace(grad_acc=fresh.get("grad_acc"), counter=np.int32(0))
        return self._record(new._replace(opt_state=fresh["opt_state"]) if optimizer else new)

    def grad_acc(self, state: TrainState):
        """The accumulated gradients (None when the period is 1: there are no accumulators); on
        a mesh, the sum of the per-device accumulators."""
        _train_state(state, "Optimizer.grad_acc")
        if (state.grad_acc is None) != (self.period == 1):  # None would say "no accumulators"
            self.checked_state(state, "Optimizer.grad_acc")
        if self.plan is None or state.grad_acc is None:
            return state.grad_acc
        return self._last.steps.summed(state.grad_acc)

    @property
    def graphs(self) -> dict[str, Graph]:
        """The graphs of the latest build: `forward`, `grad`, `opt` and `reset` (on a mesh with
        period > 1: `forward`, `grad` of one data shard, `update` and `reset`)."""
        if self._last is None:
            raise JGraphError("Optimizer: no graphs yet; call init first")
        return dict(self._last.graphs)

    @property
    def executables(self) -> dict[str, Callable]:
        """The jitted functions of the latest build."""
        if self._last is None:
            raise JGraphError("Optimizer: nothing compiled yet; call init first")
        out = dict(self._last.executables)
        if self._last.period_fn is not None:
            out["period"] = self._last.period_fn
        return out

    def _output(self, value, build: _Build, period: int, finite=None) -> StepOutput:
        loss, aux = value if isinstance(value, tuple) else (value, (None, None))
        return StepOutput(loss, aux[0], aux[1], build.ndata, period,
                          LOSS_SCALED_BY_PERIOD[self.loss], finite)
