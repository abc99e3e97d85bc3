"""XLA's own figures for the compiled donated training step of a graph.

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

from jgraph.check import validate
from jgraph.interpreter import flatten_args
from jgraph.ir import Graph
from jgraph.lower import Lowering
from jgraph.memory.step import sgd_plan

# A measurement needs XLA's buffer assignment, not fast code: the backend's code generation at
# its lowest optimization level compiles in about 0.6x the time, the HLO passes and buffers
# unchanged (`tests/test_planner.py::test_the_measured_temp_is_the_default_compiles`).
MEASURE_OPTIONS = {"xla_backend_optimization_level": 0}


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
    is_state, sgd, grad_params = sgd_plan(graph)
    grads = [k for k, r in enumerate(graph.output_roles) if r == "grad"]
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


def compiled_memory(graph: Graph, *args) -> CompiledMemory:
    """XLA's memory figures for the compiled donated training step of `graph` on `args`."""
    validate(graph, "jg.compiled_memory")
    step, split = donated_step(graph)
    compiled = step.lower(*split(*args)).compile(compiler_options=MEASURE_OPTIONS)
    stats = compiled.memory_analysis()
    return CompiledMemory(
        temp_bytes=int(stats.temp_size_in_bytes),
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        dots=compiled.as_text().count(" dot("),
    )
