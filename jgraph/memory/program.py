"""A graph as XLA:CPU runs it: kernels (fusions) reading and writing materialised buffers.

The eqns are the graph's as XLA sees them before fusion (`jgraph.memory.flatten`).
`kernels(eqns, ...)` replays XLA's
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

from jgraph import opkinds
from jgraph.ir import Eqn, Var
from jgraph.opkinds import aligned

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
