"""`chunk_rows`: the loss head's forward and backward in one loop over chunks of rows.

From a graph of `jg.backward` the forward graph is taken (`backward.forward_of`) and its head
region found (`jgraph.chunk.find`). The joint graph is then derived again around it:

    pre-head forward eqns              (everything the head and the loss read)
    cotangents of the row sums         (from the seed: known before the head runs)
    scan over chunks of rows:          consts: those cotangents, the head's constants
        the head's forward on a chunk, its VJP (`backward.vjp_graph`) seeded with them;
        carries: the row sums and the constants' cotangents, accumulated over chunks;
        ys: the cotangents of the chunk's row inputs
    [one more iteration on the remaining rows, when the chunks do not divide them]
    the loss from the row sums, then the backward of the pre-head eqns, seeded by the scan

So no chunk is computed twice and the head's values over all rows (the logits, their cotangent)
never exist at once. The rows are split along one row axis; the chunk's eqns are emitted again
with the params their row rules give for the chunk's shape (`jgraph.chunk.rows`). Regions inside
the network (`jgraph.chunk.interior`) are put in loops on the forward graph first, which
`jg.backward` then derives again (their backward loops recompute each chunk).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jgraph.backward import backward, forward_of, needs_gradient, reverse_pass, vjp_graph
from jgraph.builder import Builder
from jgraph.check import validate
from jgraph.chunk.blocks import block_regions, chunk_blocks
from jgraph.chunk.emit import (
    accumulate,
    accumulated,
    cast,
    chunk_shape,
    emit_on_chunk,
    emit_scan,
    from_chunks,
    join_chunks,
    rest_chunk,
    split_rows,
    to_chunks,
    zeros,
)
from jgraph.chunk.examples import over_examples
from jgraph.chunk.find import Head, batched_gathers, find_head
from jgraph.chunk.interior import chunk_interior, interior_regions
from jgraph.chunk.layers import layers_over_examples
from jgraph.errors import TransformError
from jgraph.ir import Eqn, Graph, Literal, Var, short_aval
from jgraph.passes import dce

# Output roles only a graph derived by `jg.backward` has (grads, or what later transforms made
# of them).
DERIVED = frozenset({"grad", "new_accumulator", "new_param"})


def chunk_rows(graph: Graph, chunks: int = 8, *, interior: bool = True,
               attention: bool = True, loops: bool = True, examples: bool = False,
               layer_loops: int | None = None) -> Graph:
    """`graph` with its loss head run over chunks of rows, its backward in the same loop.

    The rows are split along one row axis (one the chunks divide if any): `ceil(rows / chunks)`
    rows per chunk, and one smaller chunk for the rows left when the chunks do not divide them.

    Args:
        graph: a joint graph from `jg.backward`.
        chunks: how many chunks (a positive int).
        interior: also chunk each row-independent region inside the network that ends in a
            projection (a token-wise MLP: `jgraph.chunk.interior`), whose backward loop
            recomputes each chunk.
        attention: also run attention over blocks of queries (`jgraph.chunk.blocks`).
        loops: also look inside scans' bodies (a scanned model's layer).
        examples: run a scan's whole body over chunks of examples where it computes each
            example of its carries alone (a scanned model's layer: `jgraph.chunk.examples`),
            in place of the regions inside it; and the layers written out (outside loops),
            each over chunks of examples (`jgraph.chunk.layers`).
        layer_loops: with `examples`, how many loops the layers written out run in (per
            stretch between eqns mixing examples; each loop's inputs are kept for the
            backward); None: the count `jgraph.chunk.layers` estimates puts least in memory.

    Returns:
        The chunked `Graph`. `info["chunk_rows"]` is `{"reason": None, "regions": [{...}, ...]}`,
        one entry per region chunked (`kind` "head", "interior" or "blocks") naming its ops,
        `rows`, the split `axis`, `chunks`, `chunk_rows`, `remainder`, its row inputs and
        constants (the head's entry also its `eqns`, first and last position in the forward graph;
        a block region's `rows` are its end's shape, `axis` its block axis there, `read_whole` the
        keys and values every block reads; a region inside a scan's body has `in`: "scan body");
        a scanned layer over chunks of examples has kind "examples", `rows` its widest carry's
        rows and `chunk_rows` the examples per chunk, a layer written out the same with `in`
        "layers" and its `eqns` (with `examples`, `examples_left` says why each scan whose
        body was not so chunked was not, and why no layer written out was);
        `head` says why the head was not chunked when only interior regions were. When nothing
        was worth chunking it is `{"reason": why, "regions": []}` and the graph's eqns are
        unchanged.

    Raises:
        TransformError: a graph that is not a backward graph, chunks (or layer_loops) that are
            not a positive int, or layer_loops without examples."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise TransformError(f"chunk_rows: chunks must be an int >= 1, got {chunks!r}")
    if layer_loops is not None and (isinstance(layer_loops, bool) or not isinstance(
            layer_loops, int) or layer_loops < 1):
        raise TransformError(f"chunk_rows: layer_loops must be an int >= 1 or None, got "
                             f"{layer_loops!r}")
    if layer_loops is not None and not examples:
        raise TransformError("chunk_rows: layer_loops says how many loops the layers run in "
                             "over chunks of examples: give examples=True too")
    if not isinstance(graph, Graph):
        raise TransformError(f"chunk_rows takes a jgraph Graph (from jg.backward), got "
                             f"{type(graph).__name__}")
    validate(graph, "jg.chunk_rows")
    if not DERIVED & set(graph.output_roles):
        raise TransformError("chunk_rows takes a graph from jg.backward (with grad outputs); "
                             "this graph has none: pass jg.backward(graph)")
    forward = forward_of(graph)
    if forward is None:
        return _unchanged(graph, "the graph is not jg.backward's result as it returned it (it "
                                 "was transformed since): chunk the backward graph first")
    seed = graph.info.get("loss_seed")
    if not isinstance(seed, Literal) and seed not in graph.inputs_with_role("loss_seed"):
        return _unchanged(graph, "the loss seed is computed (inside shard_map)")
    # a traced graph may hold dead eqns (readers that are not); a batch of one in a gather
    forward = batched_gathers(dce(forward))
    loss = forward.outputs_with_role("loss")[0]
    head, why = find_head(forward, loss, needs_gradient(forward, loss), seed)
    found, left = [], [] if examples and loops and interior else None
    if interior:
        forward, found = _network(forward, set(head.eqns if head else ()), chunks, attention,
                                  loops, examples=left, layer_loops=layer_loops)
    if found:  # the joint graph derived again from the forward with them in loops (and with
        # the policy it was derived with inside its loops: a planner's loop mode)
        graph = backward(forward, loop_policy=graph.info.get("loop_policy"))
        seed = graph.info["loss_seed"]
        head, why = find_head(forward, loss, needs_gradient(forward, loss), seed)
    said = {} if left is None else {"examples_left": left}  # why a scan's body was not
    if head is None:
        if not found:
            done = _unchanged(graph, why)
            return done.replace(info={**done.info, "chunk_rows": {
                **done.info["chunk_rows"], **said}})
        return graph.replace(info={**_info(graph), "chunk_rows": {
            "reason": None, "regions": found, "head": why, **said}})
    needs = needs_gradient(forward, loss)
    axis, size, n, rest = split_rows(head.rows, chunks)
    joint, inner = _derive(graph, forward, head, needs, axis, size, n, rest)
    where = [i for i, e in enumerate(forward.eqns) if e in set(head.eqns)]
    found.append({
        "kind": "head", "ops": [e.op for e in head.eqns], "eqns": (where[0], where[-1]),
        "rows": head.rows, "axis": axis, "chunks": n + (rest > 0), "chunk_rows": size,
        "remainder": rest, "row_inputs": [short_aval(v.aval) for v in head.row_inputs],
        "consts": [short_aval(v.aval) for v in head.consts], "eqns_per_chunk": inner,
    })
    return joint.replace(info={**_info(graph), "chunk_rows": {"reason": None, "regions": found,
                                                              **said}})


def _network(forward: Graph, exclude, chunks: int, attention: bool, loops: bool,
             computed: bool = False, examples: list | None = None,
             layer_loops: int | None = None):
    """(`forward` with its regions inside the network in loops over chunks, what was done):
    token-wise MLPs, then attention over blocks of queries, then the same inside each scan's
    body (a scanned model's layer), where only values computed in the body count as keys read
    whole (its inputs are the layer's weights and carries); with `examples` (a list: why each
    scan's body was not), a scan's whole body over chunks of examples where it computes each
    example alone."""
    scans = {e for e in forward.eqns if loops and e.op == "scan" and e not in exclude}
    found = []
    if examples is not None:  # the layers written out, each over chunks of examples
        forward, found, why = layers_over_examples(forward, exclude, chunks, layer_loops)
        if why is not None:
            examples.append(f"layers: {why}")
    regions = interior_regions(forward, exclude)
    taken = set(exclude) | {e for r in regions for e in r.eqns}
    constants = set(forward.inputs) if computed else None
    blocks = block_regions(forward, taken, constants, chunks) if attention else []
    forward, more = chunk_interior(forward, regions, chunks)
    found += more
    forward, more = chunk_blocks(forward, blocks, chunks)
    found += more
    eqns = list(forward.eqns)
    for i, eqn in enumerate(eqns):
        if eqn not in scans:  # (not the loops made here)
            continue
        if examples is not None:
            chunked, info = over_examples(eqn, chunks)
            if chunked is not None:
                eqns[i] = chunked
                found.append({**info, "in": "scan"})
                continue
            examples.append(f"scan {i}: {info}")
        body, inner = _network(eqn.params["body"], (), chunks, attention, loops, computed=True)
        if inner:
            eqns[i] = dataclasses.replace(eqn, params={**eqn.params, "body": body})
            found += [{**r, "in": "scan body"} for r in inner]
    return forward.replace(eqns=tuple(eqns)), found


def _info(graph: Graph) -> dict:
    return {k: v for k, v in graph.info.items() if k != "backward_of"}


def _unchanged(graph: Graph, why: str) -> Graph:
    return graph.replace(info={**graph.info, "chunk_rows": {"reason": why, "regions": []}})


def _derive(graph, forward, head: Head, needs, axis, size, n, rest):
    """(the joint graph with the head chunked, eqns per chunk)."""
    region = set(head.eqns)
    post = set(head.post)
    pre = [e for e in forward.eqns if e not in region and e not in post]
    sums = [s.outputs[0] for s in head.sums]
    cts = [head.cts[s] for s in sums]
    before = _cone(head.ct_eqns, [c for c in cts if type(c) is Var])
    after = [e for e in head.ct_eqns if e not in set(before)]
    wrt_consts = [c for c in head.consts if c in needs]
    wrt_rows = [u for u in head.row_inputs if u in needs]

    b = Builder(tags={"backward"})  # the loop holds the head's backward (and its forward)
    body = _body(head, needs, chunk_shape(head.rows, axis, size))
    carry = [b.call(zeros, shape=v.aval.shape, dtype=accumulated(v.aval.dtype))[0]
             for v in sums + wrt_consts]
    xs = [b.call(to_chunks, u, axis=axis, n=n, size=size)[0] for u in head.row_inputs]
    last = rest == 0
    # the row sums come out of the last loop as the vars the loss reads (unless cast below)
    final = sums if all(accumulated(s.aval.dtype) == s.aval.dtype for s in sums) else None
    carry, ys = emit_scan(b, body, cts + head.consts, carry, xs, n, final if last else None)
    if not last:
        tail = _body(head, needs, chunk_shape(head.rows, axis, rest))
        xs = [b.call(rest_chunk, u, axis=axis, start=n * size)[0] for u in head.row_inputs]
        carry, more = emit_scan(b, tail, cts + head.consts, carry, xs, 1, final)
        ys = [b.call(join_chunks, y, m, axis=axis)[0] for y, m in zip(ys, more, strict=True)]
    else:
        ys = [b.call(from_chunks, y, axis=axis)[0] for y in ys]
    if final is None:  # low-precision sums were accumulated in float32: cast into the vars
        for s, c in zip(sums, carry, strict=False):
            b.call(cast, c, dtype=s.aval.dtype)
            b.eqns[-1] = dataclasses.replace(b.eqns[-1], outputs=(s,))
    const_cts = [b.call(cast, c, dtype=v.aval.dtype)[0] if c.aval.dtype != v.aval.dtype else c
                 for v, c in zip(wrt_consts, carry[len(sums):], strict=True)]
    scan_eqns = b.eqns

    seeds = [(v, ct) for v, ct in head.cts.items() if v in set(pre_vars(pre, forward))]
    seeds += list(zip(wrt_consts, const_cts, strict=True)) + list(zip(wrt_rows, ys, strict=True))
    pre_graph = forward.replace(eqns=tuple(pre))
    # (the loops before the head saving what the joint's policy says, as it was derived)
    grads_ct, pre_fwd, pre_bwd = reverse_pass(pre_graph, needs, seeds,
                                              graph.info.get("loop_policy", ()))
    g = Builder(tags={"backward"})
    grads = [grads_ct.get(p) or g.call(jnp.zeros_like, p)[0] for p in forward.grad_params()]
    eqns = (list(pre_fwd) + before + scan_eqns + head.post + after + list(pre_bwd) + g.eqns)
    joint = dce(graph.replace(eqns=tuple(eqns), outputs=forward.outputs + tuple(grads)))
    return joint, len(body.eqns)


def pre_vars(pre, forward) -> list:
    """The values defined before the head: the graph's inputs and the pre-head eqns' outputs."""
    return list(forward.inputs) + [v for e in pre for v in e.outputs]


def _cone(eqns, targets) -> list[Eqn]:
    """The eqns among `eqns` that `targets` depend on, in order."""
    wanted = set(targets)
    kept = []
    for eqn in reversed(eqns):
        if any(v in wanted for v in eqn.outputs):
            kept.append(eqn)
            wanted.update(a for a in eqn.inputs if type(a) is Var)
    return kept[::-1]


def _body(head: Head, needs, rows) -> Graph:
    """The scan body on a chunk of `rows`: (sum cts, consts, sum accs, const ct accs, row input
    chunks) -> (new sum accs, new const ct accs, row input cts)."""
    k = head.k
    consts = [Var(c.aval) for c in head.consts]
    row_ins = [Var(u.aval.update(shape=rows + u.aval.shape[k:])) for u in head.row_inputs]
    env = dict(zip(head.consts, consts, strict=True)) | dict(
        zip(head.row_inputs, row_ins, strict=True))
    b = Builder()
    emit_on_chunk(b, head, rows, env)
    partial = [env[s.outputs[0]] for s in head.sums]
    chunk = Graph(inputs=tuple(consts + row_ins), eqns=tuple(b.eqns), outputs=tuple(partial),
                  input_roles=("data",) * (len(consts) + len(row_ins)),
                  output_roles=("aux",) * len(partial))
    wrt = [c in needs for c in head.consts] + [u in needs for u in head.row_inputs]
    vjp = vjp_graph(chunk, wrt, [True] * len(partial))
    n_sums, n_in = len(partial), len(consts) + len(row_ins)
    sum_cts = list(vjp.inputs[n_in:])
    sources = [v for v, w in zip(consts + row_ins, wrt, strict=True) if w]
    in_cts = dict(zip(sources, vjp.outputs[n_sums:], strict=True))
    acc = Builder()
    wanted = [c for c, w in zip(consts, wrt, strict=False) if w]
    sum_accs = [Var(s.aval.update(dtype=accumulated(s.aval.dtype))) for s in partial]
    ct_accs = [Var(c.aval.update(dtype=accumulated(c.aval.dtype))) for c in wanted]
    new_sums = [acc.call(accumulate, a, s)[0] for a, s in zip(sum_accs, vjp.outputs, strict=False)]
    new_cts = [acc.call(accumulate, a, in_cts[c])[0] for a, c in zip(ct_accs, wanted, strict=True)]
    row_cts = [in_cts[u] for u, w in zip(row_ins, wrt[len(consts):], strict=True) if w]
    inputs = tuple(sum_cts + consts + sum_accs + ct_accs + row_ins)
    outputs = tuple(new_sums + new_cts + row_cts)
    return Graph(inputs=inputs, eqns=vjp.eqns + tuple(acc.eqns), outputs=outputs,
                 input_roles=("data",) * len(inputs), output_roles=("aux",) * len(outputs))


