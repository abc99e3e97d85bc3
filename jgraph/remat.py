"""`jg.remat`: rematerialize a joint forward + backward graph (DESIGN §4.2).

`remat(gb)` applies the checkpoint regions recorded while tracing (`jax.checkpoint`,
`jgraph.checkpoint`); `remat(gb, policy=...)` puts the whole forward in one more region, with the
policy seen through loops (the graph is derived again by `jgraph.backward` with the policy inside
its loop bodies); `remat(gb, budget=...)` plans its own regions (`jgraph.planner`). The engine
that rematerializes regions is `jgraph.regions` (how a value is kept or recomputed is described
there); this module sits above it, the planner and the backward pass it drives, as JAX's public
`checkpoint` (`ad_checkpoint.py`) sits above the machinery it drives.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass, field

from jgraph.backward import rederived
from jgraph.check import validate
from jgraph.chunk import chunk_rows
from jgraph.errors import BudgetWarning, TransformError
from jgraph.fuse import STATE_OF, fuse_updates, with_grads, without_grads
from jgraph.ir import Eqn, Graph
from jgraph.planner import cache as plans
from jgraph.planner import remat_under_budget
from jgraph.planner import validate as planner_validate
from jgraph.planner.least import least_of, pooled
from jgraph.planner.search import confirm, deferred, forward_and_tail, step_rewritten
from jgraph.planner.validate import predicted_no_larger, xla_temp
from jgraph.regions import LOOPS, apply_regions, is_forward, without_regions
from jgraph.target import Target, measuring_on, resolve

CHUNKS = 8  # the loss head's chunks of rows, when the planner tries them
# A chunk of fewer rows runs its contractions on thin matrices, slowly (an 8-level U-Net MLP at
# batch 256: its decoder in chunks of 32 rows, 1.54x the step's time, where a plan meeting the
# same budget without chunks took 1.02x): such chunks are planned only when nothing else fits.
SMALL_CHUNK_ROWS = 256


def remat(graph: Graph, policy=None, *, budget=None, planner: str = "auto",
          chunks: int | None = CHUNKS, target=None) -> Graph:
    """Rematerialize a joint graph: its checkpoint regions, one policy, or a plan under a budget.

    Args:
        graph: a joint graph from `jg.backward` (or a training step built on one).
        policy: a `jg.policies` / `jax.checkpoint_policies` policy: puts the whole forward in one
            more region (inside loop bodies too). None: only the regions the graph recorded
            (`jax.checkpoint`, `jg.checkpoint`) are applied.
        budget: plans regions itself instead: bytes of the figure that bounds the compiled donated
            step on `target` (its temp on CPU, its HBM need on TPU, its peak on GPU:
            `jgraph.target`), or a percentage string such as `"50%"` of no remat's figure.
        planner: `"auto"`, `"exact"` or `"fast"` (`jgraph.planner`): dynamic programming, then a
            MILP for a cheaper plan (`"auto"`: up to 500 eqns, 10 s).
        chunks: with a budget, the loss head (and attention and token-wise MLPs) over `chunks`
            chunks of rows is an option the planner weighs (`jg.chunk_rows`), and 4x and 16x
            as many while nothing fits with fewer (the fewest that fit are taken: a thinner
            chunk is slower); None: never. The chunked head's sums differ from the whole
            head's in their order, within 1e-6 normwise.
        target: the chip the plan is measured on: a local device, a topology's device for
            ahead-of-time work, a Sharding or a Mesh, or a platform name; None: the default
            backend's device.

    Returns:
        The rematerialized `Graph`: checkpoint regions whose policies say what the forward keeps,
        and the recompute eqns they imply. With a budget, `info["remat"]` reports the plan:
        `plan` (in words), `planner` and `used` (which planner found it), `budget` and
        `budget_given`, `no_remat_temp`, `xla_temp` (the figure compiled for the plan),
        `estimated_peak` and `model_temp` (the memory model's), `confirmed` (how the plan was
        checked), `recompute_flops`, `recomputed_eqns`, `retries`, `planning_seconds`,
        `xla_seconds`, `target` and `figure`; and where they apply `fused` and `chunked` (what
        was fused or chunked), `milp` (the exact planner's outcome) and `unmet` (a percentage no
        plan reached).

    Raises:
        TransformError: not a joint graph, both `policy` and `budget`, or a byte budget no plan
            reaches (naming the smallest figure a plan reaches, and that plan).

    Warns:
        BudgetWarning: a percentage no plan reaches: the plan reaching the least is returned."""
    validate(graph, "jg.remat")
    if "grad" not in graph.output_roles and not any("backward" in e.tags for e in graph.eqns):
        raise TransformError("remat needs a joint forward + backward graph: apply jg.backward "
                             "first (this graph has no grad output and no eqn tagged 'backward')")
    if budget is not None:
        if policy is not None:
            raise TransformError("remat: give either policy= or budget=, not both")
        with measuring_on(target) as where:
            return _recorded(_kept_plan(graph, budget, planner, chunks, None, where), graph)
    if target is not None:
        resolve(target)  # (a bad target is an error however it is used)
    if planner != "auto":
        raise TransformError(f"remat(planner={planner!r}) chooses how a budget is planned: give "
                             "budget= too")
    if chunks != CHUNKS:
        raise TransformError(f"remat(chunks={chunks!r}) is an option of a budget's plan: give "
                             "budget= too")
    given = graph
    if policy is not None and _loops(graph):
        graph = _with_policy_in_loops(graph, policy)
    return _recorded(apply_regions(graph, policy), given)


def _recorded(plan: Graph | None, given: Graph) -> Graph | None:
    """`plan` with the graph it is a plan of (`info["unplanned"]`: what `jg.memory(plan,
    target=...)` calibrates its model on)."""
    if plan is None:
        return plan
    return plan.replace(info={**plan.info, "unplanned": without_regions(given)})


def planned_then(graph: Graph, then, *, budget, planner: str = "auto",
                 chunks: int | None = CHUNKS, target=None) -> Graph:
    """`remat(graph, budget=...)` of the step that runs `then(graph)` (Graph -> Graph: what the
    caller appends to every graph, such as the non-finite guard of `jg.Optimizer`): `then` is
    applied to each graph the planner measures and to the one returned, and a percentage is of
    `then(graph)`'s figure without remat."""
    validate(graph, "jg.remat")
    with measuring_on(target) as where:
        return _kept_plan(graph, budget, planner, chunks, then, where)


