"""The remat engine: rematerialize checkpoint regions in a joint forward + backward graph.

Input: a graph from `jgraph.backward` (forward eqns are those without the `backward` tag) whose
forward eqns carry the checkpoint regions recorded while tracing (`jax.checkpoint`,
`jgraph.checkpoint`), outermost first. Output: the same graph in which the backward reads, instead
of a region's inner values, copies recomputed from what the region keeps (DESIGN §4.2).

A value v produced inside region r *crosses* r (survives its end) iff v is read outside r (by a
forward eqn or as a graph output), or r's policy saves v's producing eqn, or that op must not be
run twice (stateful RNG), or v is a small constant computed from literals alone
(`small_constants`: computed once, never recomputed). Region inputs and params are defined outside
the region, so they are always at hand. Regions nest as in JAX: the *home* of v is the deepest
region on its path that v does not cross. Values with no home are kept from the forward. A value
whose home is region R is recomputed once, in R's recompute, from the values kept at R's level,
which may themselves be recomputed copies of an enclosing region's recompute; while R is
recomputed, a region nested in R again keeps only what crosses it, so recursive checkpointing
gives logarithmic memory.

Policies. A region's policy is asked about every forward eqn inside it, inner regions included;
with `policy=`, one more region holds the whole forward. (JAX asks an outer policy about an inner
`remat` as a whole, not about its eqns; for everything/nothing-saveable the two agree.) A policy
sees through loops: a region's policy that saves something inside a `scan` or `cond` was applied
inside its bodies when `jgraph.backward` linearized it
(`jgraph.backward.pushed_policies`), and the loop left the region; a region whose policy
saves nothing inside recomputes the loop whole, and the copy computes only the outputs the
backward reads.

Recompute is demand driven: a copy is emitted just before the first eqn that reads it, so nothing
is recomputed that no backward eqn reads. Copies are tagged `recompute` (and `no_cse` when the
region asks for CSE prevention, as `jax.checkpoint` does by default; `jgraph.lower` then protects
them from XLA's CSE). Random values are replayed: a copy of `random_bits` reads the same key.
The public `jg.remat` (`jgraph.remat`) drives this engine with the graph's own regions, a policy
or a planner's regions (`jgraph.planner`); the planner and the scan VJP (`jgraph.vjp_rules.loops`)
drive it too.
"""

from __future__ import annotations

import dataclasses
import weakref

import jax.numpy as jnp

from jgraph import ops, policies
from jgraph.errors import TransformError
from jgraph.ir import Eqn, Graph, Literal, Region, Var
from jgraph.opkinds import kind, nbytes
from jgraph.passes import dce

# Ops with bodies: a policy over the whole forward applies inside them, not to them.
LOOPS = frozenset({"scan", "cond"})
# Ops whose outputs are never recomputed: running them again would not give the same values.
NEVER_RECOMPUTED = frozenset({"rng_uniform"})
# A value computed from literals alone is kept (computed once) up to this size at least.
SMALL_CONSTANT_BYTES = 64


def is_forward(eqn: Eqn) -> bool:
    return not ({"backward", "recompute"} & eqn.tags)


def apply_regions(graph: Graph, policy=None, body_outputs: int = 0) -> Graph:
    """Rematerialize the graph's regions, and with `policy` the whole forward (loops and conds
    are kept whole: their policy was applied inside them when their backward was built).

    For a loop body's joint graph, its first `body_outputs` outputs (the body's own: the next
    carry, a y slice) do not count as read outside a region: the loop keeps them anyway (as the
    next iteration's carry, or stacked as ys), so they are recomputed, not saved twice."""
    if policy is not None:
        graph = with_whole_forward_region(graph, policy)
    if not graph.regions:
        return graph
    planner = _Planner(graph, body_outputs)
    eqns = []
    for eqn in graph.eqns:
        if not is_forward(eqn):
            inputs = tuple(planner.read_back(a, eqns, eqn) for a in eqn.inputs)
            if any(x is not a for x, a in zip(inputs, eqn.inputs, strict=True)):
                eqn = dataclasses.replace(eqn, inputs=inputs)
        eqns.append(eqn)
    counts = {r.id: 0 for r in graph.regions}
    for region_id in planner.emitted.values():
        counts[region_id] += 1
    info = dict(graph.info, remat={"recomputed_eqns": counts, "policy": _policy_label(policy)})
    graph = _pin_narrow_residuals(graph.replace(eqns=tuple(eqns), info=info), planner)
    return prune_recomputed_loops(dce(graph))


