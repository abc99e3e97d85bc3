"""Where XLA:CPU puts each buffer, on a schedule: the temp bytes its buffer assignment needs.

Replays `buffer_assignment.cc` on the kernels of a program in XLA's order. A buffer lives from
the kernel writing it to the last kernel reading it (a result, to the end). Allocations that
exist before temps are placed: each donated argument a result is written into (holding the
argument until its last reader, the result from its writer on) and each result that is not
aliased. XLA places buffers largest first, each into the first of these it fits without
overlapping what is already there (the allocations of the buffers its writer reads first, then
the smallest): so a donated parameter XLA copied early holds activations until its update is
written. The other temps go to the heap, where a kernel writing elementwise over an operand that
dies there reuses its slot; the temp size is the heap's peak of live bytes, each buffer aligned
to 64 bytes but the top one, plus whatever a kernel needs only while it runs (a loop body's own
peak).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from jgraph.memory.program import IN_PLACE, Kernel, Value, shareable
from jgraph.opkinds import ALIGN


class Allocation:
    """A donated argument's or a result's allocation: values at offset 0, live ranges apart."""

    __slots__ = ("size", "starts", "spans")

    def __init__(self, size: int):
        self.size = size
        self.starts: list[int] = []  # sorted
        self.spans: list[tuple[int, int, Value]] = []  # (start, end, value), sorted by start

    def add(self, value: Value) -> None:
        i = bisect.bisect(self.starts, value.start)
        self.starts.insert(i, value.start)
        self.spans.insert(i, (value.start, value.end, value))

    def fits(self, value: Value) -> bool:
        if value.size > self.size:
            return False
        i = bisect.bisect(self.starts, value.start)
        if i > 0:  # the span starting before: must end before this one starts
            start, end, other = self.spans[i - 1]
            if end > value.start or (end == value.start and not _in_place(other, value)):
                return False
        if i < len(self.spans):
            start, end, other = self.spans[i]
            if start < value.end or (start == value.end and not _in_place(value, other)):
                return False
        return True


def _in_place(old: Value, new: Value) -> bool:
    """`new` is written, in place, by the kernel that reads `old` last (a loop's output over
    its initial value among them: a scan's stack over the zeros it starts as)."""
    k = new.kernel
    return k is not None and old in k.reads and (
        shareable(k) or (k.root is not None and k.root.op in IN_PLACE)
        or (new, old) in k.shares)


@dataclass
class Placement:
    peak: int  # temp bytes: the heap's peak, plus workspaces
    peak_step: int  # index in the order where it is reached (-1: nothing runs)
    live: list[int]  # per step of the order: temp bytes live while it runs
    hidden: list[Value]  # temps held in donated arguments' or results' allocations
    at_peak: list[Value]  # heap temps live at the peak


def place(order: list[Kernel], values: list[Value], aliased, results) -> Placement:
    end = len(order)
    pos = {k: i for i, k in enumerate(order)}
    returned = set(results)
    live_values = []
    for v in values:
        if v.kernel is not None and v.kernel not in pos:
            continue  # written by a kernel XLA removes
        v.start = -1 if v.kernel is None else pos[v.kernel]
        v.end = max((pos[r] for r in v.readers if r in pos), default=v.start)
        if v in returned or v.kind in ("output", "state"):
            v.end = end
        v.home = None
        live_values.append(v)
    hidden = _reuse_allocations(live_values, aliased, end, _post_order(results))
    return _heap(order, live_values, hidden)


def _post_order(results) -> dict:
    """Each kernel's and argument's place in XLA's instruction post order, which orders buffers
    of one size: a depth-first walk from the result tuple, each kernel after its operands,
    operands in order (`HloComputation::MakeInstructionPostOrder`)."""
    position: dict = {}
    for v in results:
        if v in position or v.kernel in position:
            continue
        if v.kernel is None:
            position[v] = len(position)
            continue
        position[v.kernel] = -1  # on the stack
        stack = [(v.kernel, iter(v.kernel.reads))]
        while stack:
            k, operands = stack[-1]
            for operand in operands:
                p = operand.kernel
                if p is None:
                    position.setdefault(operand, len(position))
                elif p not in position:
                    position[p] = -1
                    stack.append((p, iter(p.reads)))
                    break
            else:
                stack.pop()
                position[k] = len(position)
    return position


def _reuse_allocations(values, aliased, end, post: dict[Kernel, int]) -> list[Value]:
    allocations: list[Allocation] = []
    home: dict[Value, Allocation] = {}
    last = len(post)
    for arg, result in aliased:
        if result.kernel is None:
            continue
        a = Allocation(arg.size)
        a.add(arg)
        if result.start > arg.end:
            a.add(result)
        else:  # written by the kernel reading the argument last: in place, never free
            a.spans[-1] = (arg.start, end, arg)
        allocations.append(a)
        home[arg] = home[result] = a
    for v in values:
        if v.kind == "output" and v.kernel is not None and v not in home:
            a = Allocation(v.size)
            a.add(v)
            allocations.append(a)
            home[v] = a
    if not allocations:
        return []
    # XLA tries the allocations made before a buffer from the last made: the smallest, and of
    # one size the latest in its order of buffers (post order: an argument's by its parameter)
    made = [min(post.get(v, last) if v.kernel is None else post.get(v.kernel, last)
                for _, _, v in a.spans) for a in allocations]
    by_size = sorted(range(len(allocations)), key=lambda i: (allocations[i].size, -made[i]))
    allocations = [allocations[i] for i in by_size]
    index = {a: i for i, a in enumerate(allocations)}
    sizes = np.array([a.size for a in allocations])
    # occupied[i, t]: allocation i holds a value at step t (t = -1 .. end, shifted by one);
    # held[i, t]: how many of the steps before t it is occupied (so a range is one difference)
    occupied = np.zeros((len(allocations), end + 2), bool)
    for i, a in enumerate(allocations):
        for start, stop, _ in a.spans:
            occupied[i, start + 1:stop + 2] = True
    held = np.zeros((len(allocations), end + 3), np.uint16 if end + 3 < 2**16 else np.int64)
    np.cumsum(occupied, axis=1, out=held[:, 1:])
    placed = []
    temps = sorted((v for v in values if v.kind == "temp"),
                   key=lambda v: (-v.size, post.get(v.kernel, last), v.start))
    for t in temps:
        first = [home[r] for r in t.kernel.reads if r in home]
        chosen = next((a for a in first if a.fits(t)), None)
        if chosen is None:  # the smallest free over the temp's life (or whose next value is
            # written at its end by its last reader, in place; one ending at its start is the
            # writer's operand, tried above), of those from `low` on, large enough
            low = int(np.searchsorted(sizes, t.size))
            inside = held[low:, max(t.end, t.start + 1)] == held[low:, t.start + 1]
            at_end = occupied[low:, t.end + 1]
            clear = np.flatnonzero(inside & ~at_end)
            stop = low + clear[0] if len(clear) else len(allocations)
            for i in low + np.flatnonzero(inside[:stop - low] & at_end[:stop - low]):
                if allocations[i].fits(t):
                    stop = i
                    break
            chosen = allocations[stop] if stop < len(allocations) else None
        if chosen is not None:
            chosen.add(t)
            i = index[chosen]
            occupied[i, t.start + 1:t.end + 2] = True
            np.cumsum(occupied[i], out=held[i, 1:])
            home[t] = chosen
            t.home = chosen
            placed.append(t)
    return placed


def _heap(order: list[Kernel], values: list[Value], hidden: list[Value]) -> Placement:
    hidden = set(hidden)
    heap = [v for v in values if v.kind == "temp" and v not in hidden]
    born: dict[int, list[Value]] = {}
    dying: dict[int, list[Value]] = {}
    for v in heap:
        born.setdefault(v.start, []).append(v)
        dying.setdefault(v.end, []).append(v)
    in_heap = set(heap)
    alive: set[Value] = set()
    slot_of: dict[Value, Value] = {}  # a value writing over an operand -> that operand
    current, live, peak, peak_step = 0, [], 0, -1
    paddings = [0] * ALIGN  # alive buffers by alignment padding: the top one's is not paid
    for i, k in enumerate(order):
        taken = set()
        for out, operand in k.shares:
            if out in in_heap and out not in slot_of and operand in alive and operand.end == i \
                    and operand not in taken and out.heap_size == operand.heap_size \
                    and out.start == i:
                taken.add(operand)
                slot_of[out] = operand
        for v in born.get(i, ()):
            alive.add(v)
            paddings[v.heap_size - v.size] += 1
            if v not in slot_of:
                current += v.heap_size
        top = next((p for p in range(ALIGN - 1, 0, -1) if paddings[p]), 0)
        now = current - top + k.workspace
        live.append(now)
        if now > peak:
            peak, peak_step = now, i
        for v in dying.get(i, ()):
            alive.discard(v)
            paddings[v.heap_size - v.size] -= 1
            if v not in taken:  # else its slot goes on in the value written over it
                current -= v.heap_size
    at_peak = []
    if peak_step >= 0:
        at_peak = [v for v in heap if v.start <= peak_step <= v.end]
    return Placement(peak, peak_step, live, sorted(hidden, key=lambda v: v.start), at_peak)
