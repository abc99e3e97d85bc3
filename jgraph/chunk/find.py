"""Finding the loss head's row-independent region on a forward graph (for `jg.chunk_rows`).

The loss is a sum over rows: one or more `reduce_sum`s on the gradient path reduce the leading
`k` axes (the rows) of a per-row value, and what follows them (a mean's division, other loss
terms) is linear in them, so their cotangent is known before the forward ends (`seed / N` per
row for a mean). From those row sums the region grows backwards over the schedule: an eqn joins
it when every reader of its outputs is in the region (nothing outside needs a value of a chunk)
and it maps rows (`jgraph.chunk.rows`). What the region reads from outside is either a row input
(its leading axes are the rows: chunked) or a constant (parameters and any value without the row
axes: read whole by every chunk).

A region is worth chunking when one of its eqns makes a row larger than the rows it reads (the
projection to the vocabulary, a one-hot): then the values no chunk-sized loop would avoid are
only what the region reads. Otherwise the graph is left alone and the reason says where the
region stopped.

A batch of one keeps its rows `(1, T)` everywhere but in `jnp.take_along_axis`'s gather, which
makes the size-1 axis an offset axis and drops it from the indices: `batched_gathers` first puts
such gathers in the batched form JAX gives a larger batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from jgraph.backward import reverse_pass
from jgraph.builder import Builder
from jgraph.chunk.rows import NotRowwise, row_params
from jgraph.ir import Eqn, Graph, Var
from jgraph.naming import format_eqn
from jgraph.ops import has_effects

ROW_ROLES = ("data", "label")  # graph inputs that may carry rows (a param never does)


@dataclass
class Head:
    """A region over rows ending in row sums, with the cotangents of those sums."""

    k: int  # number of leading row axes
    rows: tuple[int, ...]  # their sizes
    eqns: list[Eqn]  # the region's forward eqns, in schedule order (the row sums included)
    sums: list[Eqn]  # the reduce_sums over the rows
    flags: dict = field(default_factory=dict)  # eqn -> which of its inputs carry rows
    row_inputs: list[Var] = field(default_factory=list)  # read from outside, chunked
    consts: list[Var] = field(default_factory=list)  # read from outside, whole
    post: list[Eqn] = field(default_factory=list)  # forward eqns after the sums (to the loss)
    ct_eqns: list[Eqn] = field(default_factory=list)  # the post's backward eqns
    cts: dict = field(default_factory=dict)  # the post's backward: var -> cotangent atom
    stops: list = field(default_factory=list)  # (eqn, why) where the region stopped
    sums_reduce: bool = True  # `sums` reduce the rows (a head); else they are rowwise ends


def is_row(v, k: int, rows, roles) -> bool:
    """Does `v` carry the rows (its leading axes)? Graph inputs only when data or labels."""
    return (type(v) is Var and tuple(v.aval.shape[:k]) == tuple(rows)
            and roles.get(v, "data") in ROW_ROLES)


def per_row(v, k: int) -> int:
    return math.prod(v.aval.shape[k:])


def find_head(graph: Graph, loss: Var, needs: set, seed) -> tuple[Head | None, str]:
    """The largest worthwhile head region of forward `graph` (None, and why, if there is none)."""
    candidates = {}
    roles = dict(zip(graph.inputs, graph.input_roles, strict=True))
    for eqn in graph.eqns:
        if eqn.op != "reduce_sum" or eqn.outputs[0] not in needs or type(eqn.inputs[0]) is not Var:
            continue
        axes, shape = set(eqn.params["axes"]), eqn.inputs[0].aval.shape
        k = 0
        while k in axes and k < len(shape):
            k += 1
            # a sum of a value read whole (a param) would be counted once per chunk
            if is_row(eqn.inputs[0], k, shape[:k], roles):
                candidates.setdefault((k, tuple(shape[:k])), []).append(eqn)
    if not candidates:
        return None, ("the loss is not a sum over rows: no reduce_sum on the gradient path "
                      "reduces the leading axes of a per-row value")
    reasons = []
    for (k, rows), sums in sorted(candidates.items(), key=lambda kv: -kv[0][0]):
        if max(rows) < 2:  # one chunk would hold them all
            reasons.append(f"rows {list(rows)}: a single row")
            continue
        head, why = _head_for(graph, loss, needs, seed, k, rows, sums)
        if head is not None:
            return head, ""
        reasons.append(f"rows {list(rows)}: {why}")
    return None, "; ".join(reasons)


def _head_for(graph, loss, needs, seed, k, rows, sums):
    known = [s for s in sums if _post_pass(graph, loss, needs, seed, [s]) is not None]
    if not known:
        return None, ("the loss is not linear in its row sums (their cotangent needs the "
                      "forward's end)")
    post = _post_pass(graph, loss, needs, seed, known)
    if post is None:
        known = known[:1]
        post = _post_pass(graph, loss, needs, seed, known)
    head = grow(graph, k, rows, known)
    head.post, head.ct_eqns, head.cts = post
    expanding = [e for e in head.eqns if expands(e, head)]
    if not expanding:
        ops = ", ".join(dict.fromkeys(e.op for e in head.eqns))
        return None, (f"the row-independent region before the row sum ({ops}) makes no row "
                      f"larger than the rows it reads, so chunking saves nothing"
                      + _stopped(graph, head))
    return head, ""


def _stopped(graph, head) -> str:
    if not head.stops:
        return ""
    eqn, why = head.stops[0]
    return f"; it stops at `{format_eqn(eqn, graph)}`: {why}"


def expands(eqn, head) -> bool:
    if eqn in head.sums:
        return False
    ins = [a for a, row in zip(eqn.inputs, head.flags[eqn], strict=True) if row]
    return bool(ins) and max(per_row(v, head.k) for v in eqn.outputs) > max(
        per_row(a, head.k) for a in ins)


def _post_pass(graph, loss, needs, seed, sums):
    """(eqns after the row sums, the backward eqns of those, their cotangents) when the sums'
    cotangents do not depend on the sums' values; else None."""
    after = {s.outputs[0] for s in sums}
    post = []
    for eqn in graph.eqns:
        if any(type(a) is Var and a in after for a in eqn.inputs):
            post.append(eqn)
            after.update(eqn.outputs)
    if loss not in after:
        return None
    cts, forward, ct_eqns = reverse_pass(graph.replace(eqns=tuple(post)), needs, [(loss, seed)])
    if list(forward) != post:  # a loop after the sums
        return None
    tainted = set(after)
    for eqn in ct_eqns:
        if any(type(a) is Var and a in tainted for a in eqn.inputs):
            tainted.update(eqn.outputs)
    for s in sums:
        ct = cts.get(s.outputs[0])
        if ct is None or (type(ct) is Var and ct in tainted):
            return None
    return post, list(ct_eqns), cts


