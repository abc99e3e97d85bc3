"""XLA's own figures for the compiled donated training step of a graph.

`compiled_memory(graph, *args)` compiles the *donated training step* of the graph and returns
XLA's `memory_analysis()` figures. The step takes the graph's state inputs (params, accumulators,
optimizer state, counters) as one donated argument and the rest (data, labels, loss seed) as
another. If the graph updates its params itself (it has `new_param` outputs) the step is the graph;
otherwise the grads feed a plain SGD update `p - 0.001 * g` of the params, and the step returns the
updated state with the graph's other outputs. Donation matters: without it XLA:CPU places
activations in the not yet written gradient outputs, and `temp_size_in_bytes` misleads.

`target=` (`jgraph.target`) names the chip it is compiled for: a local device, a topology's device
for ahead-of-time work (a TPU's compiler runs on any host), a Sharding or a Mesh (per-device
figures). Only avals are needed: the arguments may be `jax.ShapeDtypeStruct`s, or left out.
`peak_bytes` is the figure a budget bounds there (`Target.figure`), made comparable across
platforms: on TPU and GPU XLA's own peak, on CPU arguments + outputs - aliased + temp (XLA:CPU's
peak counts its arguments alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jgraph.check import validate
from jgraph.interpreter import flatten_args
from jgraph.ir import Graph
from jgraph.lower import Lowering
from jgraph.memory.step import STATE_ROLES, sgd_plan
from jgraph.target import Target, resolve


@dataclass(frozen=True)
class CompiledMemory:
    temp_bytes: int  # XLA temp_size_in_bytes: buffers that are neither arguments nor outputs
    argument_bytes: int  # argument_size_in_bytes
    output_bytes: int  # output_size_in_bytes
    alias_bytes: int  # alias_size_in_bytes: outputs written into donated arguments
    dots: int  # `dot(` instructions in the compiled HLO (recomputed matmuls show up here)
    peak_bytes: int = 0  # the device memory the step holds at its peak, arguments included
    platform: str = "cpu"  # where it was compiled for
    figure: str = "temp_size_in_bytes"  # the figure a budget bounds there (`budget_bytes`)

    @property
    def budget_bytes(self) -> int:
        """The figure a budget bounds on this platform (`jgraph.target`): temp on CPU, the peak
        elsewhere."""
        return self.temp_bytes if self.figure == "temp_size_in_bytes" else self.peak_bytes

    def __str__(self):
        mib = 2**20
        return (f"peak {self.peak_bytes / mib:.2f} MiB, temp {self.temp_bytes / mib:.2f} MiB, "
                f"arguments {self.argument_bytes / mib:.2f} MiB, outputs "
                f"{self.output_bytes / mib:.2f} MiB, aliased {self.alias_bytes / mib:.2f} MiB, "
                f"{self.dots} dots ({self.platform})")


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


def compiled_memory(graph: Graph, *args, target=None) -> CompiledMemory:
    """XLA's memory figures for the compiled donated training step of `graph`, compiled for
    `target` (module docstring) on the avals of `args` (arrays or `jax.ShapeDtypeStruct`s; none:
    the graph's own input avals)."""
    validate(graph, "jg.compiled_memory")
    if args:
        flatten_args(graph, args)  # the arguments must match the traced signature
    return read_figures(lowered_step(graph, resolve(target)))


def lowered_step(graph: Graph, target: Target):
    """The donated training step of `graph` lowered for `target` from its input avals."""
    step, _ = donated_step(graph)
    state = [r in STATE_ROLES for r in graph.input_roles]
    structs = target.structs([v.aval for v in graph.inputs], state, _input_names(graph))
    return target, step.lower([s for s, k in zip(structs, state, strict=True) if k],
                              [s for s, k in zip(structs, state, strict=True) if not k])


def read_figures(lowered) -> CompiledMemory:
    """Compile a `lowered_step` and read its memory figures."""
    target, lowered = lowered
    compiled = lowered.compile(compiler_options=target.compile_options)
    stats = compiled.memory_analysis()
    temp, arguments = int(stats.temp_size_in_bytes), int(stats.argument_size_in_bytes)
    outputs, aliased = int(stats.output_size_in_bytes), int(stats.alias_size_in_bytes)
    peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    if target.platform == "cpu" or peak == 0:  # XLA:CPU's peak counts the arguments alone
        peak = arguments + outputs - aliased + temp
    return CompiledMemory(temp_bytes=temp, argument_bytes=arguments, output_bytes=outputs,
                          alias_bytes=aliased, dots=_dots(compiled.as_text(), target),
                          peak_bytes=peak, platform=target.platform, figure=target.figure)


def _dots(hlo: str, target: Target) -> int:
    """Matrix products in compiled HLO: `dot(`, and on TPU the `convolution(` it makes of them."""
    return hlo.count(" dot(") + (hlo.count(" convolution(") if target.platform == "tpu" else 0)


def _input_names(graph: Graph) -> list[str]:
    return [f"input {k} ({role})" for k, role in enumerate(graph.input_roles)]
