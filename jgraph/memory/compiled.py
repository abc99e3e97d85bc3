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
`budget_bytes` is the figure a budget bounds there (`Target.figure`): temp on CPU, the peak on
GPU, and on TPU the HBM the step needs (`hbm_bytes`, `jgraph.memory.hbm`): exact by default (the
smallest HBM size at which it compiles, 2-4 compiles), a safe estimate with `exact=False` (what
one compile at the chip's size uses), or, inside a planner, what a compile at the budget's size
used or needed (`hbm_mode` says which). `peak_bytes` is comparable across platforms: XLA's own
peak on TPU and GPU, arguments + outputs - aliased + temp on CPU (XLA:CPU's peak counts its
arguments alone).

Figures are cached by what they depend on: the lowered program's text, the compile options, the
target's kind, how the figure was found, and the versions of jax, jaxlib and libtpu; in the
process always, and on disk in `jgraph.config.figure_cache_dir` when it is set
(`JGRAPH_FIGURE_CACHE`), so a restarted job measures nothing twice.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import tempfile
import weakref
from dataclasses import dataclass

import jax

from jgraph import config
from jgraph.check import validate
from jgraph.interpreter import flatten_args
from jgraph.ir import Graph
from jgraph.lower import InDonationOrder, Lowering, donation_order
from jgraph.memory import fusions
from jgraph.memory.hbm import MIB, at_chip, at_size, smallest_size
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
    hbm_bytes: int = 0  # TPU: the HBM the step needs, found as `hbm_mode` says (0: elsewhere)
    hbm_mode: str = ""  # "exact", "estimate" or "at N MiB" (module docstring; "": not TPU)
    fits: bool = True  # compiled at "N MiB": whether it fit (else only `hbm_bytes` is known)
    # False: it failed at buffer assignment, so `hbm_bytes` is its buffers there without the
    # code (`jgraph.memory.model.Calibration.fit_of` adds the code as the model knows it)
    code_counted: bool = True
    # The graph's eqns (by index) whose value XLA wrote to a buffer of its own, and those it
    # computed only inside the fusions reading them (`jgraph.memory.fusions`).
    materialised: tuple[int, ...] = ()
    fused: tuple[int, ...] = ()
    written: tuple[tuple[int, int], ...] = ()  # (eqn, elements) of each array the entry writes

    @staticmethod
    def from_json(found: dict) -> CompiledMemory:
        """The figures `dataclasses.asdict` wrote as JSON (lists back to tuples)."""
        return CompiledMemory(**{k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
                                 if isinstance(v, list) else v for k, v in found.items()})

    @property
    def budget_bytes(self) -> int:
        """The figure a budget bounds on this platform (`jgraph.target`): temp on CPU, HBM on
        TPU, the peak on GPU."""
        return {"temp_size_in_bytes": self.temp_bytes,
                "hbm_bytes": self.hbm_bytes}.get(self.figure, self.peak_bytes)

    @property
    def exact(self) -> bool:
        """The budget's figure is the target's own: not an estimate from above."""
        return self.hbm_mode != "estimate"

    def __str__(self):
        mib = 2**20
        hbm = f"HBM {self.hbm_bytes / mib:.2f} MiB ({self.hbm_mode}), " if self.hbm_mode else ""
        return (f"{hbm}peak {self.peak_bytes / mib:.2f} MiB, temp {self.temp_bytes / mib:.2f} MiB, "
                f"arguments {self.argument_bytes / mib:.2f} MiB, outputs "
                f"{self.output_bytes / mib:.2f} MiB, aliased {self.alias_bytes / mib:.2f} MiB, "
                f"{self.dots} dots ({self.platform})")


def donated_step(graph: Graph, learning_rate: float = 1e-3):
    """`(step, split)`: `step(state, rest)` is the training step of the graph, jitted with
    `state` donated; `split(*args)` turns the graph's call arguments into `(state, rest)`. Each
    state's new value is written into its buffer (`jgraph.lower.donation_order`); without
    `new_param` outputs, each grad feeds an SGD update of its param, returned first."""
    is_state, sgd, grad_params = sgd_plan(graph)
    grads = [k for k, r in enumerate(graph.output_roles) if r == "grad"]
    lowering = Lowering(scoped=True)
    order = donation_order(graph, is_state)

    def step(state, rest):
        state, rest = iter(state), iter(rest)
        flat = [next(state) if s else next(rest) for s in is_state]
        outs = lowering.run(graph, *flat)
        if not sgd:
            return [outs[k] for k in order]
        new = dict(enumerate(flat))
        for k, g in zip(grad_params, [outs[i] for i in grads], strict=True):
            new[k] = flat[k] - learning_rate * g
        others = [o for i, o in enumerate(outs) if i not in grads]
        return [new[k] for k, s in enumerate(is_state) if s], others

    def split(*args):
        flat = flatten_args(graph, args)
        return ([x for x, s in zip(flat, is_state, strict=True) if s],
                [x for x, s in zip(flat, is_state, strict=True) if not s])

    jitted = jax.jit(step, donate_argnums=0)
    return (jitted if sgd else InDonationOrder(jitted, order)), split


def compiled_memory(graph: Graph, *args, target=None, exact: bool = True) -> CompiledMemory:
    """XLA's memory figures for the compiled donated training step of `graph`.

    Args:
        graph: a joint graph, a plan of one, or a training step.
        *args: arrays or `jax.ShapeDtypeStruct`s of the traced function's arguments; none: the
            graph's own input avals (nothing needs to be allocated).
        target: `jgraph.target`: the device, Sharding, Mesh or platform the step is compiled for
            (None: the default backend's device).
        exact: on TPU, find the HBM need exactly (2-4 compiles); `exact=False` estimates it from
            one compile (never under it).

    Returns:
        A `CompiledMemory`: `temp_bytes`, `peak_bytes`, `hbm_bytes` (TPU), `figure` (which one a
        budget bounds there) and `budget_bytes` (its value), and `materialised` / `fused` (which
        eqns' values XLA wrote to buffers). Figures are cached by program, options, target and
        versions (on disk in `JGRAPH_FIGURE_CACHE` when it is set)."""
    validate(graph, "jg.compiled_memory")
    if args:
        flatten_args(graph, args)  # the arguments must match the traced signature
    return read_figures(lowered_step(graph, resolve(target)), exact=exact)


def lowered_step(graph: Graph, target: Target):
    """The donated training step of `graph` lowered for `target` from its input avals; the last
    few kept (`RECENT`): a planner measures a graph, then calibrates its model on it."""
    key = (id(graph), target.key)
    if key in _LOWERED and _LOWERED[key][0]() is graph:
        _LOWERED.move_to_end(key)
        return _LOWERED[key][1]
    lowered = _lowered(graph, target)
    _LOWERED[key] = (weakref.ref(graph), lowered)
    while len(_LOWERED) > RECENT:
        _LOWERED.popitem(last=False)
    return lowered


RECENT = 4  # lowered steps kept (`lowered_step`): each holds its program's text
_LOWERED: collections.OrderedDict = collections.OrderedDict()


def _lowered(graph: Graph, target: Target):
    step, _ = donated_step(graph)
    state = [r in STATE_ROLES for r in graph.input_roles]
    structs = target.structs([v.aval for v in graph.inputs], state, _input_names(graph))
    return target, step.lower([s for s, k in zip(structs, state, strict=True) if k],
                              [s for s, k in zip(structs, state, strict=True) if not k])


def read_figures(lowered, exact: bool = True, hbm_limit: int | None = None) -> CompiledMemory:
    """Compile a `lowered_step` and read its memory figures (cached: module docstring). On TPU:
    the HBM need exactly, or estimated (`exact=False`), or, with `hbm_limit` (bytes), what a
    compile at that size (rounded down to MiB) used or needed."""
    target, lowered = lowered
    options = target.compile_options
    mode, size = "", None
    if target.figure == "hbm_bytes" and hbm_limit is not None:
        size = max(1, int(hbm_limit // MIB))
        mode = f"at {size} MiB"
    elif target.figure == "hbm_bytes":
        mode = "exact" if exact else "estimate"
    key = _cache_key(target, options, lowered, mode)
    found = _CACHE.get(key) or _from_disk(key)
    if found is None:
        found = _measured(target, lowered, options, mode, size)
        _to_disk(key, found)
    _CACHE[key] = found
    return found


def _measured(target: Target, lowered, options: dict, mode: str,
              size: int | None) -> CompiledMemory:
    hbm = 0
    if size is not None:
        got = at_size(lowered, options, size)
        if not got.fits:  # what it needed is all the failure says
            return CompiledMemory(temp_bytes=0, argument_bytes=0, output_bytes=0, alias_bytes=0,
                                  dots=0, peak_bytes=got.hbm_used, platform=target.platform,
                                  figure=target.figure, hbm_bytes=got.hbm_used, hbm_mode=mode,
                                  fits=False, code_counted=got.code_counted)
        compiled, hbm = got.compiled, min(got.hbm_used, size * MIB)  # it fit in `size`
    elif mode == "exact":
        size, first = smallest_size(lowered, options)
        compiled, hbm = first.compiled, size * MIB
    elif mode == "estimate":
        first = at_chip(lowered, options)  # the size is set in whole MiB: rounded up
        compiled, hbm = first.compiled, -(-first.hbm_used // MIB) * MIB
    else:
        compiled = lowered.compile(compiler_options=options)
    stats = compiled.memory_analysis()
    temp, arguments = int(stats.temp_size_in_bytes), int(stats.argument_size_in_bytes)
    outputs, aliased = int(stats.output_size_in_bytes), int(stats.alias_size_in_bytes)
    peak = int(getattr(stats, "peak_memory_in_bytes", 0) or 0)
    if target.platform == "cpu" or peak == 0:  # XLA:CPU's peak counts the arguments alone
        peak = arguments + outputs - aliased + temp
    hlo = compiled.as_text()
    materialised, fused, written = fusions.read(hlo)
    return CompiledMemory(temp_bytes=temp, argument_bytes=arguments, output_bytes=outputs,
                          alias_bytes=aliased, dots=_dots(hlo, target),
                          peak_bytes=peak, platform=target.platform, figure=target.figure,
                          hbm_bytes=int(hbm), hbm_mode=mode, materialised=materialised,
                          fused=fused, written=written)


# -- the figure cache ------------------------------------------------------------------------------
_CACHE: dict[str, CompiledMemory] = {}
FORMAT = 5  # of what a cached entry holds


def versions() -> tuple:
    """The jax, jaxlib and libtpu versions (None where not installed): what a cached figure or
    plan is of."""
    found = []
    for package in ("jax", "jaxlib", "libtpu"):
        try:
            found.append(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            found.append(None)
    return tuple(found)


def _cache_key(target: Target, options: dict, lowered, mode: str) -> str:
    what = repr((target.key, sorted(options.items()), mode, versions(), FORMAT))
    digest = hashlib.sha256(what.encode())
    digest.update(lowered.as_text().encode())
    return digest.hexdigest()


def _from_disk(key: str) -> CompiledMemory | None:
    if not config.figure_cache_dir:
        return None
    try:
        with open(os.path.join(config.figure_cache_dir, f"{key}.json")) as f:
            return CompiledMemory.from_json(json.load(f))
    except (OSError, ValueError, TypeError):  # absent, or written by another version: measure
        return None


def _to_disk(key: str, figures: CompiledMemory) -> None:
    if not config.figure_cache_dir:
        return
    os.makedirs(config.figure_cache_dir, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=config.figure_cache_dir, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(dataclasses.asdict(figures), f)
    os.replace(path, os.path.join(config.figure_cache_dir, f"{key}.json"))  # atomic


def _dots(hlo: str, target: Target) -> int:
    """Matrix products in compiled HLO: `dot(`, and on TPU the `convolution(` it makes of them."""
    return hlo.count(" dot(") + (hlo.count(" convolution(") if target.platform == "tpu" else 0)


def _input_names(graph: Graph) -> list[str]:
    return [f"input {k} ({role})" for k, role in enumerate(graph.input_roles)]
