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
arguments are state (`opt_state`, donated when jgraph measures the step); the rest data. Every
output is a metric: jax.jit's rule, the first donated argument of the same shape and dtype, says
which donated buffer each is written into.

The step runs as one `jax.jit` of the planned graph, with the user's `donate_argnums`,
`static_argnums` and other `jax.jit` options passed through; `step.lower(*args)` lowers it.
A step that differentiates with `jax.grad` / `jax.value_and_grad` has no backward of jgraph's to
plan: with a budget that is an error naming the fix (`jg.value_and_grad`, the same signature).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching

from jgraph.builder import Builder, handler
from jgraph.dropin import recording
from jgraph.dropin.arguments import ArgumentError
from jgraph.fuse import without_grads
from jgraph.ir import Eqn, Graph, Var
from jgraph.lower import Lowering
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
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(_run_graph(held), list(primals), tangents)


batching.primitive_batchers[grad_call_p] = _batched
ad.primitive_jvps[grad_call_p] = _jvp


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

    for e in graph.eqns:
        outs = tuple(Var(v.aval) for v in e.outputs)
        env.update(zip(e.outputs, outs, strict=True))
        b.eqns.append(Eqn(e.op, tuple(read(a) for a in e.inputs), e.params, outs,
                          e.tags | b.tags, e.regions, e.source))
    b.new_regions.extend(graph.regions)
    outputs = [read(a) for a in graph.outputs]
    if recorder is not None:
        recorder.spliced.append((graph, list(inputs), outputs))
    return outputs