def _kept_plan(graph: Graph, budget, planner: str, chunks: int | None, then,
               target: Target) -> Graph:
    """The plan `_planned` makes, or the one it made before of the same graph, budget and kind
    of target (`jgraph.planner.cache`: in the process, and on disk when a directory is named);
    a kept plan that met no percentage warns again, and says where it was found
    (`info["remat"]["cached"]`)."""
    key = plans.key(graph, None if then is None else then(graph), budget, planner, chunks,
                    target)
    found = plans.get(key)
    if found is not None:
        kept, where = found
        if kept.warning is not None:
            warnings.warn(kept.warning, stacklevel=3)
        return kept.plan.replace(info={**kept.plan.info, "remat": {
            **kept.plan.info["remat"], "cached": where}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BudgetWarning)
        plan = _on_target(_planned(graph, budget, planner, chunks, then), target)
    warned = next((w.message for w in caught if issubclass(w.category, BudgetWarning)), None)
    if plan is not None:
        info = {k: v for k, v in plan.info.items() if k != "unplanned"}
        plans.put(key, plans.Kept(plan.replace(info=info), warned))
    for w in caught:  # given again as they came, the budget's at the caller's call
        if issubclass(w.category, BudgetWarning):
            warnings.warn(w.message, stacklevel=3)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return plan


def _on_target(graph: Graph, target: Target) -> Graph:
    """`info["remat"]` says which target the plan was measured on and which figure it bounds."""
    if graph is None or "remat" not in graph.info:
        return graph
    return graph.replace(info={**graph.info, "remat": {
        **graph.info["remat"], "target": target.describe(), "figure": target.figure}})


def _loops(graph: Graph) -> list[Eqn]:
    """Forward loops and conds on the gradient path (their backward is a loop or a cond too)."""
    bwd = {e.op for e in graph.eqns if "backward" in e.tags}
    return [e for e in graph.eqns if is_forward(e) and e.op in LOOPS and e.op in bwd]


def _with_policy_in_loops(graph: Graph, policy) -> Graph:
    """`graph` derived again by `jg.backward` with `policy` inside its loop bodies (a policy sees
    through loops, as `jax.checkpoint`'s does through `lax.scan`)."""
    again = rederived(graph, policy)
    if again is None:
        raise TransformError(
            "remat(policy=...) of a graph with loops needs the graph jg.backward returned (the "
            "policy applies inside loop bodies, which backward builds): apply remat right after "
            "backward, before other transforms")
    return again


# -- below what recomputation reaches ------------------------------------------------------------
def _planned(graph: Graph, budget, planner: str, chunks: int | None, then=None) -> Graph:
    """The plan under `budget` over a plan space beyond recomputation: a step graph's updates
    are fused where their gradients are made (`jg.fuse_updates`, in every graph the planner
    measures), and the loss head of a graph `jg.backward` returned, run over chunks of rows
    (`jg.chunk_rows`), is an option beside the graph as it is, tried when the graph as it is
    needs a plan, and so, when neither meets the budget, is that graph with attention over
    blocks of queries and the regions inside its loops' bodies chunked too.
    Of the options that meet the budget the one recomputing least is returned (then the
    smaller temp); when none does, the one reaching the least temp, with its warning or
    error. Each attempt's plan is weighed on the model and only the one taken is compiled
    (`jgraph.planner.search.deferred`); where that compile misses the budget, that attempt is
    planned again confirming its own plan (its model corrected by the compile), the others'
    plans kept, and the choice made again. `info["remat"]` says what was fused and chunked. A
    step left without its grads (`without_grads`) is planned as the step with them, whose loop
    modes the planner derives, and each graph measured leaves them out again; a percentage is
    of the step as given."""
    given, reference = graph, None
    finish = _fused(then) if any(r in STATE_OF for r in graph.output_roles) else None
    restored = with_grads(graph)
    if restored is not None:  # a step without its grads: planned with them, left out after
        graph, finish = restored[0], _dropping(restored[1], finish)
    if then is not None:  # the step that runs: `then` last
        finish = _then(finish, then)
    if restored is not None or then is not None:  # a percentage of the step given, as it runs
        given = without_regions(given)
        reference = xla_temp(given if then is None else then(given))
    finish = _memo(finish)
    unplanned = without_regions(graph)  # one compile calibrates the model for every attempt
    made = _Made()
    compiling = 0.0
    with pooled() as pool:  # the least plans of every attempt, compiled together at the end
        while True:
            results, counts = _attempts(graph, budget, planner, chunks, finish, reference,
                                        unplanned, pool, made)
            fitting = [r for r in results if _fits(r)]
            fitting = [r for r in fitting
                       if not _small_chunks(r[0].info["remat"].get("chunked") or ())] or fitting
            if not fitting:
                break
            taken = min(fitting, key=lambda r: (r[0].info["remat"]["recompute_flops"],
                                                r[0].info["remat"]["xla_temp"]))
            started = time.perf_counter()
            confirmed = confirm(taken[0])
            compiling += time.perf_counter() - started
            if confirmed is not None:
                return _timed(confirmed, results + [(None, None, None, 0, 0.0, compiling)])
            missed = next(key for key, r in made.attempts.items() if r is taken)
            made.confirming.add(missed)
            del made.attempts[missed]
    if pool:  # the least plans the model put least over every attempt, compiled together
        results = [r for r in results if r[0] is None] + [_least_pooled(pool)]
    least = min(results, key=lambda r: r[3])
    graph_, problem = least[:2]
    graph_ = None if graph_ is None else _timed(graph_, results)
    if problem is not None and (least is not results[0] if not pool
                                else graph_ is not None and "chunked" in graph_.info["remat"]):
        count = _chunks_of(graph_, least, results, counts)
        said = type(problem)(f"{problem}; reached with the loss head over chunks of rows "
                             f"(jg.chunk_rows, chunks={count})")  # which graph it is of
        if hasattr(problem, "least_temp"):
            said.least_temp = problem.least_temp
        problem = said
    if isinstance(problem, BudgetWarning):
        warnings.warn(problem, stacklevel=3)
        return graph_
    if problem is None:  # (the least plan compiled meets the budget after all)
        return graph_
    raise problem


@dataclass
class _Made:
    """What `_planned`'s passes over its attempts share, by chunks asked for (None: the graph
    as it is): each attempt's tuple, each chunked rewrite, and the attempts that confirm their
    own plan (their deferred plan missed)."""

    attempts: dict = field(default_factory=dict)
    rewrites: dict = field(default_factory=dict)
    confirming: set = field(default_factory=set)


def _attempts(graph: Graph, budget, planner: str, chunks: int | None, finish, reference,
              unplanned: Graph, pool: list, made: _Made):
    """(`_attempt`'s tuples, {their place: chunks asked for}) of the graph as it is and of its
    chunked rewrites (`_planned`), each made once (`made`): deferred
    (`jgraph.planner.search.deferred`) unless its deferred plan missed."""
    def attempt(key, *args):
        if key not in made.attempts:
            with contextlib.nullcontext() if key in made.confirming else deferred():
                made.attempts[key] = _attempt(graph, budget, planner, finish, reference, *args)
        return made.attempts[key]

    counts = {}
    results = [attempt(None, None, None, unplanned)]
    if results[0][0] is not None and results[0][0].info["remat"]["plan"] == "no remat" \
            and results[0][1] is None:
        return results, counts
    # the head and the token-wise MLPs in chunks; then attention in blocks and the regions
    # inside the loops' bodies too, while every plan that fits recomputes (a chunk of whole
    # examples costs less time than recomputing a layer); then a layer's whole body (scanned
    # or written out) over chunks of examples; then all of them over more chunks, each count
    # only while nothing fits with fewer (a chunk's contractions thinner, slower: the fewest
    # chunks that fit are taken)
    found = 0
    for count, more in _chunk_attempts(chunks):
        if more and (any(_fits(r) and not _recomputes(r) for r in results)
                     or count > chunks and any(_fits(r) for r in results)):
            break  # (planned only when they may save time or memory)
        if (count, more) not in made.rewrites:
            made.rewrites[count, more] = _chunked(graph, count, more)
        chunked = made.rewrites[count, more]
        if chunked is None or (count, len(chunked.info["chunk_rows"]["regions"])) == found:
            continue
        found = (count, len(chunked.info["chunk_rows"]["regions"]))
        if _small_chunks(chunked.info["chunk_rows"]["regions"]) and _fits(results[0]):
            continue  # (small chunks are taken only when nothing else fits: not planned)
        reference = reference or xla_temp(unplanned)  # a share of the given
        before = len(pool)
        results.append(attempt((count, more), _rows_in_chunks(count, more), chunked,
                               unplanned))
        counts[len(results) - 1] = count
        if len(pool) > before:  # its least plans: say what is chunked, if one is taken
            pool[-1].info["chunked"] = chunked.info["chunk_rows"]["regions"]
            pool[-1].info["chunks"] = count
    return results, counts


def _fits(result) -> bool:
    """Whether an attempt (`_attempt`) found a plan meeting the budget (not a least plan the
    model ranked, waiting for its compile: `jgraph.planner.least.pooled`)."""
    return result[0] is not None and result[1] is None \
        and result[0].info["remat"].get("confirmed") != "pooled"


def _recomputes(result) -> bool:
    """Whether an attempt's plan recomputes values (`_attempt`'s tuple)."""
    return bool(result[0].info["remat"].get("recompute_flops"))


def _least_pooled(pool):
    """`_attempt`'s tuple for the least plan over every attempt's (`least_of`): its compiles'
    seconds counted as compiling."""
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BudgetWarning)
        graph = least_of(pool)
    warned = next((w.message for w in caught if issubclass(w.category, BudgetWarning)), None)
    spent = time.perf_counter() - started
    return graph, warned, None, graph.info["remat"]["xla_temp"], 0.0, spent


