"""A graph as XLA:CPU runs it: kernels (fusions) reading and writing materialised buffers.

`flatten(graph)` first rewrites the eqns as XLA sees them: bitcasts and identities resolved, XLA's
CSE applied, constants folded, `split` as slices, transposed copies of dot and convolution
operands, the index arrays of batched gathers and scatters, and the taints and fusion cuts
`jgraph.lower` puts on recompute and backward eqns. `kernels(eqns, ...)` then replays XLA's
instruction fusion (`instruction_fusion.cc` with the CPU rules of `opkinds`): consumers are
visited from the last to the first; a kernel rooted at a fusible consumer absorbs producers,
latest first, while XLA would fuse them:

- the producer is fusible (`cheap`, `expensive`, `reduce` or `tree`) and has one output;
- if it has readers outside the kernel (or is already materialised), fusing copies it: never for
  an expensive producer (unless a broadcast or a widening convert), nor for one that reads more
  than it writes from two operands that are not broadcasts, unless every reader is a loop fusion;
- an expensive producer is not fused where the kernel reads its elements more than once (through
  a broadcast, as a gather's table, in an outer product);
- a YNNPACK reduction (`library`), formed before loop fusion, takes elementwise producers and
  YNNPACK dots with no other reader; a `tree` reduction's operand is materialised, and it runs
  as its own kernel (XLA's reduce_window over it, right after it: its partial results are
  small), fused into no consumer.

A producer left out of any of its readers' kernels is materialised: it roots a kernel of its own.
A `dot` kernel folds the transposes of its operands; every other kernel (convolution, loops,
random bits, unknown ops) reads materialised operands. A buffer is a `Value`, sized as XLA sizes
it; a reshape is a bitcast, so it names the buffer of its operand.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from jgraph import opkinds
from jgraph.ir import Eqn, Graph, Literal, ShapedArray, Var
from jgraph.lower import fusion_cuts, protection_plan
from jgraph.opkinds import aligned
from jgraph.passes import without_unused_ys

FUSIBLE = frozenset({"cheap", "expensive", "reduce"})  # may fuse into a consumer
GROWS = frozenset({"cheap", "expensive", "reduce", "library", "expanded"})  # fuse producers
LOOP = frozenset({"cheap", "expensive", "reduce"})  # loop fusions


class Value:
    """A materialised buffer."""

    __slots__ = ("var", "size", "kind", "kernel", "readers", "start", "end", "home")

    def __init__(self, var, size: int, kind: str, kernel=None):
        self.var = var  # the value it holds
        self.size = size  # bytes, as XLA sizes the buffer
        # "temp": counted; "input": a read-only argument (or a loop's state, seen from its body);
        # "donated": a donated argument an output is written into; "output": a result that lives
        # out (its allocation may hold temps before it is written); "state": written into a
        # donated argument's allocation or into a loop's state
        self.kind = kind
        self.kernel = kernel  # the kernel writing it (None: an argument)
        self.readers: list[Kernel] = []  # kernels reading it, in no order
        self.start = self.end = 0  # live range on the schedule (set by `buffers`)
        self.home = None  # the allocation of a donated argument or an output holding it, if any

    @property
    def heap_size(self) -> int:
        return aligned(self.size)

    def __repr__(self):
        return f"Value({self.var}, {self.size}, {self.kind})"


class Kernel:
    """One XLA computation step: a fusion, a library call, a loop, a copy."""

    __slots__ = ("root", "eqns", "reads", "writes", "workspace", "shares", "role", "order")

    def __init__(self, root: Eqn | None, role: str):
        self.root = root  # the eqn computed last (None: a copy the step needs)
        self.eqns: list[Eqn] = [] if root is None else [root]  # the eqns it computes
        self.reads: list[Value] = []  # buffers it reads, each once
        self.writes: list[Value] = []  # buffers it writes
        self.workspace = 0  # temp bytes alive only while it runs (a loop's body)
        self.shares: list[tuple[Value, Value]] = []  # (output, operand): may write in place
        self.role = role  # "forward", "backward", "recompute", "update", "copy"
        self.order = 0  # position in the graph's schedule (ties in XLA's scheduler)

    def read(self, value: Value) -> None:
        if value not in self.reads:
            self.reads.append(value)
            value.readers.append(self)

    def __repr__(self):
        return f"Kernel({self.root.op if self.root else self.role}, {len(self.eqns)} eqns)"


def role_of(eqn: Eqn) -> str:
    if "recompute" in eqn.tags:
        return "recompute"
    if "backward" in eqn.tags:
        return "backward"
    return "forward"


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


def kernels(eqns: list[Eqn], root, external: set[Var], workspace,
            decided: dict | None = None) -> list[Kernel]:
    """Replay XLA:CPU's fusion on `eqns` (schedule order; `root(var)` resolves bitcasts, as
    `Ops.root`). `external`: values
    read outside these eqns (results, the step's updates), which are materialised. `workspace(eqn)`
    gives an op's own temp bytes (a loop's body). `decided`: what XLA did with a value where one
    compile showed it (`jgraph.memory.fusions`: True, a buffer; False, fused into its readers);
    those decisions stand over the rules. Kernels come back in schedule order, each with its
    `eqns`; their `reads`/`writes` are filled in by `connect`."""
    index = {e: i for i, e in enumerate(eqns)}
    outputs = {v: e for e in eqns for v in e.outputs}
    producer = {a: outputs[root(a)] for e in eqns for a in e.inputs
                if isinstance(a, Var) and root(a) in outputs}
    kinds = {e: opkinds.kind(e) for e in eqns}
    verdict = _verdicts(decided or {}, producer, kinds)
    readers: dict[Var, list[Eqn]] = {}
    for e in eqns:
        for a in dict.fromkeys(root(a) for a in e.inputs):
            if isinstance(a, Var):
                readers.setdefault(a, []).append(e)
    paths = _on_all_paths(producer, kinds, readers, index)
    unfused = {v: set(rs) for v, rs in readers.items()}  # reader edges not yet fused
    needed: set[Eqn] = set()
    found: list[Kernel] = []
    for eqn in reversed(eqns):
        materialised = eqn in needed or kinds[eqn] not in FUSIBLE or len(eqn.outputs) != 1 \
            or any(v in external for v in eqn.outputs) or verdict(eqn) is True
        if not materialised:
            continue  # fused into every reader, or read by none (XLA removes it)
        kernel = Kernel(eqn, role_of(eqn))
        kernel.order = index[eqn]
        kernel.workspace = workspace(eqn)
        if kinds[eqn] in GROWS:
            _grow(kernel, producer, kinds, readers, unfused, needed, index, external, verdict,
                  paths)
        else:
            for a in eqn.inputs:
                p = producer.get(a)
                if p is not None and kinds[eqn] == "dot" and p.op == "transpose" \
                        and a.aval.shape == p.outputs[0].aval.shape:
                    # folded into the dot, which reads the transpose's input (not through a
                    # reshape: XLA folds a transpose only into the dot reading it)
                    kernel.eqns.append(p)
                    unfused[p.outputs[0]].discard(eqn)
                    for b in p.inputs:
                        if b in producer:
                            needed.add(producer[b])
                elif p is not None:
                    needed.add(p)
        found.append(kernel)
    found.reverse()
    return found


def _verdicts(decided: dict, producer: dict, kinds: dict):
    """`verdict(eqn)`: XLA's decision on the eqn's value (None: not known). A value XLA may have
    written from an instruction that also computes an operand the rules keep apart (a dot with
    the transpose of its result folded into its layout, a library fusion ending in an
    elementwise op) is left to the rules: the simulator has no such kernel."""
    if not decided:
        return lambda eqn: None
    known: dict = {}

    def verdict(eqn):
        if eqn not in known:
            found = decided.get(eqn.outputs[0]) if len(eqn.outputs) == 1 else None
            if found is True and (eqn.op == "transpose" or any(
                    p is not None and kinds[p] not in FUSIBLE
                    and decided.get(p.outputs[0]) is False
                    for p in (producer.get(a) for a in eqn.inputs))):
                found = None
            known[eqn] = found
        return known[eqn]
    return verdict


def _grow(kernel, producer, kinds, readers, unfused, needed, index, external, verdict,
          paths) -> None:
    """Fuse producers into `kernel`, latest first, while XLA would."""
    members = {kernel.root}
    reused = {kernel.root: False}  # members whose elements the kernel reads more than once
    copied = set()  # members fused as copies: the original still runs for other readers
    todo = []

    def push(member):
        for k, a in enumerate(member.inputs):
            p = producer.get(a)
            if p is not None:
                heapq.heappush(todo, (-index[p], index[member], k, p, member))

    def broadcast(a):
        return a in producer and producer[a].op in ("broadcast_in_dim", "iota")

    push(kernel.root)
    while todo:
        # Every member reading p is in by now (a reader comes after p in the schedule, so it
        # was popped first): decide p once, from all of them, whatever order they came in.
        _, _, k, p, member = heapq.heappop(todo)
        reads = [(member, k)]
        while todo and todo[0][3] is p:
            _, _, k, _, member = heapq.heappop(todo)
            reads.append((member, k))
        out = p.outputs[0] if len(p.outputs) == 1 else None
        if p in members:
            unfused[out].difference_update(m for m, _ in reads)
            continue
        reuse = any(opkinds.reuses(m, k) or reused[m] for m, k in reads)
        outside = out is not None and (out in external or p in needed or any(
            r not in members or r in copied for r in unfused[out]))  # fusing p copies it
        library = kinds[kernel.root] == "library"
        if library and out is not None and any(r not in members for r in readers[out]):
            outside = True  # formed before loop fusion: every reader must be in the kernel
        said = verdict(p)
        if out is not None and said is not True and (
                (said is False and kinds[p] in FUSIBLE and not library)
                or _fusible(p, kinds, readers, outside, reuse, external, broadcast, library,
                            paths)):
            members.add(p)
            reused[p] = reuse
            if outside:
                copied.add(p)
            kernel.eqns.append(p)
            unfused[out] -= members
            if kinds[p] == "tree":  # its reduce_window reads a materialised operand
                needed.update(producer[a] for a in p.inputs if a in producer)
            else:
                push(p)
        else:
            needed.add(p)


def _fusible(p, kinds, readers, outside, reuse, external, broadcast, library, paths) -> bool:
    """Whether XLA fuses producer `p` into a kernel (`outside`: p has readers outside it, so
    fusing duplicates it; `reuse`: the kernel reads p's elements more than once; `library`: the
    kernel is a YNNPACK reduction, which takes elementwise producers nothing else reads;
    `paths(p)`: every path from p to each of its readers runs through loop fusions alone)."""
    kind, out = kinds[p], p.outputs[0]
    if library:  # formed before loop fusion: p must have no other reader in the program
        return not outside and (
            (kind in ("cheap", "expensive") and p.op in opkinds.LIBRARY_ELEMENTWISE)
            or (kind == "dot" and opkinds.library_dot(p)))
    if kind not in FUSIBLE:
        return False
    expensive = kind != "cheap"
    if outside:
        if expensive and not opkinds.always_duplicated(p):
            return False
        if opkinds.shrinks(p, broadcast) and (out in external or not paths(p)):
            return False
    if expensive and reuse:
        return False
    if p.op == "concatenate" and len(p.inputs) > 8:
        return False
    return True


def _on_all_paths(producer, kinds, readers, index):
    """`paths(p)`: whether XLA may duplicate producer `p` into all of its readers
    (`CanFuseOnAllPaths` of `ComputeGloballyUnfusible`): every eqn on every path from p to a
    reader, the reader included, is one a loop fusion takes. A guard's `where(ok, new, old)`
    reads `new` directly and through `ok`, the tree reduction of `is_finite(new)` (a
    reduce_window no loop fusion takes): `new` is written once, to a buffer, not recomputed
    in both."""
    known: dict = {}

    def paths(p) -> bool:
        if p not in known:
            direct = readers[p.outputs[0]]
            last = max(index[r] for r in direct)
            below, frontier = {p}, [p]  # what p reaches, up to its last reader
            while frontier:
                for v in frontier.pop().outputs:
                    for r in readers.get(v, ()):
                        if r not in below and index[r] <= last:
                            below.add(r)
                            frontier.append(r)
            fine, seen, todo = True, set(), list(direct)
            while todo and fine:  # from each reader back to p, through what p reaches
                n = todo.pop()
                if n in seen:
                    continue
                seen.add(n)
                fine = kinds[n] in LOOP
                todo += [q for q in (producer.get(a) for a in n.inputs)
                         if q is not None and q is not p and q in below]
            known[p] = fine
        return known[p]
    return paths


def shareable(kernel: Kernel) -> bool:
    """A loop fusion may write its result over an operand it reads elementwise (same size)."""
    return kernel.root is not None and opkinds.kind(kernel.root) in ("cheap", "expensive")


IN_PLACE = frozenset({"dynamic_update_slice", "scatter", "scatter-add", "scatter_add",
                      "scatter-mul", "scatter_mul", "scatter-min", "scatter-max"})


def connect(found: list[Kernel], root, values: dict, kind_of) -> list[Value]:
    """Give each kernel its buffers: it writes its root's outputs (`kind_of(var)` says what kind
    of buffer each is) and reads whatever its eqns read from outside it. `values` maps every
    argument (and, on return, every materialised var) to its buffer. Returns the new buffers."""
    new = []
    for k in found:
        for v, size in zip(k.root.outputs, opkinds.output_bytes(k.root), strict=True):
            value = Value(v, size, kind_of(v), k)
            values[v] = value
            k.writes.append(value)
            new.append(value)
    for k in found:
        inside = {v for e in k.eqns for v in e.outputs}
        for e in k.eqns:  # as XLA fuses: the root, then each producer fused
            for a in e.inputs:
                a = root(a)
                if isinstance(a, Var) and a not in inside:
                    k.read(values[a])
    for k in found:
        k.shares = _shares(k, root, values)
    return new


def _reshaped(value: Value, root) -> bool:
    """Whether XLA writes `value` in another shape than its operands': its only reader is a dot
    that reshapes it to 2-D, so the bitcast is the root of the fusion writing it (a fusion writes
    over an operand of its own shape only)."""
    if len(value.readers) != 1 or value.readers[0].root is None:
        return False
    dot = value.readers[0].root
    return dot.op == "dot_general" and any(
        root(a) is value.var and opkinds.dot_reshapes(dot, i)
        for i, a in enumerate(dot.inputs[:2]))


def _shares(k: Kernel, root, values) -> list[tuple[Value, Value]]:
    eqn = k.root
    if eqn.op == "cond":  # XLA colocates an output with a branch's root, and a branch's
        # parameter with its operand: a branch returning its parameter writes over the operand
        found = []
        for i, out in enumerate(k.writes[:len(eqn.outputs)]):
            for branch in eqn.params["branches"]:
                result = branch.outputs[i]
                if result in branch.inputs:
                    operand = root(eqn.inputs[1 + branch.inputs.index(result)])
                    if operand in values:
                        found.append((out, values[operand]))
                    break
        return found
    if eqn.op in opkinds.LOOPS:
        first = {"scan": eqn.params.get("num_consts", 0),
                 "while": eqn.params.get("cond_nconsts", 0) + eqn.params.get("body_nconsts", 0)
                 }.get(eqn.op)
        if first is None:
            return []
        carry = eqn.params.get("num_carry", len(eqn.outputs)) if eqn.op == "scan" \
            else len(eqn.outputs)
        inits = eqn.inputs[first:first + carry]
        if eqn.op == "scan":  # and the ys into their stacks (`_ys_stacks`)
            inits += eqn.inputs[len(eqn.params["body"].inputs):]
        return [(out, values[root(a)]) for out, a in zip(k.writes, inits, strict=False)
                if root(a) in values]
    if eqn.op == "materialise":  # a conditional whose identity branch writes over its operand
        operand = root(eqn.inputs[0])
        return [(k.writes[0], values[operand])] if operand in values else []
    if eqn.op in IN_PLACE:
        # In place over its operand's buffer, unless the operand was fused into the kernel (a
        # broadcast of zeros: the backward of dynamic_slice), which then has no buffer to share.
        operand = root(eqn.inputs[0])
        return [(k.writes[0], values[operand])] if operand in values else []
    if shareable(k) and len(k.writes) == 1 and not _reshaped(k.writes[0], root):
        out = k.writes[0]
        return [(out, r) for r in k.reads if r.size == out.size and r.kind == "temp"]
    return []
