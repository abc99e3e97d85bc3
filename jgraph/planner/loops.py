"""Loop modes: what a scan body saves, and splitting a scan into nested scans.

The chain model sees a loop as one eqn whose cost is its body's times its length and whose values
are what it stacks for the backward. What the loop stacks is decided when `jgraph.backward`
linearizes it, from the forward graph; so each mode here is the joint graph derived again from a
rewritten forward graph (the graph `backward` recorded in `info["backward_of"]`):

- "loops as traced": the body saves what its own checkpoint regions say (everything, without);
- "loop bodies keep their inputs": `nothing_saveable` inside every body (a scan stacks its carries
  and recomputes one iteration in each backward iteration: per-layer checkpointing);
- "loop bodies keep contractions": `dots_saveable` inside every body;
- "scans split in two" (and with bodies keeping their inputs): every scan of length L on the
  gradient path becomes an outer scan of L/k iterations over a checkpointed inner scan of k
  iterations, k the divisor of L nearest sqrt(L): the outer scan stacks L/k carries, and each
  backward iteration of it runs the inner scan again, so the memory of L iterations shrinks to
  about 2 sqrt(L) (a 256-layer scanned model fits budgets per-layer checkpointing cannot).

- "scans keeping every k-th carry" (k the integer nearest sqrt(L), 1.5 or 2 sqrt(L)): every scan's
  body keeps its inputs, and when those are carries the forward keeps only every k-th iteration's
  and each backward iteration recomputes its carries from the nearest kept ones (up to k-1
  forward iterations, (k-1)/2 on average; `jgraph.vjp_rules.scan_restart`): L/k carries, below
  what nested scans reach (a 64-layer scan: 4 or 8 carries, against 16 for "split in two").

- "cond branches planned to 50% (25%) of their peak", "... to their least memory": each cond's
  branches, forward and backward, planned like straight-line code (`planned_branch`): a cond
  marked `plan_fraction=f` returns what its branch's plan keeps (branches share the slots), and
  its backward recomputes the plan's segments.

The planner plans each mode's graph and keeps the cheapest plan that fits.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jgraph import policies
from jgraph.builder import Builder
from jgraph.ir import Eqn, Graph, Region, Var
from jgraph.opkinds import nbytes
from jgraph.planner import fast
from jgraph.planner.problem import Problem


def has_loops(graph: Graph) -> bool:
    return any(e.op in ("scan", "cond") for e in graph.eqns)


def modes(forward: Graph) -> dict[str, tuple[Graph, object]]:
    """{mode: (forward graph, loop policy)} (see the module docstring)."""
    found = {"loops as traced": (forward, None),
             "loop bodies keep their inputs": (forward, policies.nothing_saveable),
             "loop bodies keep contractions": (forward, policies.dots_saveable)}
    split = split_scans(forward)
    if split is not forward:
        found["scans split in two"] = (split, None)
        found["scans split in two, bodies keeping their inputs"] = (
            split, policies.nothing_saveable)
        thrice = split_scans(forward, levels=3)
        if thrice is not forward:
            found["scans split in three, bodies keeping their inputs"] = (
                thrice, policies.nothing_saveable)
    for times, name in ((1, "sqrt L"), (1.5, "1.5 sqrt L"), (2, "2 sqrt L")):
        kept = keep_every(forward, times)
        if kept is not forward:
            found[f"scans keeping every k-th carry, k = {name}"] = (kept, None)
    for fraction in BRANCH_FRACTIONS:
        planned = _marked(forward, "cond", plan_fraction=fraction)
        if planned is not forward:
            found["cond branches planned to their least memory" if fraction == 0 else
                  f"cond branches planned to {fraction:.0%} of their peak"] = (planned, None)
    return found


BRANCH_FRACTIONS = (0.5, 0.25, 0.0)


def _marked(graph: Graph, op: str, **params) -> Graph:
    """`graph` with `params` added to each of its top-level `op` eqns."""
    if not any(e.op == op for e in graph.eqns):
        return graph
    return graph.replace(eqns=tuple(
        dataclasses.replace(e, params={**e.params, **params}) if e.op == op else e
        for e in graph.eqns))


def planned_branch(joint: Graph, fraction: float) -> Graph:
    """A cond branch's joint graph (forward and backward) planned like straight-line code: the
    fast planner's cheapest plan within `fraction` of the branch's peak without a plan, in the
    planner's chain model (or its least-memory plan), applied. A branch runs once, so what its
    plan keeps is what the cond returns for its backward, and its segments are recomputed
    there."""
    if all(e.tags & {"backward", "recompute"} for e in joint.eqns):
        return joint
    problem = Problem.of(joint)
    high = sum(nbytes(v.aval) for e in joint.eqns for v in e.outputs) + 1
    planner = fast.FastPlanner(problem.stages, high)
    least = planner.smallest()
    if least is None:
        return joint
    budget = max(fraction * _unplanned_peak(planner, least[0], high), least[0])
    plan = min(planner.plans(budget), key=lambda p: p.cost, default=least[1])
    return problem.build(plan) if plan.segments else joint


def _unplanned_peak(planner, low: float, high: float) -> float:
    """The least budget (bytes of the chain model) at which the planner's cheapest plan costs
    what it costs without a memory limit: the branch's peak without remat, as the model sees
    it (a bisection)."""
    def cost(budget):
        return min((p.cost for p in planner.plans(budget)), default=float("inf"))

    free = cost(high)
    for _ in range(24):
        mid = (low + high) / 2
        low, high = (low, mid) if cost(mid) <= free * (1 + 1e-9) else (mid, high)
    return high


def keep_every(graph: Graph, times: float = 1) -> Graph:
    """`graph` with each top-level scan of length 4 or more marked `keep_every=k`, k the integer
    nearest `times` sqrt(length) (at most length - 1): its backward keeps every k-th carry and
    recomputes the others from it (`jgraph.vjp_rules.scan_restart`)."""
    eqns, changed = [], False
    for eqn in graph.eqns:
        length = eqn.params.get("length", 0) if eqn.op == "scan" else 0
        if length >= 4:
            k = min(max(2, round(times * length**0.5)), length - 1)
            eqn = dataclasses.replace(eqn, params={**eqn.params, "keep_every": k})
            changed = True
        eqns.append(eqn)
    return graph.replace(eqns=tuple(eqns)) if changed else graph


def split_factor(length: int, levels: int = 2) -> int | None:
    """The divisor of `length` nearest its `levels`-th root: the length of the scan nested
    inside (None: no split worth making)."""
    if length < 2**levels:
        return None
    root = length ** ((levels - 1) / levels)
    divisors = [k for k in range(2, length) if length % k == 0]
    return min(divisors, key=lambda k: abs(k - root), default=None)


def split_scans(graph: Graph, levels: int = 2) -> Graph:
    """`graph` with each top-level scan that can be split replaced by `levels` nested scans."""
    renamed: dict[Var, Var] = {}
    eqns, changed = [], False

    def read(a):
        return renamed.get(a, a) if isinstance(a, Var) else a

    for eqn in graph.eqns:
        if any(isinstance(a, Var) and a in renamed for a in eqn.inputs):
            eqn = _with_inputs(eqn, tuple(read(a) for a in eqn.inputs))
        k = split_factor(eqn.params["length"], levels) if eqn.op == "scan" else None
        if k is None:
            eqns.append(eqn)
            continue
        new, outputs = split_scan(eqn, k, levels)
        eqns += new
        renamed.update(zip(eqn.outputs, outputs, strict=True))
        changed = True
    if not changed:
        return graph
    return graph.replace(eqns=tuple(eqns), outputs=tuple(read(a) for a in graph.outputs))


def _with_inputs(eqn: Eqn, inputs) -> Eqn:
    return dataclasses.replace(eqn, inputs=inputs)


def split_scan(eqn: Eqn, k: int, levels: int = 2) -> tuple[list[Eqn], list]:
    """(eqns computing `eqn`'s outputs with an outer scan of length/k over a checkpointed inner
    scan of k iterations, itself split into `levels - 1` nested scans; the atoms standing for
    `eqn`'s outputs)."""
    p = eqn.params
    length, nc, nk = p["length"], p["num_consts"], p["num_carry"]
    outer_length = length // k
    b = Builder(tags=eqn.tags, regions=eqn.regions, source=eqn.source)
    ins = eqn.inputs
    chunks = [b.call(jnp.reshape, x, shape=(outer_length, k, *x.aval.shape[1:]))[0]
              for x in ins[nc + nk:]]
    body_in = tuple(Var(a.aval) for a in ins[:nc + nk]) + tuple(
        Var(c.aval.update(shape=c.aval.shape[1:])) for c in chunks)
    inner = Builder(regions=(0,), source=eqn.source)
    inner_out = inner.bind("scan", *body_in, body=p["body"], length=k, reverse=p["reverse"],
                           num_consts=nc, num_carry=nk, unroll=p.get("unroll", 1))
    region = Region(0, None, None, True, f"split scan: {k} iterations", eqn.source)
    outer_body = Graph(inputs=body_in, eqns=tuple(inner.eqns), outputs=tuple(inner_out),
                       input_roles=("data",) * len(body_in),
                       output_roles=("aux",) * len(inner_out), regions=(region,))
    if levels > 2:
        outer_body = split_scans(outer_body, levels - 1)
    outs = b.bind("scan", *ins[:nc + nk], *chunks, body=outer_body, length=outer_length,
                  reverse=p["reverse"], num_consts=nc, num_carry=nk, unroll=1)
    ys = [b.call(jnp.reshape, y, shape=(length, *y.aval.shape[2:]))[0] for y in outs[nk:]]
    return b.eqns, outs[:nk] + ys
