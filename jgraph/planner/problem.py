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
    built: dict = dataclasses.field(default_factory=dict, repr=False)  # graphs, by what they
    # are of: the search meets a plan again and again, and each graph it measures once

    @classmethod
    def of(cls, graph: Graph, base: str = "loops as traced") -> Problem:
        forward = Forward(graph)
        cut = stages(forward)
        return cls(graph, forward, cut, [forward.eqns[s.start:s.stop] for s in cut], base,
                   base_cost=recompute_flops(graph))

    def build(self, plan: Plan) -> Graph:
        if not plan.segments:
            return self.finished()
        key = (self.finish, plan.keep, plan.segments)  # what the graph depends on
        if key not in self.built:
            plan = dataclasses.replace(plan, keep=plan.keep | self.forward.constants)
            self.built[key] = self.finished(
                apply_regions(with_regions(self.graph, self.stage_eqns, plan)))
        return self.built[key]

    def finished(self, graph: Graph | None = None) -> Graph:
        """`graph` (the problem's own by default) as the step that runs: `finish` applied."""
        if graph is None:
            if self.finish not in self.built:
                self.built[self.finish] = self.finished(self.graph)
            return self.built[self.finish]
        return graph if self.finish is None else self.finish(graph)