def batched_gathers(graph: Graph) -> Graph:
    """`graph` with each batched gather that slices a size-1 operand axis whole put in the form
    JAX gives it when that axis is longer: the axis batched with a size-1 axis of the indices.
    `jnp.take_along_axis` (optax's integer-label cross-entropy) makes a batch of one an offset
    axis and drops it from the indices, which then do not carry the rows `(1, T)`. The values
    are the same; the graph is returned as is when no gather has that form."""
    eqns, changed = [], False
    for eqn in graph.eqns:
        new = _batched_gather(eqn) if eqn.op == "gather" else None
        if new is None:
            eqns.append(eqn)
        else:
            eqns += new
            changed = True
    return graph.replace(eqns=tuple(eqns)) if changed else graph


def _batched_gather(eqn) -> list[Eqn] | None:
    """[a reshape of the indices, the gather batched along its size-1 offset axes], or None."""
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    operand, indices = eqn.inputs[0].aval.shape, eqn.inputs[1].aval.shape
    if not dn.operand_batching_dims:  # only a batched gather: not a lookup in a table
        return None
    offsets = [d for d in range(len(operand)) if d not in dn.collapsed_slice_dims
               and d not in dn.operand_batching_dims]
    unit = [j for j, d in enumerate(offsets) if operand[d] == 1 and sizes[d] == 1]
    if not unit:
        return None
    pairs = dict(zip(dn.operand_batching_dims, dn.start_indices_batching_dims, strict=True))
    out_rank = len(eqn.outputs[0].aval.shape)
    batch_positions = [p for p in range(out_rank) if p not in dn.offset_dims]
    shape = list(indices)
    for j in unit:  # the output axis stays in place, now read from a new axis of the indices
        p = dn.offset_dims[j]
        r = sum(1 for q in batch_positions if q < p)
        pairs = {d: (i + 1 if i >= r else i) for d, i in pairs.items()}
        pairs[offsets[j]] = r
        shape.insert(r, 1)
        batch_positions = sorted(batch_positions + [p])
    dims = sorted(pairs)
    new_dn = dn._replace(
        offset_dims=tuple(p for j, p in enumerate(dn.offset_dims) if j not in unit),
        operand_batching_dims=tuple(dims),
        start_indices_batching_dims=tuple(pairs[d] for d in dims))
    b = Builder(eqn.tags, eqn.regions, eqn.source)
    (new_indices,) = b.bind("reshape", eqn.inputs[1], new_sizes=tuple(shape), dimensions=None,
                            sharding=None)
    gather = dataclasses.replace(eqn, inputs=(eqn.inputs[0], new_indices),
                                 params={**eqn.params, "dimension_numbers": new_dn})
    return b.eqns + [gather]


