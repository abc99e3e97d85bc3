"""`MeshPlan`: where the state and the batches of a training run live on a `jax.sharding.Mesh`.

Data parallelism and FSDP-style sharding with JAX's own machinery: arrays are global `jax.Array`s
with `NamedSharding`s of the mesh, the executables are `jax.jit`s with `in_shardings` and
`out_shardings`, and XLA's SPMD partitioner inserts every collective. Nothing here communicates
by itself; the same code runs in one process or in many under `jax.distributed.initialize()`.

Placement (what lives where):
- a batch: every leaf of the inputs and labels has the leading batch axis, split along
  `data_axis`; a batch whose size the axis does not divide is an `ArgumentError`;
- params: replicated, or as `param_sharding` says: a pytree of `PartitionSpec`s (None:
  replicated) shaped like the params, or a callable `leaf -> PartitionSpec` (FSDP style);
- optimizer state: each leaf that mirrors a param (Adam's moments) as that param, others
  replicated (`optax.tree_map_params`);
- per-device accumulators (period > 1): one partial sum per data shard, stacked on a leading
  axis of the data axis's size and split along it; their sum is the accumulated gradient.

Host values are placed with `jax.make_array_from_callback`: every process passes the same full
value and each places only its own shards (no cross-process check, no transfer between hosts).
`host` brings a global array back whole, gathering across processes when it must.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jgraph.ir import Graph
from jgraph.training.arguments import ArgumentError
from jgraph.training.leaves import is_key

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many cross-device collectives of each kind a compiled HLO module holds (an async pair
    `-start`/`-done` counts once)."""
    return {name: len(re.findall(rf"\s{name}(?:-start)?\(", hlo_text)) for name in COLLECTIVES}


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec) or x is None


