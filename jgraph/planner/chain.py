"""The forward of a joint graph seen as a chain of stages, the planner's model of it.

`Forward(graph)` reads a joint graph (from `jgraph.backward`, regions stripped): its top-level
forward eqns in schedule order, the values the backward reads from them (the residuals), and the
bytes of backward values (cotangents, gradients) alive at each step of the backward, which no
plan changes (`base`).

`stages(forward)` cuts the forward schedule where few bytes cross the cut (a *boundary*: the
values defined before the cut and read after it by forward eqns): between the layers of a
layered model, where only the hidden state crosses. Cuts whose boundary holds values the
backward does not read are avoided (holding them would be pure overhead). A loop is one eqn,
so a scan lies inside one stage. The forward is also cut exactly where a call of the user's
function begins (`call_starts`): a checkpoint around each call is what a user writes. At most
`max_stages` stages: more cuts are thinned out evenly by forward cost.

Per stage and keep set K (values kept from the forward), `Stage.measure(K)` gives what the
planner needs: the cost of *advancing* through the stage (computing its output boundary from its
input boundary), the cost and bytes of its *leaf* recompute (every value its backward reads that K
does not keep, recomputed from its input boundary just before its backward), and the bytes of
its values K keeps. The chain model is exact for chains of layers whose boundaries are disjoint;
it over-counts a value crossing several cuts (a skip connection) once per boundary held.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import cached_property

from jgraph.ir import Eqn, Graph, Literal, Var, sub_graphs
from jgraph.opkinds import nbytes
from jgraph.planner.cost import eqn_cost

MAX_STAGES = 64
CUT_SLACK = 1.5
VIEWS = frozenset({"reshape", "squeeze", "expand_dims"})  # a new shape of the same buffer


def is_forward(eqn: Eqn) -> bool:
    return not ({"backward", "recompute"} & eqn.tags)


class Forward:
    """The forward eqns of a joint graph, what the backward reads, and the backward's own bytes."""

    def __init__(self, graph: Graph):
        self.graph = graph
        # The forward: the eqns before the backward's first. Untagged eqns after it (an
        # optimizer step, accumulator updates) are no part of it: what they read is kept.
        first = next((i for i, e in enumerate(graph.eqns) if not is_forward(e)),
                     len(graph.eqns))
        self.eqns = [e for e in graph.eqns[:first] if is_forward(e)]
        tail = [e for e in graph.eqns[first:] if is_forward(e)]
        self.position = {e: k for k, e in enumerate(self.eqns)}
        self.producer: dict[Var, int] = {v: k for k, e in enumerate(self.eqns)
                                         for v in e.outputs}
        self.cost = [eqn_cost(e) for e in self.eqns]
        self.constants = self._constants()
        self.residuals = {a for e in graph.eqns if not is_forward(e) for a in e.inputs
                          if isinstance(a, Var) and a in self.producer
                          and a not in self.constants}
        self.outputs = {a for a in graph.outputs if isinstance(a, Var)} | {
            a for e in tail for a in e.inputs if isinstance(a, Var)}
        self.last_forward_read = self._last_forward_reads()
        self.reads, self.base = self._backward_profile()

    def _constants(self) -> set[Var]:
        """Values no plan needs to decide about: computed from literals alone, or a view of the
        graph's inputs (a reshape of a param: XLA aliases it, it is no buffer of its own, and
        recomputing it would copy the param). Plans keep them."""
        constant: set[Var] = set()
        inputs = set(self.graph.inputs)
        for e in self.eqns:
            if all(isinstance(a, Literal) or a in constant for a in e.inputs) or (
                    e.op in VIEWS and all(a in inputs or a in constant for a in e.inputs)):
                constant.update(e.outputs)
        return constant

    def _last_forward_reads(self) -> dict[Var, int]:
        last: dict[Var, int] = {}
        for k, e in enumerate(self.eqns):
            for a in e.inputs:
                if isinstance(a, Var) and a in self.producer:
                    last[a] = k
        for a in self.outputs:
            if a in self.producer:
                last[a] = len(self.eqns)
        return last

    def _backward_profile(self):
        """({forward value: (first, last) schedule index of the backward eqns reading it};
        for each schedule index, bytes of backward-made values alive there)."""
        graph, made_by_forward = self.graph, set(self.producer)
        final = {a for a in graph.outputs if isinstance(a, Var)}  # not intermediates
        last: dict[Var, int] = {}
        for i, e in enumerate(graph.eqns):
            for a in e.inputs:
                if isinstance(a, Var):
                    last[a] = i
        reads: dict[Var, tuple[int, int]] = {}
        alive, base, ending = 0, [], {}
        for i, e in enumerate(graph.eqns):
            if not is_forward(e):
                for a in e.inputs:
                    if isinstance(a, Var) and a in made_by_forward:
                        reads[a] = (reads.get(a, (i, i))[0], i)
                for v in e.outputs:
                    if v not in final and last.get(v, i) > i:
                        alive += nbytes(v.aval)
                        ending.setdefault(last[v], []).append(v)
            base.append(alive)
            alive -= sum(nbytes(v.aval) for v in ending.pop(i, ()))
        return reads, base


