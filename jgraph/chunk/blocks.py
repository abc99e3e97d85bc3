"""Regions whose blocks read another computed value whole (attention over blocks of queries).

Memory-efficient attention (Rabe & Staats, 2021) computes the scores and softmax of one block of
queries at a time: each block reads all keys and values, and its rows are independent of the
other blocks'. A block region is found on the forward graph backwards from an end eqn, for a
block axis of its output: each eqn's rule (`jgraph.chunk.axes`) says which axis of each input
holds the same block, or that the input is read whole. An eqn joins when every reader of its
outputs is in the region, it has no effects, its outputs are asked for along one axis, and its
rule holds. What the region reads from outside is cut into blocks along the axis asked for (the
queries, the residual stream) or read whole (keys, values, weights, scalars). A causal mask built
from `iota`s joins the region and is rebuilt per block, its positions offset by the block's
first one; a mask given as a constant array is sliced per block.

A region is chunked when it holds a value larger than its end and than each input it cuts (the
scores). Its block axis is the queries' when the blocks read keys and values whole (what the
leading-rows regions of `jgraph.chunk.rows` cannot chunk), or the examples' when a batch has at
least as many as the chunks asked for: a block of whole examples contracts as many rows as the
whole attention does, where a block of a few queries runs thin, slow contractions (the scanned
LM of `bench_max_batch` at batch 132 in 127 blocks of one query: 4.2x JAX's time per example).
Like a token-wise MLP (`jgraph.chunk.interior`) it becomes a forward scan over blocks whose body
is a checkpoint region that saves nothing: the backward loop recomputes each block's scores.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field

import jax.numpy as jnp
from jax import lax

from jgraph.builder import Builder
from jgraph.chunk.axes import block_params
from jgraph.chunk.emit import (
    emit_scan,
    from_chunks,
    join_chunks,
    rest_chunk,
    split_rows,
    to_chunks,
    with_loops,
)
from jgraph.chunk.find import readers_of
from jgraph.chunk.rows import NotRowwise
from jgraph.errors import TransformError
from jgraph.ir import Eqn, Graph, Region, ShapedArray, Var, short_aval
from jgraph.naming import while_processing
from jgraph.ops import has_effects


@dataclass
class Blocks:
    """A region chunked along one block axis that may move from value to value."""

    end: Eqn  # its last eqn: the value read outside
    axis: int  # the block axis of the end's output
    eqns: list[Eqn] = field(default_factory=list)  # in schedule order, the end last
    axes: dict = field(default_factory=dict)  # eqn -> the block axis of its output
    sliced: list = field(default_factory=list)  # (var or literal, axis) cut into blocks
    consts: list = field(default_factory=list)  # vars read whole by every block
    offset: bool = False  # a block needs its first position (an iota along the axis)
    reads_whole: list = field(default_factory=list)  # computed values a contraction reads whole


def _nbytes(v) -> int:
    return math.prod(v.aval.shape) * v.aval.dtype.itemsize


def block_regions(graph: Graph, exclude=frozenset(), constants=None,
                  chunks: int = 1) -> list[Blocks]:
    """Disjoint block regions of forward `graph`, none holding an eqn of `exclude`. A value
    read whole counts as keys when computed, or a data input not in `constants` (by default
    the inputs that are not data: params). Of a region's block axes, one at least `chunks`
    long is taken first, then one whose blocks read no computed value whole (the examples of
    a batch: each block's contractions as wide as the whole's, its keys cut into blocks too,
    where blocks of queries contract a few rows at a time), then the one holding most eqns."""
    position = {e: i for i, e in enumerate(graph.eqns)}
    producer = {v: e for e in graph.eqns for v in e.outputs}
    readers = readers_of(graph)
    outputs = {a for a in graph.outputs if type(a) is Var}
    params = constants if constants is not None else {
        v for v, r in zip(graph.inputs, graph.input_roles, strict=True) if r != "data"}
    taken, found = set(exclude), []
    for end in sorted(_ends(graph, readers, params), key=position.get, reverse=True):
        if end in taken or has_effects(end):
            continue
        grown = [(region, n) for axis, n in enumerate(end.outputs[0].aval.shape) if n >= 2
                 and (region := _grow(graph.eqns, end, axis, taken, position, producer,
                                      readers, outputs, params)) is not None]
        if grown:  # (the first of equals: the earliest axis)
            best = max(grown, key=lambda g: (g[1] >= chunks, not g[0].reads_whole,
                                             len(g[0].eqns)))[0]
            found.append(best)
            taken.update(best.eqns)
    return found


def _ends(graph: Graph, readers, params) -> set[Eqn]:
    """Where a block region may end: a contraction of two values that are not constants (the
    scores, or the scores with the values), and each eqn after it while its value has one reader
    (to the residual add that reads the attention's output)."""
    ends = set()
    for eqn in graph.eqns:
        if eqn.op != "dot_general" or any(type(a) is not Var or a in params
                                          for a in eqn.inputs):
            continue
        while len(eqn.outputs) == 1 and eqn not in ends:
            ends.add(eqn)
            following = readers.get(eqn.outputs[0], ())
            if len(following) != 1:
                break
            eqn = following[0]
    return ends


def _grow(eqns, end, axis, taken, position, producer, readers, outputs,
          params) -> Blocks | None:
    """The region ending at `end` with block axis `axis`, if it is worth chunking."""
    try:
        _, in_axes, adds = block_params(end, axis, 2)
    except NotRowwise:
        return None
    region = Blocks(end, axis, axes={end: axis}, offset=adds)
    members = {end}
    asked: dict = {}  # var -> the block axes its region readers ask for (None: whole)
    heap: list = []

    def ask(eqn, in_axes):
        for a, ax in zip(eqn.inputs, in_axes, strict=True):
            if type(a) is not Var:
                if ax is not None:  # a constant array (a mask): sliced per block
                    region.sliced.append((a, ax))
                    region.offset = True
                continue
            if a not in asked:
                asked[a] = set()
                if a in producer and producer[a] not in taken:
                    heapq.heappush(heap, -position[producer[a]])
            asked[a].add(ax)
            if ax is None and eqn.op == "dot_general" and a not in params:
                region.reads_whole.append(a)

    ask(end, in_axes)
    while heap:
        eqn = eqns[-heapq.heappop(heap)]
        if eqn in members:
            continue
        wanted = {ax for v in eqn.outputs for ax in asked.get(v, ())}
        if (len(wanted) != 1 or None in wanted or has_effects(eqn) or eqn.regions != end.regions
                or any(v in outputs for v in eqn.outputs)
                or any(r not in members for v in eqn.outputs for r in readers.get(v, ()))):
            continue
        (ax,) = wanted
        try:
            _, in_axes, adds = block_params(eqn, ax, 2)
        except NotRowwise:
            continue
        members.add(eqn)
        region.axes[eqn] = ax
        region.offset |= adds
        ask(eqn, in_axes)
    region.eqns = [e for e in eqns if e in members]
    made = {v for e in region.eqns for v in e.outputs}
    for v, axes in asked.items():
        if v not in made:
            region.consts += [v] if None in axes else []
            region.sliced += [(v, ax) for ax in sorted(a for a in axes if a is not None)]
    region.reads_whole = [v for v in dict.fromkeys(region.reads_whole) if v not in made]
    return region if _worth(region) else None


def _worth(region: Blocks) -> bool:
    """It holds a value larger than its end and each input it cuts (the scores)."""
    largest = max(_nbytes(v) for e in region.eqns for v in e.outputs)
    cut = [_nbytes(v) for v, _ in region.sliced if type(v) is Var]
    return largest > max([_nbytes(region.end.outputs[0])] + cut)


def chunk_blocks(graph: Graph, regions: list[Blocks], chunks: int) -> tuple[Graph, list[dict]]:
    """Forward `graph` with each block region replaced by a scan over blocks (and what was
    done)."""
    replaced, infos = {}, []
    for region in regions:
        out = region.end.outputs[0]
        _, size, n, rest = split_rows((out.aval.shape[region.axis],), chunks)
        replaced[region.end] = _chunked(region, size, n, rest)
        infos.append({"kind": "blocks", "ops": [e.op for e in region.eqns],
                      "rows": tuple(out.aval.shape), "axis": region.axis,
                      "chunks": n + (rest > 0), "chunk_rows": size, "remainder": rest,
                      "row_inputs": [short_aval(v.aval) for v, _ in region.sliced],
                      "consts": [short_aval(v.aval) for v in region.consts],
                      "read_whole": [short_aval(v.aval) for v in region.reads_whole]})
    return with_loops(graph, replaced, {e for r in regions for e in r.eqns}), infos


# -- emitted with `Builder.call` -------------------------------------------------------------
def _starts(*, n, size, first):
    return first + jnp.arange(n, dtype=jnp.int32) * size


def _shifted(x, start):
    return x + start.astype(x.dtype)


def _block_of(x, start, *, axis, size):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _chunked(region: Blocks, size: int, n: int, rest: int) -> list[Eqn]:
    """The eqns computing the region's end (the same var) with scans over blocks."""
    b = Builder(tags=region.end.tags, regions=region.end.regions)  # where the end was
    out = region.end.outputs[0]
    cut = [(v, ax) for v, ax in region.sliced if type(v) is Var]

    def scan(count, block, first, cut_input):
        xs = [cut_input(v, ax) for v, ax in cut]
        if region.offset:
            xs.append(b.call(_starts, n=count, size=block, first=first)[0])
        _, (ys,) = emit_scan(b, _body(region, block), region.consts, [], xs, count)
        return ys

    ys = scan(n, size, 0, lambda v, ax: b.call(to_chunks, v, axis=ax, n=n, size=size)[0])
    if rest:
        more = scan(1, rest, n * size,
                    lambda v, ax: b.call(rest_chunk, v, axis=ax, start=n * size)[0])
        b.call(join_chunks, ys, more, axis=region.axis)
    else:
        b.call(from_chunks, ys, axis=region.axis)
    # the last eqn makes the region's value: it defines the var its readers read
    b.eqns[-1] = dataclasses.replace(b.eqns[-1], outputs=(out,))
    return b.eqns


def _resize(v, axis: int, size: int):
    shape = list(v.aval.shape)
    shape[axis] = size
    return v.aval.update(shape=tuple(shape))


def _body(region: Blocks, size: int) -> Graph:
    """(consts, input blocks[, the block's first position]) -> the end's block, in a checkpoint
    region that saves nothing: the backward loop recomputes the block."""
    consts = [Var(c.aval) for c in region.consts]
    cut = [(v, ax) for v, ax in region.sliced if type(v) is Var]
    blocks = [Var(_resize(v, ax, size)) for v, ax in cut]
    start = [Var(ShapedArray((), jnp.dtype(jnp.int32)))] if region.offset else []
    env = {(c, None): new for c, new in zip(region.consts, consts, strict=True)}
    env |= {key: new for key, new in zip(cut, blocks, strict=True)}
    b = Builder(regions=(0,))

    def atom(a, ax):
        if type(a) is Var:
            return env[(a, ax)]
        if ax is None:
            return a
        return b.call(_block_of, a, start[0], axis=ax, size=size)[0]  # a constant mask

    for eqn in region.eqns:
        b.source = eqn.source
        ax = region.axes[eqn]
        with while_processing("chunking", eqn, error=TransformError):
            params, in_axes, adds = block_params(eqn, ax, size)
            (new,) = b.bind(eqn.op, *(atom(a, i) for a, i in zip(eqn.inputs, in_axes,
                                                                  strict=True)), **params)
            if adds:
                new = b.call(_shifted, new, start[0])[0]
        want = _resize(eqn.outputs[0], ax, size).shape
        if tuple(new.aval.shape) != tuple(want):  # a block rule that does not fit its op
            raise TransformError(f"chunk_rows: `{eqn.op}` on a block gives "
                                 f"{short_aval(new.aval)}, expected {want}")
        env[(eqn.outputs[0], ax)] = new
    inputs = tuple(consts + blocks + start)
    recompute = Region(0, None, None, True, "chunk_rows", region.end.source)
    return Graph(inputs=inputs, eqns=tuple(b.eqns),
                 outputs=(env[(region.end.outputs[0], region.axis)],),
                 input_roles=("data",) * len(inputs), output_roles=("aux",), regions=(recompute,))

