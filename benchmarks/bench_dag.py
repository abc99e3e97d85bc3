"""`jg.planner.schedule` on MOCCASIN's published graphs (issue 27's bar).

MOCCASIN (Bartan et al., ICML 2023; repository haoming-codes/moccasin, GPL-3.0, so nothing of it
is vendored here) publishes its benchmark graphs as networkx node-link JSON in its `data/`
folder: random layered graphs of 100 to 1000 nodes (node keys `name`, `out_cost` for memory,
`duration` for cost, edges under the keys "0" and "1", the topological order in
`graph["order"]`) and Checkmate's training graphs (node keys `id`, `cost_ram`, `cost_cpu`, edges
`source`/`target`; the order is networkx's `topological_sort`, reproduced by `_nx_order`).
Give the folder with `--data` (e.g. `git archive HEAD data` of a clone, extracted).

Each graph runs at 90% and 80% of its topological peak (MOCCASIN's budgets: the ceiling of the
fraction). A row: nodes, budget, then jgraph (`solver="auto"`) and the Checkmate MILP (the same
MILP with no bound from the fast schedule and no fallback, HiGHS, `--milp-seconds`), each as its
cost increase over computing every node once and its solve time, then MOCCASIN's when
`--moccasin FILE` gives them (JSON rows {"graph", "fraction", "seconds", "status", "schedule"}: the
file name without ".json", the budget fraction, and MOCCASIN's schedule as its computes in order,
as a local run of MOCCASIN wrote them). Every schedule is checked by `jg.planner.replay`,
MOCCASIN's too (`sequence_events`).

    python -m benchmarks.bench_dag --data FOLDER [--milp-seconds 60] [--time-limit 30]
                                   [--moccasin FILE] [graph name substrings ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import jgraph as jg
from jgraph.planner.dag import _Milp, _milp_size, _peak, _stage_events

GRAPHS = (  # the graphs of MOCCASIN's paper (its README's runs)
    "random_layered_n100_w0.27_nlv0.75_ed0.2_scd0.14.json",
    "random_layered_n250_w0.43_nlv0.75_ed0.2_scd0.14.json",
    "random_layered_n500_w0.36_nlv0.75_ed0.2_scd0.14.json",
    "random_layered_n1000_w0.31_nlv0.75_ed0.2_scd0.14.json",
    "ResNet50 (MLSys)_256_(224, 224, 3)_train_nx.json",
    "fcn_8_vgg (MLSys)_32_(416, 608, 3)_train_nx.json",
)
FRACTIONS = (0.9, 0.8)
MILP_MAX = 1_000_000  # the Checkmate column skips MILPs of more variables (about) than this


def _nx_order(nodes: list, links: list) -> list:
    """networkx's `topological_sort`: Kahn's algorithm by generations, nodes and successors in
    insertion order."""
    succs = {v: [] for v in nodes}
    indegree = dict.fromkeys(nodes, 0)
    for u, v in links:
        if v not in succs[u]:
            succs[u].append(v)
            indegree[v] += 1
    generation = [v for v in nodes if indegree[v] == 0]
    order = []
    while generation:
        order += generation
        following = []
        for u in generation:
            for v in succs[u]:
                indegree[v] -= 1
                if indegree[v] == 0:
                    following.append(v)
        generation = following
    return order


def load(path: Path) -> jg.planner.Dag:
    """A MOCCASIN data file as a `Dag` (see the module docstring for the two formats)."""
    data = json.loads(Path(path).read_text())
    key = "id" if "id" in data["nodes"][0] else "name"
    nodes = [node[key] for node in data["nodes"]]
    memory = {n[key]: n["cost_ram"] if "cost_ram" in n else n["out_cost"] for n in data["nodes"]}
    cost = {n[key]: n["cost_cpu"] if "cost_cpu" in n else n["duration"] for n in data["nodes"]}
    links = [(e["source"], e["target"]) if "source" in e else (e["0"], e["1"])
             for e in data["links"]]
    order = data["graph"].get("order") or _nx_order(nodes, links)
    return jg.planner.Dag(memory=memory, cost=cost, edges=links, order=order)


def sequence_events(dag, sequence) -> list:
    """The events of a schedule given as its computes in order, MOCCASIN's form: a compute reads
    the latest compute of each input, and each value is freed after its last reader (the
    outputs' last computes are kept)."""
    preds = {v: [] for v in dag.order}
    for u, v in dag.edges:
        preds[v].append(u)
    latest, last_reader = {}, {}
    for j, v in enumerate(sequence):
        for u in preds[v]:
            last_reader[latest[u]] = j
        latest[v] = j
    kept = {latest[o] for o in dag.outputs if o in latest}
    events = []
    frees_after = {}
    for j, v in enumerate(sequence):
        events.append(("compute", v))
        if j not in kept:
            frees_after.setdefault(last_reader.get(j, j), []).append(v)
        events += [("free", u) for u in frees_after.pop(j, [])]
    return events


def exact_only(dag, budget, seconds):
    """The Checkmate MILP alone: (cost, seconds, status), or None with a reason."""
    ix = dag._ix
    if _milp_size(ix) > MILP_MAX:
        return None, f"MILP too big (~{_milp_size(ix):.2g} vars)"
    milp = _Milp(ix, budget)
    start = time.monotonic()
    stages, status, _ = milp.solve(seconds)
    elapsed = time.monotonic() - start
    if stages is None:
        return None, "infeasible" if status == 2 else f"none in {elapsed:.0f}s"
    events = _stage_events(ix, stages)
    measured = jg.planner.replay(dag, events)
    if measured.peak > budget or _peak(ix, stages) != measured.peak:
        return None, f"MILP schedule peaks at {measured.peak} > {budget}"
    return (measured.cost, elapsed, "optimal" if status == 0 else "time limit"), ""


def rows_for(folder: Path, names=(), milp_seconds=60.0, time_limit=30.0, moccasin=None,
             milp=True) -> list[dict]:
    reference = {}
    if moccasin:
        for row in json.loads(Path(moccasin).read_text()):
            reference[row["graph"], float(row["fraction"])] = row
    rows = []
    for file in GRAPHS:
        if names and not any(n in file for n in names):
            continue
        path = Path(folder) / file
        if not path.exists():
            print(f"# {file}: not in {folder}", file=sys.stderr)
            continue
        dag = load(path)
        top, base = dag.topological_peak(), dag.total_cost
        for fraction in FRACTIONS:
            budget = math.ceil(top * fraction)
            sch = jg.planner.schedule(dag, budget, time_limit=time_limit)
            measured = jg.planner.replay(dag, sch.events)
            assert measured.peak == sch.peak <= budget and measured.cost == sch.cost
            row = {"graph": file.split("_nx")[0].split("_w0")[0], "nodes": len(dag.order),
                   "fraction": fraction, "budget": budget,
                   "jgraph": 100 * (sch.cost / base - 1), "jgraph_s": sch.seconds,
                   "solver": f"{sch.solver}/{sch.status}"}
            if milp:
                found, why = exact_only(dag, budget, milp_seconds)
                if found is None:
                    row["milp"], row["milp_s"], row["milp_note"] = None, None, why
                else:
                    row["milp"] = 100 * (found[0] / base - 1)
                    row["milp_s"], row["milp_note"] = found[1], found[2]
            ref = reference.get((file.split(".json")[0], fraction))
            if ref is not None:
                row["moccasin_s"] = ref["seconds"]
                row["moccasin_note"] = ref.get("status", "")
                if ref.get("schedule"):  # checked here, not taken on trust
                    theirs = jg.planner.replay(dag, sequence_events(dag, ref["schedule"]))
                    assert theirs.peak <= budget, (theirs.peak, budget)
                    row["moccasin"] = 100 * (theirs.cost / base - 1)
            rows.append(row)
            print(_format([row], header=len(rows) == 1), flush=True)
    return rows


def _format(rows, header=True) -> str:
    def pct(x):
        return "-" if x is None else f"{x:.2f}%"

    def sec(x):
        return "-" if x is None else f"{x:.1f}s"

    lines = []
    if header:
        lines.append(f"{'graph':<22} {'nodes':>5} {'budget':>7} {'budget':>14}  "
                     f"{'jgraph':>8} {'time':>7}  {'MILP':>8} {'time':>7} {'':<12} "
                     f"{'MOCCASIN':>8} {'time':>7}")
    for r in rows:
        lines.append(
            f"{r['graph'][:22]:<22} {r['nodes']:>5} {r['fraction']:>7.0%} {r['budget']:>14}  "
            f"{pct(r['jgraph']):>8} {sec(r['jgraph_s']):>7}  {pct(r.get('milp')):>8} "
            f"{sec(r.get('milp_s')):>7} {r.get('milp_note', '')[:12]:<12} "
            f"{pct(r.get('moccasin')):>8} {sec(r.get('moccasin_s')):>7} "
            f"{r.get('moccasin_note', '')[:10]}")
    return "\n".join(lines)


def rows(quick: bool = False) -> list[dict]:
    """For `benchmarks.run`: the graphs in $JGRAPH_MOCCASIN_DATA (skipped when unset)."""
    folder = os.environ.get("JGRAPH_MOCCASIN_DATA")
    if not folder:
        return [{"benchmark": "dag (MOCCASIN graphs)", "jgraph": "-", "reference": "-",
                 "ratio": "-", "note": "skipped: set JGRAPH_MOCCASIN_DATA to MOCCASIN's data/"}]
    out = []
    for r in rows_for(Path(folder), ("n100",) if quick else (), milp=False):
        out.append({"benchmark": f"dag {r['graph']} {r['fraction']:.0%}",
                    "jgraph": f"+{r['jgraph']:.2f}%", "reference": "-", "ratio": "-",
                    "note": f"{r['jgraph_s']:.1f}s {r['solver']}"})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="MOCCASIN's data/ folder")
    parser.add_argument("--milp-seconds", type=float, default=60.0,
                        help="time limit of the Checkmate MILP column (0: skip it)")
    parser.add_argument("--time-limit", type=float, default=30.0,
                        help="jgraph's time_limit (the MILP of solver='auto')")
    parser.add_argument("--moccasin", help="JSON rows of MOCCASIN's results to show beside")
    parser.add_argument("graphs", nargs="*", help="only graphs whose file name has these")
    args = parser.parse_args(argv)
    rows_for(Path(args.data), args.graphs, args.milp_seconds, args.time_limit, args.moccasin,
             milp=args.milp_seconds > 0)


if __name__ == "__main__":
    main()
