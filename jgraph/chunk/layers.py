"""The layers of a forward written out (not scanned), each run over chunks of examples.

A model's layers compute each example from the same example alone (attention mixes positions
of one sequence, never two), so each layer can run as a scan over chunks of the examples whose
body, a checkpoint region saving nothing, the backward loop (`jgraph.vjp_rules.loops`)
recomputes a chunk at a time: the forward keeps each layer's input, as a checkpoint per layer
does, and one chunk of one layer's working set exists at a time instead of the whole batch's.
It is what `jgraph.chunk.examples` does for a scanned layer, on a forward written out.

Which values carry the examples is followed from the graph's data and label inputs (their
leading axis, the batch), not read off shapes: an eqn reading a carried value carries them when
its row rule (`jgraph.chunk.rows`) maps each example to itself; so does a broadcast or an iota
making a leading axis of the batch's size from constants. Such eqns run in chunks; an eqn reading
no carried value (a weight transposed) runs as it is, before the layer's loop; an eqn that mixes
examples (a norm over the batch, the loss's sum), has effects, holds a loop or a branch reading
the examples, or belongs to a region left out (the loss head), ends a stretch of layers. Each
result of a chunk is computed from that chunk's rows alone, whatever the layers are: the row
rules decide it, so a wrong guess of what is a layer costs memory, never a wrong value.

Where one stretch is cut into layers: at the boundaries crossed by the fewest bytes of carried
values (between two layers, where only the residual stream crosses; never before the first
contraction or after the last), each piece between two holding a contraction (one without
joins the next). The pieces are grouped into loops of about equal bytes of contraction outputs
(what a chunk's backward holds, with their cotangents): the forward keeps each loop's inputs
(more loops, more kept), and one chunk of one loop's values lives in its backward (larger
loops, more of it). Their sum is least at about `sqrt(contraction bytes / (chunks * 2 *
boundary bytes))` loops, the count taken unless one is given (`jg.chunk_rows(layer_loops=)`).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter

from jgraph.builder import Builder
from jgraph.chunk.emit import scan_over_chunks, split_rows, with_loops
from jgraph.chunk.examples import MAKES_ROWS, holds_graph, new_leading_axis, on_chunk
from jgraph.chunk.find import ROW_ROLES, Head
from jgraph.chunk.rows import NotRowwise, row_params
from jgraph.ir import Eqn, Graph, Var, short_aval
from jgraph.opkinds import nbytes
from jgraph.ops import has_effects

CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})


def layers_over_examples(forward: Graph, exclude, chunks: int, loops: int | None = None
                         ) -> tuple[Graph, list[dict], str | None]:
    """(`forward` with its layers outside loops over `chunks` chunks of examples, in `loops`
    loops per stretch (None: as the module docstring says), what was done, or why nothing
    was)."""
    rows = _batch(forward)
    if rows is None:
        return forward, [], "no data input with a leading axis"
    _, size, n, rest = split_rows((rows,), chunks)
    if n + (rest > 0) < 2:
        return forward, [], "the batch is a single example"
    flags = _carried(forward, rows, set(exclude))
    where = {e: i for i, e in enumerate(forward.eqns)}
    last = _last_reads(forward)
    layers = [layer for stretch in _stretches(forward, flags) for layer in
              _layers(stretch, where, last, n + (rest > 0), loops)]
    if not layers:
        return forward, [], "no stretch of layers with a contraction outside loops"
    found, replaced = [], {}
    for layer in layers:
        head = Head(1, (rows,), layer, [], {e: flags[e] for e in layer})
        made = set(v for e in layer for v in e.outputs)
        ins = list(dict.fromkeys(a for e in layer for a, f in zip(e.inputs, flags[e], strict=True)
                                 if f and a not in made))
        consts = list(dict.fromkeys(a for e in layer for a, f in zip(e.inputs, flags[e],
                                                                       strict=True)
                                    if type(a) is Var and not f and a not in made))
        end = where[layer[-1]]
        outs = [v for e in layer for v in e.outputs if last.get(v, -1) > end]
        b = Builder(tags=layer[-1].tags, regions=layer[-1].regions)
        results = scan_over_chunks(b, lambda r, h=head, c=consts, i=ins, o=outs: on_chunk(
            h, c, i, o, r), consts, ins, 0, size, n, rest)
        named = dict(zip(results, outs, strict=True))  # each result under its own var
        replaced[layer[-1]] = [e if not set(e.outputs) & set(named) else Eqn(
            e.op, e.inputs, e.params, tuple(named.get(v, v) for v in e.outputs), e.tags,
            e.regions, e.source) for e in b.eqns]
        widest = max(ins + outs, key=lambda v: v.aval.size)  # (its rows: tokens too)
        found.append({"kind": "examples", "in": "layers", "ops": [e.op for e in layer],
                      "eqns": (where[layer[0]], end),
                      "rows": tuple(widest.aval.shape[:max(1, widest.aval.ndim - 1)]), "axis": 0,
                      "chunks": n + (rest > 0), "chunk_rows": size, "remainder": rest,
                      "row_inputs": [short_aval(v.aval) for v in ins],
                      "consts": [short_aval(v.aval) for v in consts]})
    # each loop where its layer's last eqn was (the eqns it reads whole run before it)
    return with_loops(forward, replaced, {e for layer in layers for e in layer}), found, None


def _batch(forward: Graph) -> int | None:
    """The batch: the leading size most of the data and label inputs share."""
    sizes = Counter(v.aval.shape[0] for v, role in zip(forward.inputs, forward.input_roles,
                                                        strict=True)
                    if role in ROW_ROLES and v.aval.shape)
    return sizes.most_common(1)[0][0] if sizes else None


def _carried(forward: Graph, rows: int, exclude: set) -> dict:
    """{eqn: which of its inputs carry the examples} for the eqns that carry them (outputs of a
    leading axis of `rows`, each example from itself); None for an eqn that ends a stretch; eqns
    reading no carried value are left out (they run as they are)."""
    carried = {v for v, role in zip(forward.inputs, forward.input_roles, strict=True)
               if role in ROW_ROLES and v.aval.shape and v.aval.shape[0] == rows}
    flags: dict = {}
    for eqn in forward.eqns:
        f = tuple(type(a) is Var and a in carried for a in eqn.inputs)
        makes = (not any(f) and eqn.op in MAKES_ROWS and eqn.outputs[0].aval.shape
                 and eqn.outputs[0].aval.shape[0] == rows and new_leading_axis(eqn))
        if eqn in exclude:
            flags[eqn] = None
            continue
        if not any(f) and not makes:
            continue
        flags[eqn] = None
        if has_effects(eqn) or any(holds_graph(v) for v in eqn.params.values()) \
                or any(v.aval.shape[:1] != (rows,) for v in eqn.outputs):
            continue
        try:
            row_params(eqn, f, 1, (rows,))
        except NotRowwise:
            continue
        flags[eqn] = f
        carried.update(eqn.outputs)
    return flags


def _stretches(forward: Graph, flags: dict) -> list[list[Eqn]]:
    """Runs of carrying eqns of the same regions, between the eqns that end a stretch."""
    found, run = [], []
    for eqn in forward.eqns:
        if eqn not in flags:
            continue
        if flags[eqn] is None or (run and eqn.regions != run[-1].regions):
            found.append(run)
            run = []
        if flags[eqn] is not None:
            run.append(eqn)
    return [r for r in found + [run] if r]


def _last_reads(forward: Graph) -> dict:
    """{var: the last position reading it}, past the end for a result."""
    last = {}
    for i, eqn in enumerate(forward.eqns):
        for a in eqn.inputs:
            if type(a) is Var:
                last[a] = i
    for a in forward.outputs:
        if type(a) is Var:
            last[a] = len(forward.eqns)
    return last


def _layers(stretch: list[Eqn], where: dict, last: dict, chunks: int, loops: int | None
            ) -> list[list[Eqn]]:
    """`stretch` cut into `loops` layers (the module docstring), each with a contraction
    (`where`: each eqn's position in the forward; `last`: `_last_reads`)."""
    made = {v: where[e] for e in stretch for v in e.outputs}
    # bytes crossing the boundary after each eqn of the stretch: carried values made in it up
    # to there (or read from before it: every boundary's alike), read after
    at = [where[e] for e in stretch]
    change = [0] * (len(stretch) + 1)
    for v, made_at in made.items():
        first = bisect.bisect_left(at, made_at)
        stop = bisect.bisect_left(at, last.get(v, -1))  # boundaries after eqns before its last read
        if first < stop:
            change[first] += nbytes(v.aval)
            change[stop] -= nbytes(v.aval)
    crossing = list(itertools.accumulate(change))[:len(stretch) - 1]
    contractions = [k for k, e in enumerate(stretch) if e.op in CONTRACTIONS]
    if not contractions:
        return []
    inner = crossing[contractions[0]:contractions[-1]]  # (never before the first layer begins)
    if not inner:
        return [stretch]
    least = min(inner)
    pieces, piece = [], []
    for k, e in enumerate(stretch):
        piece.append(e)
        if contractions[0] <= k < contractions[-1] and crossing[k] == least and any(
                x.op in CONTRACTIONS for x in piece):
            pieces.append(piece)
            piece = []
    if piece:
        if any(x.op in CONTRACTIONS for x in piece) or not pieces:
            pieces.append(piece)
        else:
            pieces[-1] += piece
    if not any(x.op in CONTRACTIONS for x in pieces[-1]):
        return []
    held = [sum(nbytes(v.aval) for e in p for v in e.outputs if e.op in CONTRACTIONS)
            for p in pieces]
    if loops is None:  # kept inputs (each loop's, twice: its chunks too) against one chunk
        loops = round(math.sqrt(sum(held) / (chunks * 2 * least)))
    loops = max(1, min(loops, len(pieces)))
    groups, total, so_far = [[]], sum(held), 0
    for p, h in zip(pieces, held, strict=True):
        if groups[-1] and so_far >= total * len(groups) / loops:
            groups.append([])
        groups[-1] += p
        so_far += h
    return groups
