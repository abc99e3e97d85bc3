"""The arrangements a user writes by hand, named from the graph's own structure: the planner's
floor.

A user checkpoints each layer (`jax.checkpoint(layer)`, with one of JAX's policies), or a scan's
body (`lax.scan(jax.checkpoint(body))`), or nests scans. The search (`search`) adds each of
these to its plan space as a candidate, so that its least plan is never above them and a
budget one of them meets is always met:
- *layers*: the forward's stages merged at their narrowing boundaries. A boundary is kept when
  no more new bytes cross it (values made since the boundary before) than cross the one
  before: between two layers, where only the new hidden state crosses, never inside a layer,
  where a wide intermediate crosses (a feed-forward block's hidden, which the chain's stages
  may cut at when long skips make every cut wide). One segment per layer, each keeping what a
  policy saves: nothing (`nothing_saveable`), the contractions (`dots_saveable`) or the
  contractions without batch dimensions (`dots_with_no_batch_dims_saveable`);
- *loop modes as they are*: a loop mode with no plan around it is `scan(checkpoint(body))` with
  the mode's policy, nested scans, or a scan keeping every k-th carry.
"""

from __future__ import annotations

from jgraph import policies
from jgraph.opkinds import nbytes
from jgraph.planner.chain import call_starts, expensive
from jgraph.planner.plan import HAND, Plan, Segment
from jgraph.planner.problem import Problem

# (name, policy) of the per-layer arrangements, in the order JAX's docs list them.
LAYER_POLICIES = (("nothing saved", policies.nothing_saveable),
                  ("contractions saved", policies.dots_saveable),
                  ("contractions without batch dims saved",
                   policies.dots_with_no_batch_dims_saveable))


def layer_segments(problem: Problem) -> list[tuple[Segment, ...]]:
    """Ways to cut the forward into one segment per layer (the module docstring): at the
    boundaries crossed by no more bytes than the one before, and, where those are not evenly
    spaced (a layer's pattern broken where long skips end), every p stages from the first such
    boundary, p their most common spacing. [] when the forward is one stage."""
    n = len(problem.stages)
    if n < 2:
        return []
    # boundary k: after stage k. A layer ends where the boundary narrows (or stays as narrow),
    # not inside it, where a wide intermediate crosses. Only the values made since the boundary
    # before count: a long skip, crossing every boundary between its ends, does not.
    crossing = new_bytes([s.boundary_out for s in problem.stages[:-1]])
    first = crossing[1] if len(crossing) > 1 else crossing[0]
    minima = [k + 1 for k, b in enumerate(crossing)
              if b <= (crossing[k - 1] if k > 0 else first)]
    found = [minima]
    gaps = [b - a for a, b in zip(minima, minima[1:], strict=False)]
    if gaps:
        period = max(sorted(set(gaps)), key=gaps.count)
        periodic = list(range(minima[0] % period or period, n, period))
        if periodic != minima:
            found.append(periodic)
    for calls in (call_cuts(problem), call_cuts(problem, first_in_valley=True)):
        if calls and calls not in found:
            found.append(calls)
    return [tuple(Segment(a, b) for a, b in zip([0, *cuts], [*cuts, n], strict=False))
            for cuts in found]


def call_cuts(problem: Problem, first_in_valley: bool = False) -> list[int]:
    """Stage boundaries where one call of a user's function ends and the next begins
    (`chain.call_starts`): what "one layer" means in the user's code, whatever the skip's form
    (a decoder reading its skip through a concatenation keeps no narrowing boundary). Each is
    snapped to the nearest stage boundary (a stage cut lies in the cheap eqns around it).
    `first_in_valley`: of the calls beginning between two contractions, only the first (a
    layer's own helper, such as the lambda adding its skip, is part of that layer)."""
    bounds = [s.start for s in problem.stages[1:]]
    eqns = problem.forward.eqns
    starts = call_starts(eqns)[1:]
    if first_in_valley:
        starts = [i for j, i in zip([0, *starts], starts, strict=False)
                  if any(expensive(e) for e in eqns[j:i])]
    if not bounds or not starts:
        return []
    return sorted({min(range(len(bounds)), key=lambda k: abs(bounds[k] - i)) + 1
                   for i in starts})


def new_bytes(boundaries: list[frozenset]) -> list[int]:
    """Per boundary, the bytes of the values crossing it that did not cross the one before."""
    return [sum(nbytes(v.aval) for v in here - before)
            for before, here in zip([frozenset(), *boundaries], boundaries, strict=False)]


def saved_by(problem: Problem, policy) -> frozenset:
    """The forward values `policy` saves (what `jax.checkpoint(policy=...)` would keep)."""
    return frozenset(v for e in problem.forward.eqns if policies.saves(policy, e)
                     for v in e.outputs)


def arrangements(by_mode: dict[str, Problem]) -> list[Plan]:
    """The hand arrangements of every loop mode (see the module docstring), as plans: the
    per-layer ones on the loops as traced, each other mode as it is."""
    found = []
    for mode, problem in by_mode.items():
        if mode != "loops as traced":  # scan(checkpoint(body)), nested scans, keep_every
            found.append(Plan(frozenset(), (), label=f"{HAND}{mode}, no plan around it", base=mode))
            continue
        seen = set()
        for segments in layer_segments(problem):
            for name, policy in LAYER_POLICIES:
                keep = saved_by(problem, policy)
                if (keep, segments) not in seen:  # a policy saving what another saves: once
                    seen.add((keep, segments))
                    found.append(Plan(keep, segments,
                                      label=f"{HAND}a checkpoint per layer, {name}", base=mode))
    return found