def _pin_narrow_residuals(graph: Graph, planner: _Planner) -> Graph:
    """Round each float narrower than f32 that a region keeps for the backward and that its own
    forward reads too, to its type (`reduce_precision`) right after its producer; every reader
    reads the rounded value. XLA may compute such a value in f32 and skip the rounding where a
    reader fuses with its producer (a widening convert is folded away): the forward would see
    more precision than the kept buffer gives the backward. JAX's remat pins every residual so
    (jax-ml/jax#22244); f32 and wider are computed as stored, so they need no pin and cost none."""
    def narrow(v):  # and not pinned yet (a graph rematerialized again)
        return (jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.dtype.itemsize < 4
                and planner.producer[v].op != "reduce_precision")

    def region_of(v):  # the outermost region of v's producer, or None
        return (planner.producer[v].regions or (None,))[0] if v in planner.producer else None

    read_back = {a for e in graph.eqns if not is_forward(e) for a in e.inputs
                 if isinstance(a, Var)}
    read_inside = {a for e in graph.eqns if is_forward(e) for a in e.inputs
                   if isinstance(a, Var) and region_of(a) in e.regions}
    pins = {v: Var(v.aval) for v in read_back & read_inside if narrow(v)}
    if not pins:
        return graph

    def pinned(atoms):
        return tuple(pins.get(a, a) if isinstance(a, Var) else a for a in atoms)

    eqns = []
    for eqn in graph.eqns:
        if any(isinstance(a, Var) and a in pins for a in eqn.inputs):
            eqn = dataclasses.replace(eqn, inputs=pinned(eqn.inputs))
        eqns.append(eqn)
        for v in eqn.outputs:
            if v in pins:
                finfo = jnp.finfo(v.aval.dtype)
                eqns.append(Eqn("reduce_precision", (v,), {"exponent_bits": finfo.nexp,
                                                           "mantissa_bits": finfo.nmant},
                                (pins[v],), eqn.tags, eqn.regions, eqn.source))
    return graph.replace(eqns=tuple(eqns), outputs=pinned(graph.outputs))


def prune_recomputed_loops(graph: Graph) -> Graph:
    """Recomputed conds and scans compute only the outputs something reads: a cond's unread
    outputs and a scan's unread ys leave their bodies (the forward's outputs are not needed
    again, only the residuals the backward reads)."""
    read = {a for e in graph.eqns for a in e.inputs if isinstance(a, Var)}
    read.update(a for a in graph.outputs if isinstance(a, Var))
    eqns = []
    for eqn in graph.eqns:
        if "recompute" in eqn.tags and eqn.op in LOOPS:
            first = eqn.params["num_carry"] if eqn.op == "scan" else 0
            keep = [k for k, v in enumerate(eqn.outputs) if k < first or v in read]
            if len(keep) < len(eqn.outputs):
                eqn = _with_outputs(eqn, keep)
        eqns.append(eqn)
    return graph.replace(eqns=tuple(eqns))


def _with_outputs(eqn: Eqn, keep: list[int]) -> Eqn:
    def pruned(body: Graph) -> Graph:
        return dce(body.replace(outputs=tuple(body.outputs[k] for k in keep),
                                output_roles=tuple(body.output_roles[k] for k in keep)))

    if eqn.op == "scan":
        params = {**eqn.params, "body": pruned(eqn.params["body"])}
    else:
        params = {**eqn.params, "branches": tuple(pruned(b) for b in eqn.params["branches"])}
    return dataclasses.replace(eqn, params=params, outputs=tuple(eqn.outputs[k] for k in keep))


def _policy_label(policy):
    return None if policy is None else policies.policy_name(policy)


