"""The order XLA:CPU runs kernels in: its default scheduler, breadth first.

XLA:CPU schedules each computation with `BFScheduler` (`hlo_memory_scheduler.cc`; the default
since `xla_cpu_enable_concurrency_optimized_scheduler` is on): a queue starts with the arguments
and every instruction without operands (the parameters first, then the constants); an
instruction joins the queue when its last operand leaves it, readers in the order they were
created. So a kernel reading constants alone (a zero-filled stack a scan writes its outputs
into) joins the queue after the kernels the arguments alone made ready (the copy of a donated
argument): it may then take the argument's allocation, free once copied. So everything runs
as early as its inputs allow: a parameter's copy first, each layer's weight gradient and its
update as soon as the cotangent reaching the layer exists. Here the graph's order stands for
XLA's creation order.
"""

from __future__ import annotations

from collections import deque

from jgraph import opkinds
from jgraph.memory.program import Kernel, Value


def bfs_order(kernels: list[Kernel], arguments: list[Value], results) -> list[Kernel]:
    """The kernels in XLA's order; kernels nothing returned depends on are dropped, as XLA's
    dead code elimination drops them."""
    live = _needed(kernels, results)
    pending: dict[Kernel, int] = {}
    readers: dict[object, list[Kernel]] = {}
    for k in kernels:
        if k not in live:
            continue
        sources = list(dict.fromkeys(v.kernel if v.kernel is not None else v for v in k.reads))
        pending[k] = len(sources)
        for s in sources:
            readers.setdefault(s, []).append(k)
    for rs in readers.values():
        rs.sort(key=creation)
    queue = deque(a for a in arguments)
    queue.append(_CONSTANTS)  # the constants, after the parameters: their readers
    readers[_CONSTANTS] = sorted((k for k in kernels if k in live and pending[k] == 0),
                                 key=creation)
    for k in readers[_CONSTANTS]:
        pending[k] = 1
    order = []
    while queue:
        node = queue.popleft()
        if isinstance(node, Kernel):
            order.append(node)
        for r in readers.get(node, ()):
            pending[r] -= 1
            if pending[r] == 0:
                queue.append(r)
    return order


_CONSTANTS = object()  # stands for the program's constants in XLA's queue (`bfs_order`)


def creation(k: Kernel) -> tuple:
    """Where XLA creates the instruction of a kernel, which orders an operand's readers: the
    program's own instructions (library calls, copies) in program order, then the YNNPACK
    fusions, then the loop fusions, which the fusion pass makes from the last consumer to the
    first, then the single ops it wraps, in program order."""
    if k.root is None:
        return (0, k.order)
    kind = opkinds.kind(k.root)
    if kind in LOOP_KINDS:
        return (2, -k.order) if len(k.eqns) > 1 else (3, k.order)
    if kind == "library" or (kind == "dot" and opkinds.library_dot(k.root)):
        return (1, k.order)
    return (0, k.order)


LOOP_KINDS = frozenset({"cheap", "expensive", "reduce", "tree", "expanded"})


def _needed(kernels: list[Kernel], results) -> set[Kernel]:
    needed = set()
    todo = [v.kernel for v in results if v.kernel is not None]
    while todo:
        k = todo.pop()
        if k in needed:
            continue
        needed.add(k)
        todo.extend(v.kernel for v in k.reads if v.kernel is not None)
    return needed
