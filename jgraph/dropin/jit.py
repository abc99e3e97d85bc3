"""`jg.jit`: the user's whole training step traced into one jgraph graph, planned whole.

    step = jg.jit(train_step, budget="50%", donate_argnums=(0, 1))   # was jax.jit(train_step, ...)
    params, opt_state, loss = step(params, opt_state, batch)

The step is traced once per abstract signature (`jg.trace`, from the avals of its arguments) with
a `recording.Recorder` in force. Each drop-in gradient call the step makes (`jg.value_and_grad`,
`jg.grad`, the equinox filters) is not run there: the recorder binds one `jgraph_grad_call`
primitive carrying the call's joint graph, and the tracer splices that graph's eqns, tags and all,
into the step's graph (`_splice`). So the graph holds the step's own eqns before the call, the
forward and backward of the loss, and whatever the step computes from the gradients (the optax
update, metrics, an EMA of the params): `step.graph(*args)` shows it. With `budget=`, `jg.remat`
plans that graph whole (on `target`'s compiler, DESIGN §5); the gradients never leave it.

Roles: the leaves a gradient call differentiates are params; the other leaves of donated
arguments are state (`opt_state`, donated when jgraph measures the step); the rest data. A
result in a donated argument's tree (`return params, opt_state, loss`, a new `TrainState`) is
that argument's new value (`new_param`, `new_opt_state`: the planner fuses updates into the
backward there); other results are metrics.

Where the step's one gradient call reads the step's own arguments (the usual step), the graph
the planner gets is in its own form of a step (`_joint_and_tail`): the joint graph `jg.backward`
returned, inputs first and its record kept, the step's eqns after it, the gradients left out;
so it derives the joint again for loop modes and runs the loss head in chunks, as it does for
`jg.Optimizer`'s step. Any other step is planned as traced.

An argument's arrays and Python numbers are traced, as under `jax.jit`; where the argument
holds other leaves (an equinox module's functions) its arrays only, the rest static, as under
`equinox.filter_jit`. The step runs as one `jax.jit` of the planned graph over the traced leaves,
a donated argument's leaves donated, the user's other `jax.jit` options passed through;
`step.lower(*args)` lowers it.

Flax NNX objects (an `nnx.Module`, `nnx.Optimizer`, `nnx.MultiMetric`, an `nnx.Variable`: anything
`flax.nnx` splits) in the arguments are handled as `nnx.jit` handles them
(`jgraph.dropin.nnx_objects`): they are split together (`nnx.split`, shared Variables once), each
object's place in its argument left as a `NodeRef`, and each object's state appended as an argument
of its own, donated where its argument is. The step runs on objects merged from those states
(`nnx.merge`, one graphdef, static); after it the objects are split again, their states returned
ahead of the step's results, and the caller's objects updated in place (`nnx.update`), donated or
not. So the model's arrays the gradient call differentiates are params, the optimizer's and the
metrics' arrays state, and `optimizer.update(model, grads)` in the step is the update the planner
may fuse. What `nnx.jit` allows and this does not is an error: a step that changes an object's
structure (adds or removes a Variable or a submodule), or returns an NNX object. `flax.nnx` is
never imported here: an NNX object exists only where the user has imported it.

A gradient call under `jax.vmap` or `jax.jvp` inside the step runs under it, unspliced. A step
that differentiates with `jax.grad` / `jax.value_and_grad` has no backward of jgraph's to plan:
with a budget that is an error naming the fix (`jg.value_and_grad`, the same signature).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.extend import core as jex_core

from jgraph import _jax_internals as internals
from jgraph.builder import Builder, handler
from jgraph.dropin import nnx_objects, recording
from jgraph.dropin.arguments import ArgumentError
from jgraph.fuse import without_grads
from jgraph.ir import Eqn, Graph, Var
from jgraph.lower import InDonationOrder, Lowering, donation_order
from jgraph.remat import remat
from jgraph.trace import trace_closure

SIGNATURES = 64  # the most recently used signatures kept, each with its graph and executable


class _Held:
    """A joint graph as a primitive's parameter: hashed by identity (a graph's value is large)."""

    __slots__ = ("graph", "params")

    def __init__(self, graph: Graph, params: frozenset):
        self.graph = graph
        self.params = params  # positions of the graph's inputs the call differentiates

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


grad_call_p = jex_core.Primitive("jgraph_grad_call")
grad_call_p.multiple_results = True
grad_call_p.def_abstract_eval(lambda *avals, held: [v.aval for v in held.graph.outputs])
grad_call_p.def_impl(lambda *args, held: Lowering().run(held.graph, *args))


def _run_graph(held):
    return lambda *args: Lowering().run(held.graph, *args)


def _batched(args, dims, *, held):
    """Under `jax.vmap` inside the step (per-example gradients) the call's graph is not spliced:
    its eqns are bound under the vmap, as the drop-in does outside `jg.jit`."""
    axes = tuple(d if isinstance(d, int) else None for d in dims)  # (an unmapped operand)
    outs = jax.vmap(_run_graph(held), in_axes=axes)(*args)
    return outs, [0] * len(outs)


def _jvp(primals, tangents, *, held):
    """Under `jax.jvp` / `jax.grad` of the step: the call's graph differentiated as JAX ops."""
    tangents = [internals.instantiate_zeros(t) for t in tangents]
    return jax.jvp(_run_graph(held), list(primals), tangents)