@dataclasses.dataclass
class Stage:
    """Forward eqns [start, stop) of the schedule, between two cuts."""

    forward: Forward
    start: int
    stop: int
    boundary_in: frozenset[Var]  # values crossing the cut before the stage
    boundary_out: frozenset[Var]  # values crossing the cut after it

    @cached_property
    def values(self) -> list[Var]:
        f = self.forward
        return [v for e in f.eqns[self.start:self.stop] for v in e.outputs
                if v not in f.constants]

    @cached_property
    def out_bytes(self) -> int:
        return sum(nbytes(v.aval) for v in self.boundary_out)

    def measure(self, keep) -> StageCost:
        """Costs and bytes of the stage when the values in `keep` are kept from the forward."""
        f = self.forward
        mine = set(self.values)
        needed = self._closure([v for v in self.values if v in f.residuals
                                and v not in keep and v not in self.boundary_out], keep, mine)
        advance = self._closure([v for v in self.boundary_out if v in mine and v not in keep],
                                keep, mine)
        recomputing = {f.producer[v] for v in needed | advance}
        read = {a for k in recomputing for a in f.eqns[k].inputs if isinstance(a, Var)}
        kept = [v for v in self.values if v in keep and v not in self.boundary_out
                and (v in f.residuals or v in read)]
        whole = [v for v in self.values if v in f.residuals and v not in self.boundary_out]
        # Its output boundary is held while the later stages run, and read by its backward.
        held = {v for v in self.boundary_out if v in mine and v in f.residuals}
        return StageCost(
            advance=sum(f.cost[k] for k in {f.producer[v] for v in advance}),
            leaf=sum(f.cost[k] for k in {f.producer[v] for v in needed}),
            leaf_peak=self._peak(needed | set(kept) | held, needed),
            kept_bytes=sum(nbytes(v.aval) for v in kept),
            whole_peak=self._peak(set(whole) | held, set()),
            whole_bytes=sum(nbytes(v.aval) for v in whole))

    def _peak(self, alive: set, recomputed: set) -> int:
        """Most bytes alive while the stage's backward runs: backward-made values, the values
        of `alive` up to their last backward reader, the `recomputed` ones from the moment
        they are recomputed (just before the first backward reader of any of them), and those
        only the recompute reads at that moment."""
        f = self.forward
        spans = [f.reads[v] for v in self.values if v in f.reads]
        if not spans:
            return 0
        begin, end = min(a for a, _ in spans), max(b for _, b in spans)
        at = min((f.reads[v][0] for v in recomputed if v in f.reads), default=begin)
        delta, transient = [0] * (end - begin + 2), 0
        for v in alive:
            size = nbytes(v.aval)
            if v in recomputed and v not in f.reads:
                transient += size
                continue
            first, last = f.reads.get(v, (begin, at))
            first = at if v in recomputed else begin
            delta[first - begin] += size
            delta[last - begin + 1] -= size
        peak = running = 0
        for i in range(begin, end + 1):
            running += delta[i - begin]
            peak = max(peak, running + f.base[i])
            if i == at:
                peak = max(peak, running + transient + f.base[max(at - 1, 0)])
        return peak

    @cached_property
    def read_by(self) -> set[Var]:
        """Values of the stage that another of its values' producers reads."""
        f = self.forward
        return {a for e in f.eqns[self.start:self.stop] for a in e.inputs
                if isinstance(a, Var) and a in f.producer and self.start <= f.producer[a]}

    def _closure(self, wanted, keep, mine) -> set[Var]:
        """`wanted` and the values of the stage they are computed from, up to kept values."""
        f, found, todo = self.forward, set(), list(wanted)
        while todo:
            v = todo.pop()
            if v in found:
                continue
            found.add(v)
            for a in f.eqns[f.producer[v]].inputs:
                if isinstance(a, Var) and a in mine and a not in keep and a not in found:
                    todo.append(a)
        return found


@dataclasses.dataclass(frozen=True)
class StageCost:
    advance: float  # flops to compute the output boundary from the input boundary
    leaf: float  # flops to recompute what the stage's backward reads and `keep` does not hold
    leaf_peak: int  # peak bytes of the stage's backward with that recompute (and what `keep`
    # holds of the stage), backward-made values included
    kept_bytes: int  # bytes the keep set holds from the forward until the stage's backward
    whole_peak: int  # peak bytes of the stage's backward when the stage is kept whole
    whole_bytes: int  # bytes the backward reads of the stage, all kept from the forward


