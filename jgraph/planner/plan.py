"""A plan, and the ordinary rematerialized graph it stands for.

A plan keeps a set of forward values from the forward (`keep`) and cuts the stages of the chain
(`jgraph.planner.chain`) into nested segments. Each segment becomes a checkpoint region over its
stages' eqns whose policy saves exactly `keep` (`jg.policies.SaveValues`), nested as the segments
are; `jgraph.regions.apply_regions` then emits the recompute eqns, as it does for the regions a user
writes with `jax.checkpoint`. Stages outside every segment are kept whole from the forward.

How a segment tree reads (DESIGN 4.2): a region's recompute runs when the backward first needs a
value of it, and computes the inputs of its child segments (the boundaries between them) and what
its stages outside the children need; a child again keeps only its inputs, outputs and `keep`. A
leaf segment of one stage recomputes, just before that stage's backward, what its backward reads.
Loop modes (`jgraph.planner.loops`) rewrite a scan's eqn first: a body policy, or a split into
nested scans.
"""

from __future__ import annotations

import dataclasses

from jgraph.ir import Graph, Region
from jgraph.policies import SaveValues
from jgraph.target import current

HAND = "hand: "  # the label of the plans that are hand arrangements
ON_GRAPH = "Checkmate on the graph: "  # ... and of schedules of the graph (`on_graph`)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Stages [start, stop) recomputed together from the boundary before `start`."""

    start: int
    stop: int
    children: tuple[Segment, ...] = ()  # segments inside it (covering it, or none: a leaf)

    def __str__(self):
        if not self.children:
            return f"[{self.start}-{self.stop})"
        return f"[{self.start}-{self.stop}: {' '.join(map(str, self.children))}]"


@dataclasses.dataclass(frozen=True)
class Plan:
    keep: frozenset  # forward values kept from the forward (by identity)
    segments: tuple[Segment, ...]  # top-level segments; stages outside them are kept whole
    cost: float = 0.0  # the model's recompute flops
    peak: int = 0  # the model's peak bytes
    label: str = ""  # how the plan was found ("chain DP", "MILP")
    base: str = "loops as traced"  # the loop mode of the joint graph it plans

    def describe(self) -> str:
        loops = "" if self.base == "loops as traced" else f"{self.base}; "
        if self.label.startswith(ON_GRAPH):  # no segments: the label says what it is
            return loops + self.label
        if self.label.startswith(HAND):  # an arrangement a user writes (`jgraph.planner.hand`)
            what = self.label.removeprefix(HAND)
            return what if not self.segments else (
                f"{what}: segments " + " ".join(str(s) for s in self.segments))
        if not self.segments:
            return loops + "no segments"
        return (f"{loops}{len(self.keep)} values kept, segments "
                + " ".join(str(s) for s in self.segments))


def depth(segment: Segment) -> int:
    return 1 + max((depth(c) for c in segment.children), default=0)


def with_regions(graph: Graph, stage_eqns, plan: Plan) -> Graph:
    """`graph` (regions stripped) with one checkpoint region per segment of `plan`.

    `stage_eqns[k]` lists the forward eqns of stage k. Planned for a TPU or a GPU
    (`jgraph.target.current`), a segment's backward reads recomputed copies of its outputs, as
    JAX's remat does, not the copies the forward keeps: there the kept ones are read by
    matrix products alone, which those compilers store in the products' input precision
    (bfloat16 at default precision), where a backward elementwise read would keep them in f32."""
    policy = SaveValues(frozenset(plan.keep))
    regions, path_of = [], {}
    recomputed = current().platform != "cpu"

    def visit(segment: Segment, parent, path):
        region = Region(len(regions), parent, policy, True,
                        f"planned stages {segment.start}-{segment.stop - 1}",
                        outputs_recomputed=recomputed)
        regions.append(region)
        path = path + (region.id,)
        for k in range(segment.start, segment.stop):
            path_of[k] = path
        for child in segment.children:
            visit(child, region.id, path)

    for segment in plan.segments:
        visit(segment, None, ())
    where = {e: path_of[k] for k, eqns in enumerate(stage_eqns) if k in path_of for e in eqns}
    eqns = tuple(dataclasses.replace(e, regions=where[e]) if e in where else e
                 for e in graph.eqns)
    return graph.replace(eqns=eqns, regions=tuple(regions))
