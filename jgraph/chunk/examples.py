"""A scanned layer run over chunks of examples: the whole body of a scan, one chunk at a time.

A scanned model's layer computes each example of its carries (the residual stream, `[B, T, d]`)
from the same example alone: attention mixes the positions of one sequence, never two
sequences. So the layer's body can run in a scan over chunks of the examples (the carries'
leading axis), each chunk through every eqn of the layer, and the body's inner scan is a
checkpoint region saving nothing: the backward loop (`jgraph.vjp_rules.loops`) recomputes each
chunk and runs its backward, so one chunk's working set (the qkv projection, the scores, the
MLP's hidden and all their cotangents) exists at a time instead of the whole batch's, and the
weights' gradients are summed over the chunks as a loop's constants' are.

Which values carry the examples is followed from the carries, not read off shapes (a weight
whose leading axis happens to equal the batch stays whole): an eqn reading a carried value
carries them (its params for a chunk come from its row rule, `jgraph.chunk.rows`, with one row
axis); so does a broadcast or an iota that makes a leading axis of the batch's size from
constants (a causal mask broadcast to every example, the same for each); any other eqn reads
only the layer's weights and constants and runs as it is in every chunk. A body that has
effects (each chunk would repeat them), any eqn of which mixes examples (a norm over the
batch) or reads them inside a loop or a branch, or whose results do not all carry the examples
(a per-layer value of its weights), is left as it is, with the reason.
"""

from __future__ import annotations

import dataclasses

from jgraph.builder import Builder
from jgraph.chunk.emit import emit_on_chunk, scan_over_chunks, split_rows
from jgraph.chunk.find import Head
from jgraph.chunk.rows import NotRowwise, row_params
from jgraph.ir import Eqn, Graph, Region, Var, short_aval
from jgraph.ops import has_effects

MAKES_ROWS = frozenset({"broadcast_in_dim", "iota"})  # may make the batch axis from constants


def over_examples(scan: Eqn, chunks: int) -> tuple[Eqn | None, dict | str]:
    """(`scan` with its body over `chunks` chunks of examples, what was done), or (None, why
    not)."""
    p = scan.params
    body, n_consts, n_carry = p["body"], p["num_consts"], p["num_carry"]
    layer = _layer(body, n_consts, n_carry)
    if isinstance(layer, str):
        return None, layer
    _, size, n, rest = split_rows(layer.rows, chunks)
    if n + (rest > 0) < 2:
        return None, "the batch is a single example"
    carries = list(body.inputs[n_consts:n_consts + n_carry])
    whole = [v for v in body.inputs if v not in set(carries)]
    b = Builder(tags=frozenset(), regions=())
    outs = scan_over_chunks(b, lambda rows: on_chunk(layer, whole, carries, body.outputs, rows),
                            whole, carries, 0, size, n, rest)
    chunked = body.replace(eqns=tuple(b.eqns), outputs=tuple(outs), regions=())
    widest = max(carries, key=lambda v: v.aval.size)
    info = {"kind": "examples", "ops": [e.op for e in body.eqns],
            "rows": tuple(widest.aval.shape[:-1]), "axis": 0, "chunks": n + (rest > 0),
            "chunk_rows": size, "remainder": rest,
            "row_inputs": [short_aval(v.aval) for v in carries],
            "consts": [short_aval(v.aval) for v in whole]}
    return dataclasses.replace(scan, params={**p, "body": chunked}), info


def _layer(body: Graph, n_consts: int, n_carry: int) -> Head | str:
    """The body as a region over its carries' leading axis (`Head.flags`: the eqns reading the
    examples; the others run as they are), or why it is not one."""
    carries = body.inputs[n_consts:n_consts + n_carry]
    if not carries or any(not v.aval.shape for v in carries):
        return "a carry without a batch axis"
    rows = carries[0].aval.shape[0]
    if any(v.aval.shape[0] != rows for v in carries):
        return "carries of different leading sizes"
    effects = next((e for e in body.eqns if has_effects(e)), None)
    if effects is not None:  # (each chunk would repeat it)
        return f"`{effects.op}` in the body has effects"
    layer, carried = Head(1, (rows,), list(body.eqns), []), set(carries)
    for eqn in body.eqns:
        flags = tuple(type(a) is Var and a in carried for a in eqn.inputs)
        makes = (not any(flags) and eqn.op in MAKES_ROWS and eqn.outputs[0].aval.shape
                 and eqn.outputs[0].aval.shape[0] == rows and new_leading_axis(eqn))
        if not any(flags) and not makes:
            continue  # computed from the weights and constants alone: run as it is
        if any(holds_graph(v) for v in eqn.params.values()):
            return f"`{eqn.op}` in the body reads the examples inside a loop or a branch"
        try:
            row_params(eqn, flags, 1, (rows,))
        except NotRowwise as e:
            return f"`{eqn.op}` mixes examples ({e})"
        layer.flags[eqn] = flags
        carried.update(eqn.outputs)
    if any(type(a) is not Var or a not in carried for a in body.outputs):
        return "a result of the body that does not carry the examples"
    return layer


def holds_graph(value) -> bool:
    return isinstance(value, Graph) or (isinstance(value, tuple)
                                        and any(isinstance(v, Graph) for v in value))


def new_leading_axis(eqn: Eqn) -> bool:
    """A broadcast or iota whose leading axis is new (not an operand's, not counted along)."""
    if eqn.op == "iota":
        return eqn.params["dimension"] != 0
    return 0 not in tuple(eqn.params["broadcast_dimensions"])


def on_chunk(layer: Head, whole: list[Var], carries: list[Var], results, size: int) -> Graph:
    """(the weights and constants, a chunk of each carry) -> each of `results` on the chunk, in
    a checkpoint region that saves nothing."""
    consts = [Var(v.aval) for v in whole]
    chunk = [Var(v.aval.update(shape=(size,) + v.aval.shape[1:])) for v in carries]
    env = dict(zip(whole, consts, strict=True)) | dict(zip(carries, chunk, strict=True))
    b = Builder(regions=(0,))
    emit_on_chunk(b, layer, (size,), env)
    inputs = tuple(consts + chunk)
    outputs = tuple(env.get(a, a) for a in results)
    recompute = Region(0, None, None, True, "chunk_rows", "")
    return Graph(inputs=inputs, eqns=tuple(b.eqns), outputs=outputs,
                 input_roles=("data",) * len(inputs), output_roles=("aux",) * len(outputs),
                 regions=(recompute,))