MORE_CHUNKS = (4, 16)  # times `chunks`: the counts tried after it while nothing fits
# What a chunked attempt runs over chunks (`more`): the head and the token-wise MLPs; and
# attention in blocks and the regions inside loop bodies; and, in their place, a layer's whole
# body (scanned or written out) over chunks of examples where it computes each example alone
HEAD, NETWORK, LAYERS = 0, 1, 2


def _chunk_attempts(chunks: int | None) -> list[tuple[int, int]]:
    """`(count, more)` of each chunked attempt, in order (`_planned`): `chunks` at each level of
    `more`, then more chunks at the last."""
    if chunks is None:
        return []
    return [(chunks, HEAD), (chunks, NETWORK), (chunks, LAYERS)] + [
        (chunks * k, LAYERS) for k in MORE_CHUNKS]


def _chunks_of(graph: Graph | None, least, results: list, counts: dict) -> int | None:
    """The chunks asked for by the attempt the least plan (`graph`, `least` of `results`) is of."""
    if graph is not None and "chunks" in graph.info["remat"]:  # (pooled: `least_of`)
        return graph.info["remat"]["chunks"]
    return counts.get(next(i for i, r in enumerate(results) if r is least))


def _small_chunks(regions) -> bool:
    """Does one of `regions` (`info["chunk_rows"]["regions"]`) run over chunks of fewer than
    `SMALL_CHUNK_ROWS` rows?"""
    for region in regions:
        if region["kind"] == "blocks":  # (its rows are its end's shape, features included)
            continue
        rows = region["rows"]
        per_chunk = math.prod(rows) // rows[region["axis"]] * region["chunk_rows"]
        if per_chunk < SMALL_CHUNK_ROWS:
            return True
    return False