def frontier_bytes(forward: Forward):
    """For each cut after forward eqn k: (bytes crossing it, bytes crossing that the backward
    does not read, the crossing values)."""
    f, alive, out = forward, {}, []
    for k, e in enumerate(f.eqns):
        for v in e.outputs:
            if v in f.last_forward_read and v not in f.constants:
                alive[v] = f.last_forward_read[v]
        for v in [v for v, last in alive.items() if last <= k]:
            del alive[v]
        crossing = frozenset(alive)
        total = sum(nbytes(v.aval) for v in crossing)
        extra = sum(nbytes(v.aval) for v in crossing if v not in f.residuals)
        out.append((total, extra, crossing))
    return out


def stages(forward: Forward, max_stages: int = MAX_STAGES) -> list[Stage]:
    """The forward cut into stages at its cheapest cuts (see the module docstring).

    Cuts with only cheap (fusible) eqns between them form a valley, of which the cut with the
    fewest bytes (those the backward does not read counted twice) is the valley's best: between
    two layers of a chain, after the nonlinearity whose output the backward reads anyway. A
    valley's best cut is kept when no more bytes cross it than `CUT_SLACK` times the (lower)
    median valley's best (layers whose boundaries differ by a key or a bias are all cut).
    (The median of all cuts would be set by the loss: a softmax cross-entropy is a dozen cheap
    eqns on small logits, which outnumber a residual block's cuts and put every cut between
    blocks above the median.)"""
    n = len(forward.eqns)
    fronts = frontier_bytes(forward)
    best = valley_cuts(forward, fronts)
    cuts = []
    if best:
        totals = sorted(fronts[k][0] for k in best)
        threshold = CUT_SLACK * totals[(len(totals) - 1) // 2]  # the lower median
        cuts = [k + 1 for k in best if fronts[k][0] <= threshold]
        # and where a call of the user's functions begins (one layer each, whatever crosses)
        cuts = sorted(set(cuts) | set(call_starts(forward.eqns)[1:]))
    if len(cuts) + 1 > max_stages:
        cuts = thinned(forward, cuts, max_stages - 1)
    bounds = [0] + cuts + [n]
    result = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        before = fronts[a - 1][2] if a > 0 else frozenset()
        after = fronts[b - 1][2] if b < n else frozenset(
            v for v in forward.outputs if v in forward.producer)
        result.append(Stage(forward, a, b, before, after))
    return result


def call_starts(eqns) -> list[int]:
    """Indices of the eqns where a call of a user's function begins: an eqn's `source` names the
    function whose line made it; a call begins where that function changes, or where its first
    eqn of all (op and line) comes again (the next call of a layer function)."""
    starts, first, before = [], {}, None
    for i, e in enumerate(eqns):
        fn = _function(e.source)
        if fn != before:
            first.setdefault(fn, (e.op, e.source))
            starts.append(i)
        elif first.get(fn) == (e.op, e.source):
            starts.append(i)
        before = fn
    return starts


def _function(source: str) -> str:
    """The function named in an eqn's `source` ("file:line:col (function)"); "" if none."""
    return source[source.rfind("(") + 1:-1] if source.endswith(")") else ""


def valley_cuts(forward: Forward, fronts=None) -> list[int]:
    """The best cut of each valley (`stages`): k, for a cut after forward eqn k. Between two
    contractions or loops there is one (`jgraph.planner.on_graph` cuts there too)."""
    fronts = frontier_bytes(forward) if fronts is None else fronts
    best, valley = [], []
    for k in range(len(forward.eqns) - 1):
        if valley and expensive(forward.eqns[k]):
            best.append(_best_cut(fronts, valley))
            valley = []
        if fronts[k][0] > 0:
            valley.append(k)
    if valley:
        best.append(_best_cut(fronts, valley))
    return best


def expensive(eqn: Eqn) -> bool:
    """A contraction or a loop: what separates the valleys of cheap cuts."""
    return eqn.op in ("dot_general", "conv_general_dilated") or bool(sub_graphs(eqn))


def _best_cut(fronts, valley: list[int]) -> int:
    return min(reversed(valley), key=lambda k: fronts[k][0] + fronts[k][1])


def thinned(forward: Forward, cuts: list[int], keep: int) -> list[int]:
    """`keep` of `cuts`, spread evenly over the forward's cost."""
    at = list(itertools.accumulate(forward.cost))
    total = max(at[-1], 1e-30)
    chosen, want = [], 1
    for c in cuts:
        if at[c - 1] >= want * total / (keep + 1) and len(chosen) < keep:
            chosen.append(c)
            want = int(at[c - 1] * (keep + 1) / total) + 1
    return chosen