internals.define_batching(grad_call_p, _batched)
internals.define_jvp(grad_call_p, _jvp)


@handler("jgraph_grad_call")
def _splice(b: Builder, eqn, inputs):
    """The joint graph of a gradient call, its eqns emitted as they are (tags, regions)."""
    held = eqn.params["held"]
    graph = held.graph
    env = dict(zip(graph.inputs, inputs, strict=True))
    recorder = recording.current()
    if recorder is not None:
        recorder.differentiated.update(inputs[k] for k in held.params
                                       if isinstance(inputs[k], Var))

    def read(a):
        return env.get(a, a) if isinstance(a, Var) else a

    first = len(b.eqns)
    for e in graph.eqns:
        outs = tuple(Var(v.aval) for v in e.outputs)
        env.update(zip(e.outputs, outs, strict=True))
        b.eqns.append(Eqn(e.op, tuple(read(a) for a in e.inputs), e.params, outs,
                          e.tags | b.tags, e.regions, e.source))
    b.new_regions.extend(graph.regions)
    outputs = [read(a) for a in graph.outputs]
    if recorder is not None:
        recorder.spliced.append((graph, list(inputs), outputs, b.eqns[first:]))
    return outputs


@dataclass
class _Recorder:
    """What the step's gradient calls were, while it is traced (`recording`)."""

    planned: bool  # each call's joint graph with its own regions applied (no budget of the step's)
    calls: list = field(default_factory=list)  # the transforms' names, in call order
    differentiated: set = field(default_factory=set)  # the step's inputs the calls differentiate
    spliced: list = field(default_factory=list)  # (joint, its input atoms, outputs, its eqns)

    def grad_call(self, transform, call, thunk):
        if not self.planned and transform.budget is not None:
            raise ArgumentError(f"jg.jit(budget=...): {transform.name} inside the step has a "
                                "budget of its own; give the budget to jg.jit only (it plans the "
                                "whole step)")
        entry = thunk() if self.planned else transform._trace(call, planned=False)
        graph = entry.graph
        params = frozenset(k for k, r in enumerate(graph.input_roles) if r == "param")
        flat = grad_call_p.bind(*call.dynamic, *entry.run.closed_over, held=_Held(graph, params))
        self.calls.append(transform.name)
        return entry, flat


@dataclass(eq=False)
class _Traced:
    graph: Graph  # the step's graph, planned
    unplanned: Graph
    jitted: object  # the jitted function of the arguments' traced leaves
    calls: list
    outputs: tuple  # (the result's treedef, which of its leaves are traced, its static leaves)

    def run(self, leaves):
        tree, mask, static = self.outputs
        traced, static = iter(self.jitted(*leaves)), iter(static)
        return jax.tree.unflatten(tree, [next(traced) if m else next(static) for m in mask])


ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
NUMBERS = (bool, int, float, complex)


def _traced_leaves(flat) -> tuple:
    """Which leaves of an argument (or a result) are traced: as `jax.jit` has them, its arrays
    and Python numbers, where every leaf is one; in a tree holding other leaves (a function, a
    string: an equinox module) its arrays only, as `equinox.filter_jit` has them (a module's
    numbers are its configuration: a pooling's initial value must stay a constant)."""
    plain = all(isinstance(x, ARRAYS + NUMBERS) for x in flat)
    return tuple(isinstance(x, ARRAYS) or (plain and isinstance(x, NUMBERS)) for x in flat)


