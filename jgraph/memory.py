"""Memory reports: an estimate on the graph's schedule, and XLA's figures for the compiled step.

`memory(graph)` walks the schedule (the order of `graph.eqns`) as the interpreter does: a value is
live from the eqn that produces it to its last reader. It reports the bytes of intermediate values
live at each eqn and their peak, the counterpart of XLA's temp buffers: the graph's inputs and
outputs are counted apart (`argument_bytes`, `output_bytes`), as in a donated step the gradients
go straight into the params. And it lists the saved residuals: the values the backward (or a
recompute) reads from the forward, with their provenance, as `print_saved_residuals` prints them.

`compiled_memory(graph, *args)` compiles the *donated training step* of the graph and returns
XLA's `memory_analysis()` figures. The step takes the graph's state inputs (params, accumulators,
optimizer state, counters) as one donated argument and the rest (data, labels, loss seed) as
another. If the graph updates its params itself (it has `new_param` outputs) the step is the graph;
otherwise the grads feed a plain SGD update `p - 0.001 * g` of the params, and the step returns the
updated state with the graph's other outputs. Donation matters: without it XLA:CPU places
activations in the not yet written gradient outputs, and `temp_size_in_bytes` misleads.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jgraph.check import validate
from jgraph.errors import TransformError
from jgraph.interpreter import Interpreter, flatten_args
from jgraph.ir import Graph, Var, short_aval, sub_graphs
from jgraph.lower import Lowering

STATE_ROLES = ("param", "accumulator", "opt_state", "counter")


def itemsize(dtype) -> int:
    """Bytes per element of a numpy dtype or of one of JAX's extended dtypes (a PRNG key's is its
    key data's: 8 bytes for `key<fry>`), which numpy cannot interpret."""
    size = getattr(dtype, "itemsize", None)
    if size is None:
        raise TransformError(f"jgraph.memory: cannot size elements of dtype {dtype}: it has no "
                             f"itemsize")
    return int(size)


def nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * itemsize(aval.dtype)


@dataclass(frozen=True)
class Residual:
    var: Var  # the forward value read by the backward
    provenance: str  # "from the argument [0]['w']", "named 'z' from f.py:3", "output of tanh ..."

    def __str__(self):
        return f"{short_aval(self.var.aval)} {self.provenance}"


@dataclass(frozen=True)
class MemoryReport:
    peak_bytes: int  # most bytes of intermediate values live at once
    peak_eqn: int  # index of the eqn where the peak is reached (-1: no eqns)
    live_bytes: tuple[int, ...]  # per eqn: bytes of intermediate values live while it runs
    argument_bytes: int  # bytes of the graph's inputs
    output_bytes: int  # bytes of the graph's outputs that eqns produce
    residuals: tuple[Residual, ...]  # forward values read by the backward, in schedule order

    @property
    def residual_bytes(self) -> int:
        return sum(nbytes(r.var.aval) for r in self.residuals)

    def __str__(self):
        lines = [f"peak {self.peak_bytes / 2**20:.2f} MiB at eqn {self.peak_eqn}, "
                 f"arguments {self.argument_bytes / 2**20:.2f} MiB, "
                 f"outputs {self.output_bytes / 2**20:.2f} MiB, "
                 f"{len(self.residuals)} saved residuals ({self.residual_bytes / 2**20:.2f} MiB):"]
        lines += [f"  {r}" for r in self.residuals]
        return "\n".join(lines)


class _LiveBytes(Interpreter):
    """The interpreter loop on avals instead of values: it computes nothing and counts the bytes
    of the intermediate values alive while each eqn runs (its inputs, its outputs, and whatever a
    later eqn still reads), plus, for a loop or a cond, the peak of its body."""

    def run(self, graph: Graph, *args):
        self.counted = {a for a in graph.outputs if isinstance(a, Var)} | set(graph.inputs)
        self.total, self.per_eqn = 0, []
        return super().run(graph, *(v.aval for v in graph.inputs))

    def eval_eqn(self, eqn, values):
        inner = max((memory(sub).peak_bytes for sub in sub_graphs(eqn)), default=0)
        self.per_eqn.append(self.total + sum(nbytes(v.aval) for v in eqn.outputs
                                             if v not in self.counted) + inner)
        return [v.aval for v in eqn.outputs]

    def write(self, var, value):
        super().write(var, value)
        if var not in self.counted:
            self.total += nbytes(var.aval)

    def free(self, var):
        super().free(var)
        if var not in self.counted:
            self.total -= nbytes(var.aval)