def with_whole_forward_region(graph: Graph, policy, loops: bool = False) -> Graph:
    """The graph with one more outermost region, with `policy`, holding every forward eqn but
    the loops and conds (the policy was applied inside their bodies when their backward was
    built); with `loops`, also each of them whose bodies the policy saves nothing of, which the
    region then recomputes whole, as a checkpoint region saving nothing inside does
    (`jgraph.backward.pushed_policies`): a loop body's policy, the body holding loops of its
    own (a scanned layer's attention in blocks), so that the layer's backward recomputes what
    they stack instead of the outer loop stacking it for every layer."""
    whole = max((r.id for r in graph.regions), default=-1) + 1
    regions = (Region(whole, None, policy, True, "remat(policy=...)"),) + tuple(
        dataclasses.replace(r, parent=whole) if r.parent is None else r for r in graph.regions)

    def inside(e: Eqn) -> bool:
        return is_forward(e) and (e.op not in LOOPS
                                  or (loops and not policies.saves_inside(policy, e)))

    eqns = tuple(dataclasses.replace(e, regions=(whole,) + e.regions) if inside(e) else e
                 for e in graph.eqns)
    return graph.replace(eqns=eqns, regions=regions)


def small_constants(forward) -> set[Eqn]:
    """Eqns computing from literals alone a value no larger than those literals (`sin(2.0)`, a
    table derived from a closed-over table): computed once and kept. A constant that grows its
    literals (a broadcast fill, an iota, or math on them) is cheaper to regenerate than to keep."""
    source: dict[Var, int] = {}  # constant var -> bytes of the largest literal it comes from
    small = set()
    for eqn in forward:
        if eqn.op in NEVER_RECOMPUTED or not all(isinstance(a, Literal) or a in source
                                                 for a in eqn.inputs):
            continue
        size = max([nbytes(a.aval) if isinstance(a, Literal) else source[a] for a in eqn.inputs],
                   default=0)
        source.update((v, size) for v in eqn.outputs)
        if sum(nbytes(v.aval) for v in eqn.outputs) <= max(size, SMALL_CONSTANT_BYTES):
            small.add(eqn)
    return small