@dataclass(frozen=True)
class _Parts:
    """The step's arguments as traced: per position not in `static_argnums`, its treedef and
    which of its leaves are traced; the other leaves' values, and the static arguments."""

    positions: tuple
    trees: tuple
    masks: tuple
    statics: tuple
    static_args: tuple

    @staticmethod
    def of(args, static) -> tuple[_Parts, list]:
        positions = tuple(i for i in range(len(args)) if i not in static)
        trees, masks, statics, leaves = [], [], [], []
        for i in positions:
            flat, tree = jax.tree.flatten(args[i])
            mask = _traced_leaves(flat)
            trees.append(tree)
            masks.append(mask)
            leaves += [x for x, m in zip(flat, mask, strict=True) if m]
            statics += [x for x, m in zip(flat, mask, strict=True) if not m]
        return _Parts(positions, tuple(trees), tuple(masks), tuple(statics),
                      tuple((i, args[i]) for i in static if i < len(args))), leaves

    def args(self, leaves) -> list:
        """The step's arguments with these traced leaves."""
        full = [None] * (len(self.positions) + len(self.static_args))
        for i, a in self.static_args:
            full[i] = a
        traced, static = iter(leaves), iter(self.statics)
        for i, tree, mask in zip(self.positions, self.trees, self.masks, strict=True):
            full[i] = jax.tree.unflatten(tree, [next(traced) if m else next(static)
                                                for m in mask])
        return full

    def counts(self) -> list[int]:
        return [sum(mask) for mask in self.masks]