def memory(graph: Graph) -> MemoryReport:
    """Live bytes per eqn on the graph's schedule, their peak, and the saved residuals."""
    validate(graph, "jg.memory")
    live = _LiveBytes()
    live.run(graph)
    per_eqn = live.per_eqn
    outputs = {a for a in graph.outputs if isinstance(a, Var)}
    peak = max(per_eqn, default=0)
    return MemoryReport(
        peak_bytes=peak,
        peak_eqn=per_eqn.index(peak) if per_eqn else -1,
        live_bytes=tuple(per_eqn),
        argument_bytes=sum(nbytes(v.aval) for v in graph.inputs),
        output_bytes=sum(nbytes(v.aval) for v in outputs - set(graph.inputs)),
        residuals=tuple(saved_residuals(graph)),
    )


def saved_residuals(graph: Graph) -> list[Residual]:
    """Forward values (and inputs) read by backward or recompute eqns, with provenance."""
    producer = {v: e for e in graph.eqns if not ({"backward", "recompute"} & e.tags)
                for v in e.outputs}
    arg_names = _argument_names(graph)
    found, out = set(), []
    for eqn in graph.eqns:
        if not ({"backward", "recompute"} & eqn.tags):
            continue
        for a in eqn.inputs:
            if not isinstance(a, Var) or a in found or not (a in producer or a in arg_names):
                continue
            found.add(a)
            out.append(Residual(a, _provenance(a, producer.get(a), arg_names)))
    return out


def _argument_names(graph: Graph) -> dict[Var, str]:
    if graph.in_tree is None:
        return {v: f"[{k}]" for k, v in enumerate(graph.inputs)}
    tree = jax.tree.unflatten(graph.in_tree, list(range(len(graph.inputs))))
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {graph.inputs[k]: jax.tree_util.keystr(path) for path, k in paths}


def _provenance(v: Var, eqn, arg_names) -> str:
    if eqn is None:
        return f"from the argument {arg_names[v]}"
    where = f" from {eqn.source}" if eqn.source else ""
    if eqn.op == "name":
        return f"named {eqn.params.get('name')!r}{where}"
    return f"output of {eqn.op}{where}"


# -- XLA's figures for the donated training step ---------------------------------------------------
@dataclass(frozen=True)
class CompiledMemory:
    temp_bytes: int  # XLA temp_size_in_bytes: buffers that are neither arguments nor outputs
    argument_bytes: int  # argument_size_in_bytes
    output_bytes: int  # output_size_in_bytes
    alias_bytes: int  # alias_size_in_bytes: outputs written into donated arguments
    dots: int  # `dot(` instructions in the compiled HLO (recomputed matmuls show up here)

    def __str__(self):
        mib = 2**20
        return (f"temp {self.temp_bytes / mib:.2f} MiB, arguments {self.argument_bytes / mib:.2f}"
                f" MiB, outputs {self.output_bytes / mib:.2f} MiB, aliased "
                f"{self.alias_bytes / mib:.2f} MiB, {self.dots} dots")


def donated_step(graph: Graph, learning_rate: float = 1e-3):
    """`(step, split)`: `step(state, rest)` is the training step of the graph, jitted with
    `state` donated; `split(*args)` turns the graph's call arguments into `(state, rest)`."""
    is_state = [r in STATE_ROLES for r in graph.input_roles]
    updates_itself = any(r == "new_param" for r in graph.output_roles)
    params = [k for k, r in enumerate(graph.input_roles) if r == "param"]
    grads = [k for k, r in enumerate(graph.output_roles) if r == "grad"]
    sgd = not updates_itself and len(grads) == len(params) > 0
    grad_params = _params_in_grad_order(graph) if sgd else []
    lowering = Lowering()

    def step(state, rest):
        state, rest = iter(state), iter(rest)
        flat = [next(state) if s else next(rest) for s in is_state]
        outs = lowering.run(graph, *flat)
        if not sgd:
            return outs
        new = dict(enumerate(flat))
        for k, g in zip(grad_params, [outs[i] for i in grads], strict=True):
            new[k] = flat[k] - learning_rate * g
        others = [o for i, o in enumerate(outs) if i not in grads]
        return [new[k] for k, s in enumerate(is_state) if s], others

    def split(*args):
        flat = flatten_args(graph, args)
        return ([x for x, s in zip(flat, is_state, strict=True) if s],
                [x for x, s in zip(flat, is_state, strict=True) if not s])

    return jax.jit(step, donate_argnums=0), split


def _params_in_grad_order(graph: Graph) -> list[int]:
    index = {v: k for k, v in enumerate(graph.inputs)}
    return [index[v] for v in graph.grad_params()]


def compiled_memory(graph: Graph, *args) -> CompiledMemory:
    """XLA's memory figures for the compiled donated training step of `graph` on `args`."""
    validate(graph, "jg.compiled_memory")
    step, split = donated_step(graph)
    compiled = step.lower(*split(*args)).compile()
    stats = compiled.memory_analysis()
    return CompiledMemory(
        temp_bytes=int(stats.temp_size_in_bytes),
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        dots=compiled.as_text().count(" dot("),
    )