@dataclass
class _Recorder:
    """What the step's gradient calls were, while it is traced (`recording`)."""

    planned: bool  # each call's joint graph with its own regions applied (no budget of the step's)
    calls: list = field(default_factory=list)  # the transforms' names, in call order
    differentiated: set = field(default_factory=set)  # the step's inputs the calls differentiate
    spliced: list = field(default_factory=list)  # (joint graph, its input atoms, its outputs)

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
    run: object  # the jitted function of the user's arguments
    calls: list


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
        return self._traced(args).run(*args)

    def graph(self, *args) -> Graph:
        """The step's graph for these arguments, as it runs (planned under the budget)."""
        return self._traced(args).graph

    def info(self, *args) -> dict:
        """What was traced and planned: the gradient calls spliced, the plan (`jg.remat`'s
        report, with the budget's figure and XLA's, and `fused`: the params whose update moved
        into the backward), the roles of the inputs, and `updates`: why updates were not fused
        (None where they could be)."""
        traced = self._traced(args)
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
        return self._traced(args).run.lower(*args)

    # -- tracing -------------------------------------------------------------------------------
    def _key(self, args):
        for i in self.static:
            if i >= len(args):
                raise ArgumentError(f"jg.jit: static_argnums has {i}, but the step got "
                                    f"{len(args)} arguments")
        dynamic = [a for i, a in enumerate(args) if i not in self.static]
        leaves, tree = jax.tree.flatten(dynamic)
        avals = tuple((tuple(jax.numpy.shape(x)), str(jax.numpy.result_type(x)),
                       getattr(jax.typeof(x), "weak_type", False)) for x in leaves)
        static = tuple(args[i] for i in self.static if i < len(args))
        return (tree, avals, static)

    def _traced(self, args) -> _Traced:
        key = self._key(args)
        try:
            found = self._cache.get(key)
        except TypeError:
            raise ArgumentError("jg.jit: a static argument is not hashable") from None
        if found is None:
            found = self._cache[key] = self._trace(args)
            while len(self._cache) > SIGNATURES:
                del self._cache[next(iter(self._cache))]
        else:
            self._cache[key] = self._cache.pop(key)  # the most recently used last
        return found

    def _trace(self, args) -> _Traced:
        positions = [i for i in range(len(args)) if i not in self.static]
        fun = self.fun

        def step(*dynamic):
            full = list(args)
            for i, a in zip(positions, dynamic, strict=True):
                full[i] = a
            return fun(*full)

        dynamic = [args[i] for i in positions]
        recorder = _Recorder(planned=self.budget is None)
        with recording.active(recorder):
            graph, closed_over = trace_closure(step, *dynamic)
        if closed_over:
            raise ArgumentError("jg.jit: the step closes over values traced by an enclosing "
                                "transform; pass them as arguments")
        donated = set(self.donate)
        roles = []
        for i, a in zip(positions, dynamic, strict=True):
            roles += ["opt_state" if i in donated else "data"] * len(jax.tree.leaves(a))
        roles = tuple("param" if v in recorder.differentiated else r
                      for v, r in zip(graph.inputs, roles, strict=True))
        unplanned = graph.replace(
            input_roles=roles, output_roles=_output_roles(graph, roles, dynamic, positions,
                                                          donated),
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
        return _Traced(planned, unplanned, self._runner(planned, args, order, n_out, graph),
                       recorder.calls)

    def _runner(self, graph: Graph, args, order, n_out: int, step: Graph):
        """The jitted function of the user's arguments: their leaves in `order` are the graph's
        inputs, the last `n_out` of its outputs the step's results (in `step`'s structure)."""
        positions = [i for i in range(len(args)) if i not in self.static]
        out_tree = step.out_tree

        def run(*call_args):
            leaves = jax.tree.leaves([call_args[i] for i in positions])
            outs = Lowering().run(graph, *[leaves[k] for k in order])
            return jax.tree.unflatten(out_tree, outs[len(outs) - n_out:])

        return jax.jit(run, **self.jit_kwargs)


def _joint_and_tail(step: Graph, spliced) -> tuple[Graph, list] | None:
    """The step as the planner knows a training step: the joint graph `jg.backward` returned
    (its inputs first, its info kept, so the planner derives it again for loop modes and runs
    its loss head in chunks), the step's own eqns appended as its tail, the step's results
    after the joint's, the gradients left out (`without_grads`). Only for a step with one
    gradient call, of the step's own arguments, whose eqns before the call do not feed it.
    (The graph, the order of the step's flat inputs as its inputs) or None."""
    if len(spliced) != 1:
        return None
    joint, atoms, outs = spliced[0]
    position = {v: k for k, v in enumerate(step.inputs)}
    if "backward_of" not in joint.info and joint.info.get("forward") is None and \
            not any("backward" in e.tags for e in joint.eqns):
        return None
    if not all(isinstance(a, Var) and a in position for a in atoms) or len(set(atoms)) != len(
            atoms):
        return None
    mine = {v for v in outs if isinstance(v, Var)}
    produced = {v for e in step.eqns for v in e.outputs}
    if not mine <= produced:  # spliced inside a loop body or a branch
        return None
    # the spliced copy: the joint's eqns, ending with the last eqn writing one of its outputs
    ends = [i for i, e in enumerate(step.eqns) if any(v in mine for v in e.outputs)]
    if not ends or ends[-1] + 1 < len(joint.eqns):
        return None
    end = ends[-1] + 1
    start = end - len(joint.eqns)
    if [e.op for e in step.eqns[start:end]] != [e.op for e in joint.eqns]:
        return None
    inside = {v for e in step.eqns[start:end] for v in e.outputs} - mine
    subst = dict(zip(atoms, joint.inputs, strict=True))
    subst.update((o, j) for o, j in zip(outs, joint.outputs, strict=True) if isinstance(o, Var))
    tail = []
    for e in step.eqns[:start] + step.eqns[end:]:
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


def _output_roles(graph: Graph, roles, dynamic, positions, donated) -> tuple:
    """Each output's role: the new value of a donated argument's leaf (`new_param`,
    `new_opt_state`) where the step returns that argument's tree (one of its results, in the
    argument's structure, shapes and dtypes: `return params, opt_state, loss`, a flax
    `TrainState`), else a metric. New values keep their inputs' order, as `jg.fuse_updates`
    pairs them."""
    out_roles = ["metric"] * len(graph.outputs)
    results = graph.out_tree.children() if graph.out_tree.num_nodes > 1 and \
        graph.out_tree.children() else [graph.out_tree]
    if len(results) == 1 and results[0] != graph.out_tree:
        results = [graph.out_tree]
    starts = [sum(t.num_leaves for t in results[:j]) for j in range(len(results))]
    first, used = 0, set()
    for i, a in zip(positions, dynamic, strict=True):
        tree, n = jax.tree.structure(a), len(jax.tree.leaves(a))
        if i in donated:
            inputs = graph.inputs[first:first + n]
            for j, t in enumerate(results):
                outs = graph.outputs[starts[j]:starts[j] + n]
                if j in used or t != tree or [getattr(o, "aval", None) for o in outs] != [
                        v.aval for v in inputs]:
                    continue
                used.add(j)
                for k, r in enumerate(roles[first:first + n]):
                    if r in ("param", "opt_state"):
                        out_roles[starts[j] + k] = "new_" + r
                break
        first += n
    return tuple(out_roles)


def jit(fun=None, *, budget=None, target=None, **jit_kwargs):
    """`jax.jit` of a training step, with the step traced whole into a jgraph graph and, with
    `budget=` (bytes, or a percentage of the unplanned step's figure on `target`), planned whole
    (module docstring). Usable as `@jg.jit(budget="50%")` too."""
    if fun is None:
        return lambda f: Jit(f, budget=budget, target=target, **jit_kwargs)
    return Jit(fun, budget=budget, target=target, **jit_kwargs)

