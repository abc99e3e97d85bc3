"""Row-independent regions inside the network (a token-wise MLP), run over chunks of rows.

Unlike the loss head, such a region's outputs are read further on, so its cotangent is known
only in the backward. Its eqns become one scan over chunks of rows whose body is a checkpoint
region that saves nothing: the forward loop keeps only the region's outputs (which exist whole
anyway), and the backward loop (`jgraph.vjp_rules.loops`) recomputes each chunk's hidden values
from the chunk's inputs, so one chunk's hidden values and their cotangents exist at a time.

A region ends at a projection that makes rows smaller (an MLP's down projection: rows are all
axes but the last) and grows backwards as the head does (`jgraph.chunk.find.grow`): an eqn joins
when every reader of its outputs is in the region and it maps rows. It is chunked when one of its
eqns makes rows larger than they were (the up projection to the hidden width).
"""

from __future__ import annotations

import dataclasses

from jgraph.builder import Builder
from jgraph.chunk.emit import (
    chunk_shape,
    emit_on_chunk,
    scan_over_chunks,
    split_rows,
    with_loops,
)
from jgraph.chunk.find import Head, expands, grow, is_row, per_row
from jgraph.chunk.rows import NotRowwise, row_params
from jgraph.ir import Eqn, Graph, Region, Var, short_aval


def interior_regions(graph: Graph, exclude) -> list[Head]:
    """Disjoint regions of forward `graph` (none holding an eqn of `exclude`), each ending at a
    row-shrinking projection."""
    roles = dict(zip(graph.inputs, graph.input_roles, strict=True))
    taken, found = set(exclude), []
    for end in reversed(graph.eqns):
        if end in taken or end.op != "dot_general" or len(end.outputs[0].aval.shape) < 2:
            continue
        out = end.outputs[0]
        k = len(out.aval.shape) - 1
        rows = tuple(out.aval.shape[:k])
        flags = tuple(is_row(a, k, rows, roles) for a in end.inputs)
        try:
            row_params(end, flags, k, rows)
        except NotRowwise:
            continue
        if not any(f and per_row(a, k) > per_row(out, k) for a, f in zip(end.inputs, flags,
                                                                            strict=True)):
            continue
        region = grow(graph, k, rows, [end], exclude=taken, regions=end.regions)
        region.sums_reduce = False
        if any(expands(e, region) for e in region.eqns):
            found.append(region)
            taken.update(region.eqns)
    return found


def chunk_interior(graph: Graph, regions: list[Head], chunks: int) -> tuple[Graph, list[dict]]:
    """Forward `graph` with each region replaced by a scan over chunks (and what was done)."""
    replaced, infos = {}, []
    for region in regions:
        axis, size, n, rest = split_rows(region.rows, chunks)
        replaced[region.sums[0]] = _chunked(region, axis, size, n, rest)
        infos.append({"kind": "interior", "ops": [e.op for e in region.eqns],
                      "rows": region.rows, "axis": axis, "chunks": n + (rest > 0),
                      "chunk_rows": size, "remainder": rest,
                      "row_inputs": [short_aval(v.aval) for v in region.row_inputs],
                      "consts": [short_aval(v.aval) for v in region.consts]})
    return with_loops(graph, replaced, {e for r in regions for e in r.eqns}), infos


def _chunked(region: Head, axis, size, n, rest) -> list[Eqn]:
    """The eqns computing the region's end (the same var) with scans over chunks."""
    end = region.sums[0]
    b = Builder(tags=end.tags, regions=end.regions)  # where the end was
    scan_over_chunks(b, lambda rows: _body(region, chunk_shape(region.rows, axis, rows)),
                     region.consts, region.row_inputs, axis, size, n, rest)
    # the last eqn makes the region's value: it defines the var its readers read
    b.eqns[-1] = dataclasses.replace(b.eqns[-1], outputs=(end.outputs[0],))
    return b.eqns


def _body(region: Head, rows) -> Graph:
    """(consts, row input chunks) -> the end's chunk, in a checkpoint region that saves
    nothing: the backward loop recomputes the chunk."""
    k = region.k
    consts = [Var(c.aval) for c in region.consts]
    row_ins = [Var(u.aval.update(shape=rows + u.aval.shape[k:])) for u in region.row_inputs]
    env = dict(zip(region.consts, consts, strict=True)) | dict(
        zip(region.row_inputs, row_ins, strict=True))
    b = Builder(regions=(0,))
    emit_on_chunk(b, region, rows, env)
    inputs = tuple(consts + row_ins)
    recompute = Region(0, None, None, True, "chunk_rows", region.sums[0].source)
    return Graph(inputs=inputs, eqns=tuple(b.eqns), outputs=(env[region.sums[0].outputs[0]],),
                 input_roles=("data",) * len(inputs), output_roles=("aux",), regions=(recompute,))
