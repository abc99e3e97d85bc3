"""`jg.remat(graph, budget=...)`: plan what to keep and what to recompute so that the compiled
donated step fits a memory budget at the least recompute cost.

The pieces, one concept per module:
- `cost`: what recomputing an eqn costs (flops; fused elementwise ops almost nothing);
- `chain`: the forward as a chain of stages between cheap cuts (the planner's memory model);
- `plan`: a plan (values kept, nested segments) and the ordinary graph it stands for: checkpoint
  regions whose policy saves exactly the kept values, rematerialized by `jgraph.regions`;
- `fast`: nested checkpointing by dynamic programming (Revolve/Rotor) and knapsack keep sets;
- `exact`: the same plan space solved exactly as a MILP (`scipy.optimize.milp`, HiGHS);
- `loops`: what a scan body saves, and splitting a scan into nested scans;
- `validate`: budgets, and the temp XLA allocates for a plan;
- `dag`: `Dag` and `schedule`, rematerialization of any DAG of costed nodes (Checkmate's
  problem): a greedy schedule and the exact MILP; `replay` checks and measures a schedule;
- `on_graph`: the joint graph coarsened into such a DAG (contractions as nodes), scheduled, and
  the schedule read back as recompute eqns (`planner="exact"` weighs it against the plans);
- `search` (here): plan on the model, check the plan's `jg.memory` estimate, compile it, and when
  XLA allocates more than the budget, tighten the model's target and plan again.
"""

from __future__ import annotations

from jgraph.planner.dag import Dag, Schedule, replay, schedule
from jgraph.planner.search import PLANNERS, remat_under_budget

__all__ = ["PLANNERS", "Dag", "Schedule", "remat_under_budget", "replay", "schedule"]