def _timed(graph: Graph, results) -> Graph:
    """`graph` with `planning_seconds` and `xla_seconds` summed over every attempt made."""
    if len(results) == 1:
        return graph
    return graph.replace(info={**graph.info, "remat": {
        **graph.info["remat"], "planning_seconds": sum(r[4] for r in results),
        "xla_seconds": sum(r[5] for r in results)}})


def _attempt(graph: Graph, budget, planner: str, finish, reference: int | None = None,
             rederive=None, chunked: Graph | None = None, calibrated_by: Graph | None = None):
    """(the planned graph or None, the BudgetWarning or TransformError it met or None, the
    error when there is no graph, the least temp reached, the seconds planning and the seconds
    compiling it took). `rederive`: the rewrite (the loss head in chunks) planned in every loop
    mode; `chunked`: `graph` as traced, rewritten; `calibrated_by`: the unplanned graph whose
    compile calibrates the model (`remat_under_budget`)."""
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BudgetWarning)
        try:
            planned = remat_under_budget(graph, budget, planner, finish, reference, rederive,
                                         calibrated_by)
        except TransformError as e:
            if not hasattr(e, "least_temp"):  # not the planner's "no plan fits"
                raise
            spent, compiling = time.perf_counter() - started, planner_validate.seconds
            return None, e, e, e.least_temp, spent - compiling, compiling
    warned = next((w.message for w in caught if issubclass(w.category, BudgetWarning)), None)
    for w in caught:
        if not issubclass(w.category, BudgetWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    report = planned.info["remat"]
    if chunked is not None:
        planned = planned.replace(info={**planned.info, "remat": {
            **report, "chunked": chunked.info["chunk_rows"]["regions"]}})
    spent, compiling = time.perf_counter() - started, planner_validate.seconds  # this planning's
    return planned, warned, None, report.get("xla_temp") or 0, spent - compiling, compiling


def _dropping(placeholder: bool, finish):
    """`finish` after leaving out the grads (`without_grads`): the planner's loop modes are
    derived with the grads, which the step as given does not return."""
    def finished(graph: Graph) -> Graph:
        graph = without_grads(graph, placeholder=placeholder)
        return graph if finish is None else finish(graph)

    return finished


def _then(finish, then):
    """`finish`, then `then`."""
    def finished(graph: Graph) -> Graph:
        return then(graph if finish is None else finish(graph))

    return finished


def _memo(finish):
    """`finish`, computed once per graph (the planner finishes each mode's graph many times)."""
    if finish is None:
        return None
    done: dict = {}

    def finished(graph: Graph) -> Graph:
        if id(graph) not in done:  # the graph is kept with its result: its id stays its own
            done[id(graph)] = (graph, finish(graph))
        return done[id(graph)][1]

    return finished


def _fused(then=None):
    """Graph -> Graph: a step with its updates fused where its gradients are made, only when
    the fused step, run with `then` after it, takes no more of the budget's figure (within the
    model's error it is taken, uncompiled: it never holds the stacked gradient): where the step
    returns its gradients, or a guard keeps the old state beside the new, the stacked gradient
    stays and the moved update may cost more (a 16-layer scanned MLP's adam step returning its
    gradients: 918 KB fused against 754 KB). Decided once, on the first graph fused (the step
    as given, before any plan: the planner finishes hundreds of graphs), by the model
    calibrated on the unfused step, which a percentage compiles anyway
    (`planner.validate.predicted_no_larger`); the fused step then records that step
    (`info["unfused_step"]`), which calibrates the search's model too, so the fused twin is not
    compiled. `info["remat"]["fused"]` lists the params whose update moved."""
    decided = []  # [bool] once the fused step has been weighed against its unfused twin
    run = (lambda g: g) if then is None else then

    def fused(graph: Graph) -> Graph:
        if decided and decided[0] is False:
            return graph
        try:
            moved_graph = fuse_updates(graph)
        except TransformError:
            return graph
        moved = [path for path, r in moved_graph.info["fuse_updates"].items() if r.get("fused")]
        if not moved:
            return graph
        if not decided:
            unfused = run(graph)
            decided.append(predicted_no_larger(run(moved_graph), unfused))
            decided.append(unfused)
        if decided[0] is False:
            return graph
        return moved_graph.replace(info={**moved_graph.info, "unfused_step": decided[1],
                                         "remat": {**moved_graph.info.get("remat", {}),
                                                   "fused": moved}})

    return fused


def _chunked(graph: Graph, chunks: int, more: int = LAYERS) -> Graph | None:
    """The graph `jg.backward` returned (and the update appended since, if any) with its loss
    head over chunks of rows, or None when it has none worth chunking or was changed otherwise."""
    if forward_and_tail(graph)[0] is None:
        return None
    chunked = step_rewritten(graph, _rows_in_chunks(chunks, more))
    return chunked if chunked.info.get("chunk_rows", {}).get("regions") else None


def _rows_in_chunks(chunks: int, more: int = LAYERS):
    """Graph -> Graph: a joint graph with its loss head over `chunks` chunks of rows
    (`jg.chunk_rows`; with `more` from `NETWORK`, attention over blocks of queries and the
    regions inside loop bodies too; at `LAYERS`, a layer's whole body, scanned or written out,
    over chunks of examples in their place), unchanged where it has none; applied in every
    loop mode the planner derives, so a scanned model's scan modes hold the chunked head
    too."""
    def rederive(joint: Graph) -> Graph:
        try:
            return chunk_rows(joint, chunks=chunks, attention=more >= NETWORK,
                              loops=more >= NETWORK, examples=more >= LAYERS)
        except TransformError:
            return joint

    return rederive
