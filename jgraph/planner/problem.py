"""`Problem`: a joint graph without regions (in one loop mode), cut into stages, and the graph a
plan of it stands for. The planner's loop modes (`loops`) and its search (`search`) read it."""

from __future__ import annotations

import dataclasses

from jgraph.ir import Graph
from jgraph.planner.chain import Forward, stages
from jgraph.planner.cost import recompute_flops
from jgraph.planner.plan import Plan, with_regions
from jgraph.regions import apply_regions


@dataclasses.dataclass
class Problem:
    """A joint graph without regions (in one loop mode), cut into stages."""

    graph: Graph
    forward: Forward
    stages: list
    stage_eqns: list
    base: str
    planner: object = None  # the FastPlanner (or exact planner) set up for this problem
    base_cost: float = 0.0  # what the loop mode recomputes itself, inside loop bodies
    finish: object = None  # Graph -> Graph applied to every graph a plan stands for (None: none)

    @classmethod
    def of(cls, graph: Graph, base: str = "loops as traced") -> Problem:
        forward = Forward(graph)
        cut = stages(forward)
        return cls(graph, forward, cut, [forward.eqns[s.start:s.stop] for s in cut], base,
                   base_cost=recompute_flops(graph))

    def build(self, plan: Plan) -> Graph:
        if not plan.segments:
            return self.finished()
        plan = dataclasses.replace(plan, keep=plan.keep | self.forward.constants)
        return self.finished(apply_regions(with_regions(self.graph, self.stage_eqns, plan)))

    def finished(self, graph: Graph | None = None) -> Graph:
        """`graph` (the problem's own by default) as the step that runs: `finish` applied."""
        graph = self.graph if graph is None else graph
        return graph if self.finish is None else self.finish(graph)
