"""A graph as XLA:CPU sees it before fusion: the eqns `jgraph.memory.program` fuses into kernels.

`flatten(graph)` rewrites the eqns as XLA's passes before fusion leave them: bitcasts and
identities resolved, XLA's CSE applied, constants folded, `split` as slices, transposed copies of
dot and convolution operands, the index arrays of batched gathers and scatters, a scatter-add of
zeros folded into the sum reading it, a loop's broadcast constants sunk into its body, and the
taints and fusion cuts `jgraph.lower` puts on recompute and backward eqns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jgraph import opkinds
from jgraph.ir import Eqn, Graph, Literal, ShapedArray, Var
from jgraph.lower import fusion_cuts, protection_plan
from jgraph.passes import without_unused_ys


@dataclass
class Ops:
    """The eqns XLA computes, in schedule order, with bitcasts and identities resolved away."""

    eqns: list[Eqn] = field(default_factory=list)
    alias: dict[Var, object] = field(default_factory=dict)  # bitcast output -> its operand
    origin: dict[Eqn, Eqn] = field(default_factory=dict)  # a rewritten eqn -> the graph's eqn
    seen: dict[tuple, tuple] = field(default_factory=dict)  # what each eqn computes (CSE)

    def root(self, atom):
        while isinstance(atom, Var) and atom in self.alias:
            atom = self.alias[atom]
        return atom


def flatten(graph: Graph, ops: Ops | None = None) -> Ops:
    """The graph's eqns without bitcasts and identities (`ops.root` resolves them), `split` as
    slices, the transposed copies of dot operands XLA makes, and the taints `jgraph.lower` adds
    to recompute eqns (each group of `no_cse` eqns reads one input through a select on the
    anchor, so it waits for the backward to reach it), and the fusion cuts (a value the lowering
    materialises is written by an opaque `materialise` eqn reading its producer's result). Each
    rewritten eqn remembers the graph's eqn it comes from. Inputs keep the graph's vars (and
    shapes)."""
    ops = ops or Ops()
    plan, anchors = protection_plan(graph) if any("no_cse" in e.tags for e in graph.eqns) \
        else ({}, [])
    tainted: dict[tuple[int, Var], Var] = {}
    cuts = fusion_cuts(graph)
    folds = _scatter_folds(graph, {anchors[g] for g, position in plan.values()
                                   if position is not None})
    used = {a for e in graph.eqns for a in e.inputs if isinstance(a, Var)}
    used.update(a for a in graph.outputs if isinstance(a, Var))
    held: dict[Var, tuple] = {}  # a folded scatter's output -> (its eqn, its inputs)
    constant: set[Var] = set()  # broadcasts of constants
    for eqn in graph.eqns:
        inputs = eqn.inputs
        if eqn in folds:
            if folds[eqn] is None:  # the scatter: it is computed where its sum is
                held[eqn.outputs[0]] = (eqn, inputs)
                continue
            scatter, scatter_inputs = held[eqn.inputs[folds[eqn]]]
            other = eqn.inputs[1 - folds[eqn]]
            eqn = Eqn(scatter.op, (other,) + tuple(scatter_inputs[1:]), scatter.params,
                      eqn.outputs, eqn.tags, eqn.regions, eqn.source)
            inputs = eqn.inputs
        if eqn in plan:  # before anything else: a bitcast's taint is its readers' too
            inputs = _taint(ops, eqn, plan[eqn], anchors, tainted)
        if _folded(ops, eqn, inputs):  # XLA folds constants: a constant is not a temp
            for out in eqn.outputs:
                ops.alias[out] = Literal(None, out.aval)
            continue
        src = opkinds.aliases(eqn)
        if src is not None:
            for out, k in zip(eqn.outputs, src, strict=True):
                ops.alias[out] = inputs[k]
            continue
        if _common(ops, eqn, inputs):
            continue
        if eqn.op == "split":
            for out in eqn.outputs:
                _emit(ops, Eqn("slice", inputs, {}, (out,), eqn.tags, eqn.regions,
                               eqn.source), eqn)
            continue
        if eqn.op in ("gather", "scatter-add", "scatter", "scatter_add") \
                and opkinds.batched_indices(eqn):
            inputs = _batched_indices(ops, eqn, inputs)
        params, outputs = eqn.params, eqn.outputs
        if eqn.op == "scan":  # its stacked outputs nothing reads dropped, as XLA drops them
            live = without_unused_ys(eqn, used)
            params, outputs = live.params, live.outputs
            inputs = _sunk(ops, eqn, inputs, constant) + _ys_stacks(ops, live)
        copies = COPIES[eqn.op](eqn) if eqn.op in COPIES else ()
        if any(c is not None for c in copies):
            inputs = tuple(_operand_copy(ops, a, eqn, c) if c is not None and isinstance(a, Var)
                           else a
                           for a, c in zip(inputs[:2], copies, strict=True)) + inputs[2:]
        predicate = None
        if outputs and outputs[0] in cuts:  # `lax.cond(x[0] < -|x[0]|, zeros, identity, x)`:
            # XLA computes the predicate in a fusion of its own from the value's operands (made
            # after the value's: it runs after it)
            outputs = (Var(outputs[0].aval),)
            element = Var(outputs[0].aval)
            predicate = Var(ShapedArray((), np.dtype("int32")))
            _emit(ops, Eqn(eqn.op, inputs, eqn.params, (element,), eqn.tags, eqn.regions,
                           eqn.source), eqn)
            _emit(ops, Eqn("slice", (element,), {}, (predicate,), eqn.tags, eqn.regions,
                           eqn.source), eqn)
        _emit(ops, eqn if inputs == eqn.inputs and outputs == eqn.outputs else Eqn(
            eqn.op, inputs, params, outputs, eqn.tags, eqn.regions, eqn.source), eqn)
        if predicate is not None:
            _emit(ops, Eqn("materialise", outputs + (predicate,), {}, eqn.outputs, eqn.tags,
                           eqn.regions, eqn.source), eqn)
        if eqn.op == "broadcast_in_dim" and isinstance(ops.root(inputs[0]), Literal):
            constant.add(eqn.outputs[0])
    return ops


def _sunk(ops: Ops, scan: Eqn, inputs, constant: set) -> tuple:
    """A scan's inputs, with each constant or xs that is a broadcast of a constant (the
    cotangent of a mean, read by a backward loop) a literal: XLA sinks it into the loop's body
    (`WhileLoopConstantSinking`, broadcasts of constants included), so no buffer holds it."""
    n_consts, n_carry = scan.params["num_consts"], scan.params["num_carry"]
    return tuple(Literal(None, a.aval) if ops.root(a) in constant
                 and not n_consts <= k < n_consts + n_carry else a
                 for k, a in enumerate(inputs))


SCATTER_ADDS = frozenset({"scatter-add", "scatter_add"})


def _scatter_folds(graph: Graph, anchors: set) -> dict:
    """XLA's algebraic simplifier folds `a + scatter_add(zeros, indices, updates)` into
    `scatter_add(a, indices, updates)` where the sum is the scatter's only reader (the gradient
    of an embedding table that is also read by a dot; `anchors`: values the lowering's taints
    read too, so never folded). {sum eqn: which of its operands is the scatter, scatter eqn:
    None}."""
    producer = {v: e for e in graph.eqns for v in e.outputs}
    readers: dict[Var, int] = dict.fromkeys(anchors, 1)
    for e in graph.eqns:
        for a in e.inputs:
            if isinstance(a, Var):
                readers[a] = readers.get(a, 0) + 1
    for a in graph.outputs:
        if isinstance(a, Var):
            readers[a] = readers.get(a, 0) + 1
    folds = {}
    for eqn in graph.eqns:
        if eqn.op not in ("add", "add_any") or len(eqn.inputs) != 2 or not all(
                isinstance(a, Var) and a.aval == eqn.outputs[0].aval for a in eqn.inputs):
            continue
        for k, a in enumerate(eqn.inputs):
            scatter = producer.get(a)
            if scatter is not None and scatter.op in SCATTER_ADDS and readers[a] == 1 \
                    and scatter not in folds and _zeros(scatter.inputs[0], producer):
                folds[eqn], folds[scatter] = k, None
                break
    return folds


def _zeros(atom, producer) -> bool:
    """Whether `atom` is zeros: a literal zero, or a broadcast of one."""
    if isinstance(atom, Var) and atom in producer and producer[atom].op == "broadcast_in_dim":
        atom = producer[atom].inputs[0]
    return isinstance(atom, Literal) and atom.value is not None \
        and not np.any(np.asarray(atom.value))


def _common(ops: Ops, eqn: Eqn, inputs) -> bool:
    """XLA's CSE: an eqn computing what an earlier one computes is that one (the backward often
    recomputes a forward value: `max(x, 0)` for relu's derivative). Recompute eqns differ from
    the forward by their taint."""
    try:
        key = (eqn.op, tuple(ops.root(a) if isinstance(a, Var) else literal_key(a)
                             for a in inputs),
               tuple(sorted(eqn.params.items())), tuple(v.aval for v in eqn.outputs))
        hash(key)
    except TypeError:  # unhashable params: leave it alone
        return False
    earlier = ops.seen.get(key)
    if earlier is None:
        ops.seen[key] = eqn.outputs
        return False
    ops.alias.update(zip(eqn.outputs, earlier, strict=True))
    return True


def literal_key(a) -> tuple:
    """A literal as a hashable key of its value (dtype, shape, bytes, weak type)."""
    value = np.asarray(a.value) if a.value is not None else np.asarray(0)
    return ("literal", value.dtype.str, value.shape, value.tobytes(), a.aval.weak_type)


def _taint(ops: Ops, eqn: Eqn, step, anchors, tainted) -> tuple:
    group, position = step
    if position is not None and (group, eqn.inputs[position]) not in tainted:
        x = eqn.inputs[position]
        out = Var(x.aval)
        _emit(ops, Eqn("taint", (anchors[group], x), {}, (out,), eqn.tags, eqn.regions,
                       eqn.source), eqn)
        tainted[(group, x)] = out
    return tuple(tainted.get((group, a), a) if isinstance(a, Var) else a for a in eqn.inputs)


# Ops whose operands XLA copies into the layout its kernels take.
COPIES = {"dot_general": opkinds.dot_operand_copies,
          "conv_general_dilated": opkinds.conv_operand_copies}


def _folded(ops: Ops, eqn: Eqn, inputs) -> bool:
    if eqn.op in ("iota", "broadcast_in_dim") or opkinds.kind(eqn) in ("rng", "loop", "opaque"):
        return False
    return all(isinstance(ops.root(a), Literal) for a in inputs)


def _emit(ops: Ops, eqn: Eqn, origin: Eqn) -> None:
    ops.eqns.append(eqn)
    ops.origin[eqn] = origin


def _batched_indices(ops: Ops, eqn: Eqn, inputs) -> tuple:
    """XLA rewrites a gather or scatter with batching dimensions to one whose indices carry the
    batch positions too: a materialised index array (the indices and iotas, concatenated)."""
    indices = inputs[1]
    out = Var(ShapedArray(opkinds.batched_indices(eqn), np.int32))
    _emit(ops, Eqn("batched_indices", (indices,), {}, (out,), eqn.tags, eqn.regions,
                   eqn.source), eqn)
    return (inputs[0], out) + tuple(inputs[2:])


def _ys_stacks(ops: Ops, scan: Eqn) -> tuple:
    """The buffers a scan writes its stacked outputs into: JAX lowers a scan to a while loop
    whose ys start as broadcasts, instructions without operands, which XLA's scheduler runs
    first: a stack lives from the start of the program (the scan writes it in place)."""
    stacks = []
    for y in scan.outputs[scan.params["num_carry"]:]:
        out = Var(y.aval)  # (no eqn of the graph's: a report places the scan where it runs)
        ops.eqns.append(Eqn("scan_stack", (), {}, (out,), scan.tags, scan.regions, scan.source))
        stacks.append(out)
    return tuple(stacks)


def _operand_copy(ops: Ops, a: Var, dot: Eqn, layout) -> Var:
    """The copy of `a` in `layout` that `dot` reads: one per value and layout (XLA's CSE: the
    query, key and value projections of one input share its transposed copy)."""
    key = ("operand_copy", ops.root(a), layout)
    if key not in ops.seen:
        out = Var(a.aval)
        _emit(ops, Eqn("operand_copy", (a,), {}, (out,), dot.tags, dot.regions, dot.source),
              dot)
        ops.seen[key] = (out,)
    return ops.seen[key][0]