class _Planner:
    """Which region each forward value crosses, its home, and the recompute copies emitted."""

    def __init__(self, graph: Graph, body_outputs: int = 0):
        self.regions = {r.id: r for r in graph.regions}
        self.producer: dict[Var, Eqn] = {}
        forward = [e for e in graph.eqns if is_forward(e)]
        for eqn in forward:
            for r in eqn.regions:
                if r not in self.regions:
                    raise TransformError(f"eqn {eqn.op} at {eqn.source or '?'} names checkpoint "
                                         f"region {r}, which the graph does not have")
            self.producer.update((v, eqn) for v in eqn.outputs)
        read_outside: set[tuple[Var, int]] = set()  # a region output, read by the forward
        for eqn in forward:
            for a in eqn.inputs:
                if isinstance(a, Var) and a in self.producer:
                    inside = set(eqn.regions)
                    read_outside.update((a, r) for r in self.producer[a].regions
                                        if r not in inside)
        self.kept: set[tuple[Var, int]] = set()  # kept for the backward in any case
        for a in graph.outputs[body_outputs:]:
            if isinstance(a, Var) and a in self.producer:
                self.kept.update((a, r) for r in self.producer[a].regions)
        refused = self._refused_by_name(forward)
        constants = small_constants(forward)
        for eqn in forward:  # saved by the region's policy
            if eqn in constants:  # a constant of the step: computed once
                self.kept.update((v, r) for v in eqn.outputs for r in eqn.regions)
                continue
            for r in eqn.regions:
                policy = self.regions[r].policy
                if eqn.op in NEVER_RECOMPUTED or ops.has_effects(eqn) or (
                        (eqn, r) not in refused and policies.saves(policy, eqn)):
                    self.kept.update((v, r) for v in eqn.outputs)
        self.crosses = read_outside | self.kept  # what survives the region's end
        self.paths = {r: self._path(r) for r in self.regions}
        self.copies: dict[tuple[Var, int], Var] = {}
        self.emitted: dict[Eqn, int] = {}  # recompute eqn -> the region it recomputes

    def _path(self, region_id):
        path = []
        while region_id is not None:
            path.append(region_id)
            region_id = self.regions[region_id].parent
        return tuple(reversed(path))

    def _refused_by_name(self, forward) -> set[tuple[Eqn, int]]:
        """(producer, region) pairs whose value a policy excludes by name, through `name` eqns."""
        refused = set()
        for eqn in forward:
            if eqn.op != "name":
                continue
            for r in eqn.regions:
                if eqn.params.get("name") in policies.excluded_names(self.regions[r].policy):
                    source = eqn
                    while source.op == "name" and isinstance(source.inputs[0], Var) \
                            and source.inputs[0] in self.producer:
                        source = self.producer[source.inputs[0]]
                        refused.add((source, r))
        return refused

    def home(self, atom):
        """The deepest region on `atom`'s path it does not cross (None: kept from the forward)."""
        if not isinstance(atom, Var) or atom not in self.producer:
            return None
        for r in reversed(self.producer[atom].regions):
            if (atom, r) not in self.crosses:
                return r
        return None

    def phase(self, v, region_id):
        """The recompute (a region id) that provides `v` inside region `region_id`'s recompute."""
        home = self.home(v)
        if home is None:
            return None
        return home if home in self.paths[region_id][:-1] else region_id

    def read_back(self, atom, out: list, reader: Eqn | None = None) -> object:
        """`atom` as the backward eqn `reader` reads it: a recomputed copy where its home region
        recomputes it; where a region with `outputs_recomputed` produced it, a copy of that
        region's recompute, though the forward keeps it, unless the reader is a matrix product
        (JAX's remat: a region's own backward reads what it recomputes, fused into its
        elementwise VJPs; the next region's weight gradient reads its input, kept for its
        recompute anyway, which a TPU stores in the products' bfloat16)."""
        product = reader is not None and kind(reader) == "dot"
        if isinstance(atom, Var) and atom in self.producer and not product:
            for r in reversed(self.producer[atom].regions):
                if (atom, r) not in self.crosses:
                    break
                if self.regions[r].outputs_recomputed and (atom, r) not in self.kept:
                    return self.read(atom, r, out, phase=r)
        return self.read(atom, self.home(atom), out)

    def read(self, atom, region_id, out: list, phase=None) -> object:
        """`atom` as seen in `region_id`'s recompute, emitting into `out` the copies it needs
        (`phase`: the recompute it comes from, if not its own home's)."""
        if region_id is None:
            return atom
        phase = self.phase(atom, region_id) if phase is None else phase
        if phase is None:
            return atom
        todo = [(self.producer[atom], phase)]
        while todo:  # depth first over the producers still missing, without recursion
            eqn, phase = todo[-1]
            if (eqn.outputs[0], phase) in self.copies:
                todo.pop()
                continue
            missing = [(self.producer[a], p) for a in eqn.inputs
                       if (p := self.phase(a, phase)) is not None and (a, p) not in self.copies]
            if missing:
                todo.extend(missing)
                continue
            todo.pop()
            out.append(self._copy(eqn, phase))
        return self.copies[(atom, phase)]

    def _copy(self, eqn: Eqn, phase: int) -> Eqn:
        inputs = tuple(a if (p := self.phase(a, phase)) is None else self.copies[(a, p)]
                       for a in eqn.inputs)
        outputs = tuple(Var(v.aval) for v in eqn.outputs)
        self.copies.update(((v, phase), c) for v, c in zip(eqn.outputs, outputs, strict=True))
        tags = {"recompute", "no_cse"} if self.regions[phase].prevent_cse else {"recompute"}
        copy = dataclasses.replace(eqn, inputs=inputs, outputs=outputs, tags=frozenset(tags),
                                   regions=())
        self.emitted[copy] = phase
        return copy


def without_regions(graph: Graph) -> Graph:
    """`graph` with no checkpoint regions (a planner's starting point): one graph per `graph`
    (itself when it has none), so what is measured of it once (its compile, its calibration,
    its estimate, all kept per graph) is not measured again for a copy."""
    if not graph.regions and not any(e.regions for e in graph.eqns):
        return graph
    if graph not in _WITHOUT:
        eqns = tuple(dataclasses.replace(e, regions=()) if e.regions else e for e in graph.eqns)
        _WITHOUT[graph] = graph.replace(eqns=eqns, regions=())
    return _WITHOUT[graph]


_WITHOUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