class Jit:
    """The transform `jg.jit(fun, ...)` returns."""

    def __init__(self, fun, budget=None, target=None, **jit_kwargs):
        if not callable(fun):
            raise ArgumentError(f"jg.jit: expected a function, got {type(fun).__name__}")
        self.fun, self.budget, self.target = fun, budget, target
        static = jit_kwargs.get("static_argnums", ())
        self.static = (static,) if isinstance(static, int) else tuple(static)
        donate = jit_kwargs.get("donate_argnums", ())
        self.donate = (donate,) if isinstance(donate, int) else tuple(donate)
        if "static_argnames" in jit_kwargs or "donate_argnames" in jit_kwargs:
            raise ArgumentError("jg.jit: pass static and donated arguments by position "
                                "(static_argnums=, donate_argnums=)")
        self.jit_kwargs = jit_kwargs
        self._cache: dict = {}
        functools.update_wrapper(self, fun, updated=())

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise ArgumentError(f"jg.jit: pass the step's arguments by position (got keyword "
                                f"arguments {sorted(kwargs)})")
        args, nodes = nnx_objects.split_nodes(args, self.static)
        parts, leaves = _Parts.of(args, self.static)
        result = self._traced(args).run(leaves)
        if not nodes:
            return result
        states, out = result
        # as nnx.jit: the caller's objects, in place
        nnx_objects.flax_nnx().update(nodes, nnx_objects.whole(states))
        return out

    def graph(self, *args) -> Graph:
        """The step's graph for these arguments, as it runs (planned under the budget)."""
        return self._traced(nnx_objects.split_nodes(args, self.static)[0]).graph

    def info(self, *args) -> dict:
        """What was traced and planned: the gradient calls spliced, the plan (`jg.remat`'s
        report, with the budget's figure and XLA's, and `fused`: the params whose update moved
        into the backward), the roles of the inputs, and `updates`: why updates were not fused
        (None where they could be)."""
        traced = self._traced(nnx_objects.split_nodes(args, self.static)[0])
        graph = traced.graph
        updates = None
        if not any(r.startswith("new_") for r in graph.output_roles):
            updates = ("the step returns no donated argument's new value, so its updates have no "
                       "buffers to be written into where the gradients are made: donate the "
                       "params and optimizer state (donate_argnums) and return them in the same "
                       "structure" if self.budget is not None else "no budget: nothing planned")
        return {"grad_calls": list(traced.calls), "remat": graph.info.get("remat"),
                "input_roles": graph.input_roles, "updates": updates,
                "unplanned": traced.unplanned}

    def lower(self, *args):
        """`jax.jit(...).lower` of the step for these arguments (ahead-of-time work)."""
        args = nnx_objects.split_nodes(args, self.static)[0]
        return self._traced(args).jitted.lower(*_Parts.of(args, self.static)[1])

    # -- tracing -------------------------------------------------------------------------------
    def _key(self, args):
        for i in self.static:
            if i >= len(args):
                raise ArgumentError(f"jg.jit: static_argnums has {i}, but the step got "
                                    f"{len(args)} arguments")
        parts, leaves = _Parts.of(args, self.static)
        avals = tuple((tuple(np.shape(x)), str(jax.numpy.result_type(x)),
                       getattr(jax.typeof(x), "weak_type", False)) for x in leaves)
        return (parts, avals)

    def _traced(self, args) -> _Traced:
        key = self._key(args)
        try:
            found = self._cache.get(key)
        except TypeError:
            raise ArgumentError("jg.jit: a static argument (or a leaf of an argument that is "
                                "not an array: a function, a string) is not hashable") from None
        if found is None:
            found = self._cache[key] = self._trace(args)
            while len(self._cache) > SIGNATURES:
                del self._cache[next(iter(self._cache))]
        else:
            self._cache[key] = self._cache.pop(key)  # the most recently used last
        return found

    def _trace(self, args) -> _Traced:
        """Trace the step for these arguments (NNX objects split out: `nnx_objects.split_nodes`)."""
        parts, leaves = _Parts.of(args, self.static)
        fun, outputs = self.fun, []
        nodes = sum(isinstance(a, nnx_objects.NodeState) for a in args)

        def step(*traced):
            full = parts.args(traced)
            out = nnx_objects.with_nodes(fun, full, nodes) if nodes else fun(*full)
            flat, tree = jax.tree.flatten(out)
            mask = tuple(isinstance(x, jax.core.Tracer) or isinstance(x, ARRAYS) for x in flat)
            outputs.append((tree, mask, tuple(x for x, m in zip(flat, mask, strict=True)
                                              if not m)))
            return [x for x, m in zip(flat, mask, strict=True) if m]

        recorder = _Recorder(planned=self.budget is None)
        with recording.active(recorder):
            graph, closed_over = trace_closure(step, *leaves)
        if closed_over:
            raise ArgumentError("jg.jit: the step closes over values traced by an enclosing "
                                "transform; pass them as arguments")
        donated = {i for i in parts.positions if i in self.donate or (
            isinstance(args[i], nnx_objects.NodeState) and args[i].owner in self.donate)}
        roles = []
        for i, n in zip(parts.positions, parts.counts(), strict=True):
            roles += ["opt_state" if i in donated else "data"] * n
        roles = tuple("param" if v in recorder.differentiated else r
                      for v, r in zip(graph.inputs, roles, strict=True))
        unplanned = graph.replace(
            input_roles=roles, output_roles=_output_roles(graph, roles, parts, outputs[-1],
                                                          donated, nodes),
            param_argnums=None, has_aux=False)
        order, n_out = list(range(len(unplanned.inputs))), len(unplanned.outputs)
        if self.budget is not None:
            if not recorder.calls:
                raise ArgumentError(
                    "jg.jit(budget=...): the step computes no gradient with jg.value_and_grad or "
                    "jg.grad, so it has no backward of jgraph's to plan; differentiate with "
                    "jg.value_and_grad (the same signature as jax.value_and_grad)")
            joined = _joint_and_tail(unplanned, recorder.spliced)
            if joined is not None:
                unplanned, order = joined
            planned = remat(unplanned, budget=self.budget, target=self.target)
        else:
            planned = remat(unplanned) if unplanned.regions else unplanned
        jitted = self._jitted(planned, parts, order, n_out, donated, outputs[-1],
                              len(args) - nodes)
        return _Traced(planned, unplanned, jitted,
                       recorder.calls, outputs[-1])

    def _jitted(self, graph: Graph, parts: _Parts, order, n_out: int, donated, outputs,
                n_args: int):
        """`jax.jit` of the graph as a function of the arguments' traced leaves (in `order` the
        graph's inputs), returning the last `n_out` of its outputs (the step's traced results);
        a donated argument's leaves donated. Shardings given as `jax.jit` takes them (a prefix
        of the step's arguments, static ones left out, or of its result) are given per leaf;
        an NNX object's arrays keep the shardings they have."""
        donate, start = [], 0
        for i, n in zip(parts.positions, parts.counts(), strict=True):
            if i in donated:
                donate += range(start, start + n)
            start += n
        options = {k: v for k, v in self.jit_kwargs.items()
                   if k not in ("static_argnums", "donate_argnums")}
        if "in_shardings" in options:
            values = [jax.tree.unflatten(tree, [0] * len(mask))
                      for i, tree, mask in zip(parts.positions, parts.trees, parts.masks,
                                               strict=True) if i < n_args]
            masks = [m for i, m in zip(parts.positions, parts.masks, strict=True) if i < n_args]
            flat = _per_leaf(options["in_shardings"], values, masks, "in_shardings",
                             "the step's positional arguments (static_argnums left out)")
            if isinstance(flat, list):  # NNX objects' states, appended: their own shardings
                flat += [None] * (sum(parts.counts()) - len(flat))
            options["in_shardings"] = flat
        if "out_shardings" in options:
            tree, mask, _ = outputs
            flat = _per_leaf((options["out_shardings"],), [jax.tree.unflatten(
                tree, [0] * len(mask))], [mask], "out_shardings", "the step's result")
            options["out_shardings"] = flat

        first = len(graph.outputs) - n_out  # each donated leaf's new value written into it
        taken = set(donate)
        results = [k - first for k in donation_order(graph, [k in taken for k in order])
                   if k >= first]
        if "out_shardings" in options and isinstance(options["out_shardings"], list):
            options["out_shardings"] = [options["out_shardings"][k] for k in results]

        def run(*leaves):
            outs = Lowering().run(graph, *[leaves[k] for k in order])
            return [outs[first + k] for k in results]

        return InDonationOrder(jax.jit(run, donate_argnums=tuple(donate), **options), results)