def _axes(entry) -> tuple:
    """The mesh axes one entry of a PartitionSpec names."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _without(spec: PartitionSpec, axis) -> list:
    """`spec`'s entries with `axis` removed (what a per-device value keeps)."""
    out = []
    for entry in spec:
        kept = tuple(a for a in _axes(entry) if a != axis)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class MeshPlan:
    """A mesh, the axis the batch is split along, and how params are sharded."""

    mesh: Mesh  # the devices (all processes' devices in a multi-process run)
    data_axis: str  # the mesh axis the batch is split along
    param_sharding: object = None  # None, a pytree of PartitionSpecs, or a callable leaf -> spec

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise ArgumentError(f"mesh must be a jax.sharding.Mesh, got "
                                f"{type(self.mesh).__name__}")
        if self.data_axis not in self.mesh.axis_names:
            raise ArgumentError(f"data_axis {self.data_axis!r} is not an axis of the mesh "
                                f"(axes {list(self.mesh.axis_names)})")
        explicit = [name for name, kind in zip(self.mesh.axis_names,
                                               getattr(self.mesh, "axis_types", ()) or (),
                                               strict=False)
                    if str(kind).endswith("Explicit")]
        if explicit:
            raise ArgumentError(f"mesh axes {explicit} are Explicit; jgraph shards with the SPMD "
                                f"partitioner: make the mesh with axis_types=(AxisType.Auto, ...) "
                                f"(or jax.sharding.Mesh(devices, names))")

    @property
    def size(self) -> int:
        """Devices along the data axis: the number of data shards."""
        return int(self.mesh.shape[self.data_axis])

    def sharding(self, *spec) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    @property
    def replicated(self) -> NamedSharding:
        return self.sharding()

    @property
    def batched(self) -> NamedSharding:
        """A batch leaf: its leading axis split along the data axis."""
        return self.sharding(self.data_axis)

    # -- batches ----------------------------------------------------------------------------------
    def batch_size(self, tree, what: str) -> int:
        """The common leading size of `tree`'s leaves, which the data axis must divide."""
        sizes = {int(np.shape(a)[0]) if np.ndim(a) else None for a in jax.tree.leaves(tree)}
        if None in sizes or len(sizes) != 1:
            raise ArgumentError(f"{what}: under a mesh every leaf needs the same leading batch "
                                f"axis, got leading sizes {sorted(map(str, sizes))}")
        (size,) = sizes
        if size % self.size:
            raise ArgumentError(f"{what}: batch of {size} is not divisible by the {self.size} "
                                f"devices of mesh axis {self.data_axis!r}")
        return size

    def put_batch(self, tree, what: str = "batch"):
        """The batch as global arrays split along the data axis (arrays already so: as they are)."""
        if tree is None:
            return None
        self.batch_size(tree, what)
        return jax.tree.map(lambda a: self.put(a, self.batched, copy=False), tree)

    def split(self, tree):
        """Inside a jitted step: each leaf `(B, ...)` as `(shards, B / shards, ...)`, split along
        the data axis, so that each device holds its own shard on the leading axis."""
        def one(a):
            a = a.reshape((self.size, a.shape[0] // self.size) + a.shape[1:])
            return jax.lax.with_sharding_constraint(a, self.batched)
        return jax.tree.map(one, tree)

    # -- params, optimizer state, accumulators -----------------------------------------------------
    def param_shardings(self, params):
        """A NamedSharding per param leaf (`params`: arrays or ShapeDtypeStructs; None leaves,
        the PRNG keys put aside, stay None)."""
        rule = self.param_sharding
        if rule is None:
            return jax.tree.map(lambda _: self.replicated, params)
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        if callable(rule):
            specs = [rule(jax.ShapeDtypeStruct(np.shape(a), a.dtype)) for _, a in flat]
        else:
            spec_leaves, spec_tree = jax.tree.flatten(rule, is_leaf=_is_spec)
            if spec_tree != jax.tree.structure(jax.tree.map(lambda _: 0, params)):
                raise ArgumentError(f"param_sharding must be shaped like the params "
                                    f"({treedef}), got {spec_tree}")
            specs = spec_leaves
        out = [self._param_sharding(jax.tree_util.keystr(path), a, spec)
               for (path, a), spec in zip(flat, specs, strict=True)]
        return jax.tree.unflatten(treedef, out)

    def _param_sharding(self, name: str, leaf, spec) -> NamedSharding:
        if spec is None:
            return self.replicated
        if not isinstance(spec, PartitionSpec):
            raise ArgumentError(f"param_sharding for params{name}: expected a PartitionSpec "
                                f"or None, got {spec!r:.60}")
        shape = np.shape(leaf)
        if len(spec) > len(shape):
            raise ArgumentError(f"param_sharding for params{name}: {spec} has more entries "
                                f"than the param's {len(shape)} axes {list(shape)}")
        for dim, entry in zip(shape, spec, strict=False):
            for axis in _axes(entry):
                if axis not in self.mesh.axis_names:
                    raise ArgumentError(f"param_sharding for params{name}: {spec} names "
                                        f"{axis!r}, not an axis of the mesh "
                                        f"{list(self.mesh.axis_names)}")
            ways = math.prod(self.mesh.shape[a] for a in _axes(entry))
            if dim % ways:
                raise ArgumentError(f"param_sharding for params{name}: axis of size {dim} is "
                                    f"not divisible by the {ways} devices of {entry!r} ({spec})")
        return NamedSharding(self.mesh, spec)

    def opt_state_shardings(self, tx, opt_state, param_shardings):
        """The optimizer state's leaves that mirror params sharded as those params; the rest
        (step counts, scalars) replicated."""
        return optax.tree_map_params(
            tx, lambda _, s: s, opt_state, param_shardings,
            transform_non_params=lambda _: self.replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding))

    def local_shardings(self, param_shardings):
        """Per-device accumulators `(shards, *param.shape)`: split along the data axis on the
        leading axis; the param's other mesh axes kept on its own axes."""
        return jax.tree.map(
            lambda s: self.sharding(self.data_axis, *_without(s.spec, self.data_axis)),
            param_shardings)

    def spread(self, logical):
        """Host accumulators (shaped like params) as per-device ones whose sum they are: all in
        the first shard, zeros elsewhere (exact: adding zeros changes no bit)."""
        def one(a):
            out = np.zeros((self.size,) + np.shape(a), np.asarray(a).dtype)
            out[0] = a
            return out
        return jax.tree.map(one, logical)

    # -- moving values -----------------------------------------------------------------------------
    def put(self, x, sharding: NamedSharding, copy: bool = True):
        """`x` as a global array with `sharding`: fresh buffers when `copy` (donating them never
        deletes the caller's arrays), `x` itself if it is already so placed and not `copy`."""
        if isinstance(x, jax.Array):
            if not copy and x.sharding.is_equivalent_to(sharding, x.ndim):
                return x
            if not x.is_fully_addressable:  # a global array of another layout: reshard
                return jax.device_put(x, sharding, may_alias=False)
        if is_key(x):
            data = self.put(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def put_tree(self, tree, shardings, copy: bool = True):
        return jax.tree.map(lambda a, s: self.put(a, s, copy), tree, shardings)


def host(x):
    """A global array (or anything array-like) as one NumPy array on this host."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return x if is_key(x) else np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _drop_axis(sharding, axis):
    if not isinstance(sharding, NamedSharding):
        return sharding
    return NamedSharding(sharding.mesh, PartitionSpec(*_without(sharding.spec, axis)),
                         memory_kind=sharding.memory_kind)


def without_data_axis(graph: Graph, axis) -> Graph:
    """`graph` with `axis` removed from its sharding constraints, for the per-device program (in
    which the data axis is the mapped axis, added back by `vmap(spmd_axis_name=axis)`)."""
    def sub(v):  # a loop body, or a cond's branches
        if isinstance(v, Graph):
            return without_data_axis(v, axis)
        if isinstance(v, tuple) and v and all(isinstance(b, Graph) for b in v):
            new = tuple(without_data_axis(b, axis) for b in v)
            return v if all(a is b for a, b in zip(new, v, strict=True)) else new
        return v

    eqns = []
    for eqn in graph.eqns:
        params = {k: sub(v) for k, v in eqn.params.items()}
        if eqn.op == "sharding_constraint":
            params["sharding"] = _drop_axis(params["sharding"], axis)
        changed = any(params[k] is not eqn.params[k] for k in params)
        eqns.append(dataclasses.replace(eqn, params=params) if changed else eqn)
    if all(a is b for a, b in zip(eqns, graph.eqns, strict=True)):
        return graph
    return graph.replace(eqns=tuple(eqns))


def combine(values):
    """Per-shard step outputs (stacked on a leading shard axis) as one micro-batch's: scalars
    (the scaled loss, the count of correct predictions) summed, per-datapoint values (the
    predictions) concatenated in batch order."""
    def one(a):
        if a.ndim == 1:
            return jnp.sum(a, 0, dtype=a.dtype)
        return a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:])
    return jax.tree.map(one, values)