def readers_of(graph: Graph) -> dict[Var, list[Eqn]]:
    """Each var's reading eqns, in schedule order."""
    readers: dict[Var, list[Eqn]] = {}
    for eqn in graph.eqns:
        for a in eqn.inputs:
            if type(a) is Var:
                readers.setdefault(a, []).append(eqn)
    return readers


def grow(graph, k, rows, ends, exclude=frozenset(), regions=None) -> Head:
    """The region: `ends` (the row sums, or eqns whose outputs anything may read) and,
    backwards, every eqn not in `exclude` all of whose readers are in it and that maps rows
    (and, when `regions` is given, that is in those checkpoint regions)."""
    roles = dict(zip(graph.inputs, graph.input_roles, strict=True))
    readers = readers_of(graph)
    outputs = {a for a in graph.outputs if type(a) is Var}
    head = Head(k, rows, [], list(ends))
    region = set(ends)
    read = {a for s in ends for a in s.inputs if type(a) is Var}
    for eqn in ends:
        head.flags[eqn] = tuple(is_row(a, k, rows, roles) for a in eqn.inputs)
    for eqn in reversed(graph.eqns):
        if eqn in region or eqn in exclude or not any(v in read for v in eqn.outputs):
            continue
        if any(tuple(v.aval.shape[:k]) != tuple(rows) for v in eqn.outputs):
            continue  # a constant of the region (no rows): read whole
        flags = tuple(is_row(a, k, rows, roles) for a in eqn.inputs)
        why = ("it is in other checkpoint regions" if regions is not None
               and eqn.regions != regions else _why_not(eqn, flags, k, rows, region, readers,
                                                        outputs))
        if why:
            head.stops.append((eqn, why))
            continue
        region.add(eqn)
        head.flags[eqn] = flags
        read.update(a for a in eqn.inputs if type(a) is Var)
    head.eqns = [e for e in graph.eqns if e in region]
    made = {v for e in head.eqns for v in e.outputs}
    inputs = list(dict.fromkeys(a for e in head.eqns for a in e.inputs
                                if type(a) is Var and a not in made))
    head.row_inputs = [a for a in inputs if is_row(a, k, rows, roles)]
    head.consts = [a for a in inputs if not is_row(a, k, rows, roles)]
    return head


def _mixing(eqn, k, rows) -> str:
    """`op`, and why it mixes rows if it does."""
    flags = [type(a) is Var and tuple(a.aval.shape[:k]) == tuple(rows) for a in eqn.inputs]
    try:
        row_params(eqn, flags, k, rows)
    except NotRowwise as e:
        return f"`{eqn.op}` ({e})"
    return f"`{eqn.op}`"


def _why_not(eqn, flags, k, rows, region, readers, outputs) -> str:
    if any(v in outputs for v in eqn.outputs):
        return "its value is an output of the graph"
    outside = [r for v in eqn.outputs for r in readers.get(v, ()) if r not in region]
    if outside:
        return f"its value is also read outside the region, by {_mixing(outside[0], k, rows)}"
    if has_effects(eqn):
        return "it has side effects"
    try:
        row_params(eqn, flags, k, rows)
    except NotRowwise as e:
        return str(e)
    return ""