def _is_spec(x) -> bool:
    return x is None or isinstance(x, (jax.sharding.Sharding, jax.sharding.PartitionSpec))


def _per_leaf(spec, values: list, masks: list, name: str, of: str):
    """`spec`, shardings as `jax.jit` takes them for `values` (one for all, or a tuple with a
    prefix of each value), as a list with one per traced leaf (`masks`); one for all as is."""
    if _is_spec(spec) or not isinstance(spec, (tuple, list)):
        return spec
    if len(spec) != len(values):
        raise ArgumentError(f"jg.jit: {name} has {len(spec)} entries for {len(values)} of "
                            f"{of}; give one for each, or one sharding for all, as jax.jit "
                            "takes them")
    flat = []
    for k, (s, value, mask) in enumerate(zip(spec, values, masks, strict=True)):
        prefix = jax.tree.structure(s, is_leaf=_is_spec)
        try:
            parts = prefix.flatten_up_to(value)
        except (ValueError, TypeError) as e:
            raise ArgumentError(f"jg.jit: {name}[{k}] is not a prefix of the structure of "
                                f"{of}[{k}]: {e}") from None
        each = []
        for sharding, part in zip(jax.tree.leaves(s, is_leaf=_is_spec), parts, strict=True):
            each += [sharding] * len(jax.tree.leaves(part))
        flat += [x for x, m in zip(each, mask, strict=True) if m]
    return flat


def _joint_and_tail(step: Graph, spliced) -> tuple[Graph, list] | None:
    """The step as the planner knows a training step: the joint graph `jg.backward` returned
    (its inputs first, its info kept, so the planner derives it again for loop modes and runs
    its loss head in chunks), the step's own eqns appended as its tail, the step's results
    after the joint's, the gradients left out (`without_grads`). Only for a step with one
    gradient call, of the step's own arguments, whose eqns before the call do not feed it.
    (The graph, the order of the step's flat inputs as its inputs) or None."""
    if len(spliced) != 1:
        return None
    joint, atoms, outs, copied = spliced[0]
    position = {v: k for k, v in enumerate(step.inputs)}
    if not any("backward" in e.tags for e in joint.eqns):
        return None
    if not all(isinstance(a, Var) and a in position for a in atoms) or len(set(atoms)) != len(
            atoms):
        return None
    copied = set(map(id, copied))
    if sum(id(e) in copied for e in step.eqns) != len(copied):  # inside a loop body, a branch
        return None
    mine = {v for v in outs if isinstance(v, Var)}
    inside = {v for e in step.eqns if id(e) in copied for v in e.outputs} - mine
    subst = dict(zip(atoms, joint.inputs, strict=True))
    subst.update((o, j) for o, j in zip(outs, joint.outputs, strict=True) if isinstance(o, Var))
    tail = []
    for e in step.eqns:
        if id(e) in copied:
            continue
        if any(isinstance(a, Var) and a in inside for a in e.inputs):
            return None  # the step reads a value inside the gradient call
        tail.append(Eqn(e.op, tuple(subst.get(a, a) if isinstance(a, Var) else a
                                    for a in e.inputs), e.params, e.outputs, e.tags, e.regions,
                        e.source))
    if any((r == "param") != (step.input_roles[position[a]] == "param")
           for a, r in zip(atoms, joint.input_roles, strict=True)):
        return None
    rest = [k for k, v in enumerate(step.inputs) if v not in subst]
    order = [position[a] for a in atoms] + rest
    inputs = joint.inputs + tuple(step.inputs[k] for k in rest)
    roles = joint.input_roles + tuple(step.input_roles[k] for k in rest)
    results = tuple(subst.get(a, a) if isinstance(a, Var) else a for a in step.outputs)
    parts = list(joint.out_tree.children()) + [step.out_tree]
    tree = jax.tree.structure(tuple(jax.tree.unflatten(t, [0] * t.num_leaves) for t in parts))
    whole = joint.replace(inputs=inputs, input_roles=roles, eqns=joint.eqns + tuple(tail),
                          outputs=joint.outputs + results,
                          output_roles=joint.output_roles + step.output_roles,
                          in_tree=None, out_tree=tree, param_argnums=None)
    return without_grads(whole, placeholder=True), order


