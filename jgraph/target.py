"""Targets: the chip a graph is compiled for, measured on and planned for.

`target=` takes, wherever jgraph compiles, measures or plans a graph:
- None: the default backend's first device, what `jax.jit` uses;
- a `jax.Device`: a local device to run on, or a device of a topology for ahead-of-time work
  (`jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
  .devices[0]`: a TPU's compiler runs on any host, and nothing runs on the chip);
- a `Sharding` (a `SingleDeviceSharding`, a `NamedSharding`): the devices it places on, and a
  `NamedSharding`'s mesh as a `Mesh` below;
- a `jax.sharding.Mesh`: every device of it. The step's data is split along the mesh's data axis
  (the first axis, or one named "data"), its state replicated, and the figures are per device, as
  XLA's SPMD partitioner compiles the step (its collectives included);
- a platform name, "cpu", "gpu" or "tpu": that platform's first local device.

Measuring needs only avals: `structs(avals, state)` gives `jax.ShapeDtypeStruct`s placed on the
target, so a step is compiled for a TPU pod from a CPU-only host.

The budget's figure (`Target.figure`). A budget bounds the figure that decides whether the
compiled donated step fits on the device, which is not the same figure on every platform:
- TPU: bytes of HBM (`hbm_bytes`). The step fits a chip of HBM size N iff its compiler, at
  `xla_tpu_max_hbm_size_mib=N`, finds room for the arguments (donated ones in full), the HLO
  buffers it places in HBM and the program's code; aliased outputs cost nothing more. The figure
  is the smallest such N, found by compiling at HBM sizes (`jgraph.memory.hbm`), or the HBM one
  compile at the chip's size uses (a safe estimate, up to about 25 % over: code and schedule
  shrink when HBM is tight). A plan is measured with the compiler's own rematerialization off,
  so it is credited with its own saving alone. No `memory_analysis()` field is it:
  `temp_size_in_bytes` counts the HBM temp's fragmentation twice and can read 0 for a step with
  megabytes of HBM temp; `peak_memory_in_bytes` counts the compiler's VMEM reservation (an
  8-layer MLP needing 98 MiB of HBM without remat and 55 with a checkpoint per layer reads 160
  both ways) and leaves out fragmentation and code.
- GPU: XLA's `peak_memory_in_bytes`, the device memory the step holds at its peak, arguments
  and outputs included.
- CPU: `temp_size_in_bytes`, what the step allocates beside its arguments and outputs: XLA:CPU's
  `peak_memory_in_bytes` counts the arguments alone, and the arguments and outputs are the same
  bytes for every plan of a graph, so the temp is the part a plan changes (`CompiledMemory
  .peak_bytes` adds them up on CPU: arguments + outputs - aliased + temp).

Compile options are per platform (`compile_options`): a measurement on CPU compiles at its
lowest code-generation level (the same buffers in about 0.6x the time); on TPU with the
compiler's rematerialization off; GPU gets none.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jgraph.errors import JGraphError

PLATFORMS = ("cpu", "gpu", "tpu")
STATE_ROLES = ("param", "accumulator", "opt_state", "counter")  # a step's donated arguments
# The figure a budget bounds (module docstring); else peak_memory_in_bytes.
FIGURES = {"cpu": "temp_size_in_bytes", "tpu": "hbm_bytes"}
# A measurement needs XLA's buffer assignment, not fast code: the backend's code generation at
# its lowest optimization level compiles in about 0.6x the time, the HLO passes and buffers
# unchanged (`tests/test_planner.py::test_the_measured_temp_is_the_default_compiles`).
MEASURE_OPTIONS = {
    "cpu": {"xla_backend_optimization_level": 0},
    # the compiler's own rematerialization off, and nothing else: scheduling options seen to
    # leave the figures alone at the chip's size are not known to under a tight HBM size
    "tpu": {"xla_tpu_rematerialization_min_size_in_bytes": 2**40},
}


class TargetError(JGraphError, ValueError):
    """A `target=` that names no device jgraph can compile for."""


@dataclass(frozen=True)
class Target:
    """The devices a step is compiled for, and how its arguments are placed on them."""

    platform: str  # "cpu", "gpu" or "tpu"
    devices: tuple  # the devices the step runs on (one, or a mesh's)
    mesh: Mesh | None = None  # a mesh's target: data split along `data_axis`, state replicated
    data_axis: str | None = None  # the mesh axis the batch is split along

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind

    @property
    def figure(self) -> str:
        """The name of XLA's figure a budget bounds on this platform (module docstring)."""
        return FIGURES.get(self.platform, "peak_memory_in_bytes")

    @property
    def word(self) -> str:
        """The figure in a message: "temp", "HBM" or "peak"."""
        return {"temp_size_in_bytes": "temp", "hbm_bytes": "HBM"}.get(self.figure, "peak")

    @property
    def compile_options(self) -> dict:
        return MEASURE_OPTIONS.get(self.platform, {})

    @property
    def key(self) -> tuple:
        """What a measurement depends on: a cache key (a topology's devices and a local one of
        the same kind compile alike)."""
        shape = None if self.mesh is None else tuple(self.mesh.shape.items())
        return (self.platform, self.device_kind, len(self.devices), shape, self.data_axis)

    def describe(self) -> str:
        where = f"{self.device_kind} ({self.platform})"
        if self.mesh is not None:
            axes = ", ".join(f"{k}={n}" for k, n in self.mesh.shape.items())
            where += f", a mesh of {len(self.devices)} devices ({axes}; data along "\
                     f"{self.data_axis!r}), per device"
        return where

    def sharding(self, aval, state: bool, name: str = "an input"):
        """Where an argument of the step lives: state (params, optimizer state, accumulators)
        replicated, data split along the mesh's data axis (its first dimension)."""
        if self.mesh is None:
            return SingleDeviceSharding(self.devices[0])
        if state or not aval.shape:
            return NamedSharding(self.mesh, PartitionSpec())
        size = self.mesh.shape[self.data_axis]
        if aval.shape[0] % size:
            raise TargetError(
                f"target={self.describe()}: {name} has a leading (batch) dimension of "
                f"{aval.shape[0]}, which the mesh's data axis {self.data_axis!r} of {size} "
                "devices does not divide")
        return NamedSharding(self.mesh, PartitionSpec(self.data_axis))

    def structs(self, avals, state, names=None) -> list:
        """`jax.ShapeDtypeStruct`s of `avals` placed on the target (`state[k]`: the k-th is
        state, replicated on a mesh)."""
        names = names or [f"input {k}" for k in range(len(avals))]
        return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.sharding(a, s, n))
                for a, s, n in zip(avals, state, names, strict=True)]