def _results(tree) -> list:
    """The step's results as `_output_roles` pairs them with arguments: the items of a returned
    tuple (or of another container), else the one result."""
    results = tree.children() if tree.num_nodes > 1 and tree.children() else [tree]
    return [tree] if len(results) == 1 and results[0] != tree else results


def _output_roles(graph: Graph, roles, parts: _Parts, outputs, donated, nodes: int) -> tuple:
    """Each output's role: the new value of a donated argument's leaf (`new_param`,
    `new_opt_state`) where the step returns that argument's tree (one of its results, in the
    argument's structure, shapes and dtypes: `return params, opt_state, loss`, a flax
    `TrainState`; the new states of `nodes` NNX objects, ahead of the step's result), else a
    metric. New values keep their inputs' order, as `jg.fuse_updates` pairs them."""
    out_roles = ["metric"] * len(graph.outputs)
    tree, mask, _ = outputs
    if nodes:
        states, result = tree.children()
        results = states.children() + _results(result)
    else:
        results = _results(tree)
    groups, leaf, traced = [], 0, 0  # per result: (treedef, mask, first traced output)
    for t in results:
        m = mask[leaf:leaf + t.num_leaves]
        groups.append((t, m, traced))
        leaf, traced = leaf + t.num_leaves, traced + sum(m)
    first, used = 0, set()
    for i, t_in, m_in in zip(parts.positions, parts.trees, parts.masks, strict=True):
        n = sum(m_in)
        if i in donated:
            inputs = graph.inputs[first:first + n]
            for j, (t, m, start) in enumerate(groups):
                outs = graph.outputs[start:start + n]
                if j in used or t != t_in or m != m_in or [
                        getattr(o, "aval", None) for o in outs] != [v.aval for v in inputs]:
                    continue
                used.add(j)
                for k, r in enumerate(roles[first:first + n]):
                    if r in ("param", "opt_state"):
                        out_roles[start + k] = "new_" + r
                break
        first += n
    return tuple(out_roles)


def jit(fun=None, *, budget=None, target=None, **jit_kwargs):
    """`jax.jit` of a training step, with the step traced whole into one jgraph graph.

    Each `jg.value_and_grad` / `jg.grad` call in the step is spliced into the step's graph with
    its forward and backward, so the optimizer update and metrics after it are the graph's tail;
    a result in a donated argument's structure is that argument's new value. Without a budget
    the step is bitwise `jax.jit` of the step written with `jax.value_and_grad` (module
    docstring).

    Args:
        fun: the step; None returns a decorator (`@jg.jit(budget="50%")`).
        budget: plan the whole step: bytes, or a percentage of the unplanned step's figure on
            `target` (as `jg.remat`'s).
        target: the chip the budget is planned for (`jgraph.target`).
        **jit_kwargs: passed to `jax.jit`: `donate_argnums`, `static_argnums`, `in_shardings`,
            `out_shardings`, ...

    Returns:
        A `Jit` callable, as `jax.jit`'s; `.graph(*args)`, `.info(*args)` (the plan, the roles of
        the inputs) and `.lower(*args)` for the step traced at these arguments."""
    if fun is None:
        return lambda f: Jit(f, budget=budget, target=target, **jit_kwargs)
    return Jit(fun, budget=budget, target=target, **jit_kwargs)