def resolve(target=None) -> Target:
    """The `Target` that `target=` names (module docstring); a clear error for anything else."""
    if isinstance(target, Target):
        return target
    if target is None:
        return _of_device(jax.devices()[0])
    if isinstance(target, str):
        name = target.lower()
        if name not in PLATFORMS:
            raise TargetError(f"target={target!r}: a platform name is one of {PLATFORMS} (or "
                              "give a jax.Device, a Sharding or a Mesh)")
        try:
            devices = jax.devices(name)
        except RuntimeError:
            devices = []
        if not devices:
            raise TargetError(
                f"target={target!r}: this host has no {name.upper()} device. To compile for one "
                "ahead of time, give a device of a topology: jax.experimental.topologies."
                f'get_topology_desc(platform="{name}", topology_name="v5e:2x2").devices[0] '
                "(a TPU's compiler comes with `pip install 'jgraph[tpu]'`)")
        return _of_device(devices[0])
    if isinstance(target, Mesh):
        return _of_mesh(target)
    if isinstance(target, NamedSharding):
        return _of_mesh(target.mesh)
    if isinstance(target, Sharding):
        devices = sorted(target.device_set, key=lambda d: d.id)
        if len(devices) != 1:
            raise TargetError(f"target={target!r}: a sharding over several devices is given as "
                              "a NamedSharding or its Mesh (the batch is split along its axis)")
        return _of_device(devices[0])
    if hasattr(target, "platform") and hasattr(target, "device_kind"):
        return _of_device(target)
    raise TargetError(f"target={target!r:.80}: give a jax.Device (a local one, or a topology's "
                      "device for ahead-of-time work), a Sharding, a Mesh, or a platform name "
                      f"{PLATFORMS}")


def _of_device(device) -> Target:
    return Target(_platform(device), (device,))


def _of_mesh(mesh) -> Target:
    if not mesh.shape:
        raise TargetError("target=: the mesh has no axes")
    names = list(mesh.shape)
    axis = "data" if "data" in names else names[0]
    devices = tuple(mesh.devices.flat)
    return Target(_platform(devices[0]), devices, mesh, axis)


def _platform(device) -> str:
    platform = device.platform.lower()
    return "gpu" if platform in ("cuda", "rocm") else platform


# -- the target being measured on ------------------------------------------------------------------
_CURRENT: contextvars.ContextVar[Target | None] = contextvars.ContextVar("jgraph_target",
                                                                        default=None)


def current() -> Target:
    """The target measurements are made on: the one `measuring_on` set, else the default."""
    return _CURRENT.get() or resolve(None)


@contextlib.contextmanager
def measuring_on(target):
    """Measurements inside (the planner's compiles) are made on `target` (None: the one already
    in force, the default backend's device outside any)."""
    if target is None:
        yield current()
        return
    token = _CURRENT.set(resolve(target))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)
