"""The exact planner against the fast one (issue 27): `planner="exact"` (the chain MILP and
Checkmate's schedule of the graph itself, `jgraph.planner.on_graph`) beside `planner="fast"`
(the default for big graphs) on `bench_planner`'s models and a small 4-level U-Net (`unet4s`:
width 64, batch 128).

Per model and budget (a share of jgraph's no-remat compiled temp), a row: each planner's compiled
temp (XLA's donated step, as the planner reports it; every plan fits its budget or the row says
so), its recompute flop-equivalents per step (jgraph's cost model,
`jgraph.planner.cost.recompute_flops`), the exact planner's over the fast one's, which of its
candidates the exact planner took (the chain's plan, the graph's schedule, a hand arrangement),
and the seconds each took in all (planning and the compiles of the plans it checked). With
`--time`, the two planned steps are timed against no remat, interleaved (medians), in the same
process.

    python -m benchmarks.bench_exact [--budgets 75 50 25] [--time] [models ...]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

import jgraph as jg
from benchmarks import interleaved_medians
from benchmarks.bench_planner import MIB, jgraph_step, models, unet, unet_args
from benchmarks.bench_remat import Stepper
from jgraph.planner.plan import ON_GRAPH
from jgraph.planner.search import xla_temp

PLANNERS = ("fast", "exact")


def model(name: str):
    """(loss, args) of a `bench_planner` model, or of the small 4-level U-Net `unet4s`."""
    if name == "unet4s":
        return unet(), unet_args(4, 64, 128)
    fn, args, _ = models()[name]
    return fn, args


def kind_of(plan: str) -> str:
    """Which candidate a plan's description names: the graph's schedule, a hand arrangement
    (`jgraph.planner.hand`'s labels), or the chain's plan."""
    if ON_GRAPH in plan:
        return "graph"
    if plan.startswith("a checkpoint per layer") or plan.endswith("no plan around it"):
        return "hand"
    return "chain"


def measure(name: str, percents, timed: bool, repeats: int = 9) -> list[dict]:
    fn, args = model(name)
    gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
    no_temp = xla_temp(gb)
    rows, steppers = [], {"no remat": Stepper(*jgraph_step(gb, args))}
    for percent in percents:
        row = {"model": name, "percent": percent, "budget": int(no_temp * percent / 100)}
        for planner in PLANNERS:
            started = time.perf_counter()
            try:
                planned = jg.remat(gb, budget=f"{percent}%", planner=planner)
            except jg.TransformError as error:
                row[planner] = {"error": str(error)}
                continue
            report = planned.info["remat"]
            row[planner] = {"temp": report["xla_temp"], "flops": report["recompute_flops"],
                            "plan": report["plan"], "seconds": time.perf_counter() - started,
                            "unmet": report.get("unmet", False)}
            if timed:
                steppers[(percent, planner)] = Stepper(*jgraph_step(planned, args))
        rows.append(row)
    if timed:
        times = interleaved_medians(steppers, repeats=repeats, warmup=1)
        for row in rows:
            for planner in PLANNERS:
                if (row["percent"], planner) in times:
                    row[planner]["time"] = times[(row["percent"], planner)] / times["no remat"]
    return rows


def format_rows(rows) -> list[str]:
    lines = ["model         budget  MiB     fast: temp  flops     s     exact: temp  flops     "
             "s    exact/fast  took   time fast/exact (vs no remat)"]
    for r in rows:
        head = f"{r['model']:<13} {r['percent']:>5}% {r['budget'] / MIB:7.2f}"
        cells = []
        for planner in PLANNERS:
            c = r[planner]
            if "error" in c:
                cells.append(f"{'unreachable':>28}")
                continue
            over = " OVER" if c["temp"] > r["budget"] else ""
            cells.append(f"{c['temp'] / MIB:9.2f}{over} {c['flops']:9.3g} {c['seconds']:5.1f}")
        fast, exact = r["fast"], r["exact"]
        both = "error" not in fast and "error" not in exact
        ratio = f"{exact['flops'] / fast['flops']:.3f}" if both and fast["flops"] else "-"
        took = kind_of(exact["plan"]) if "plan" in exact else "-"
        timing = (f"{fast['time']:.2f}x / {exact['time']:.2f}x"
                  if both and "time" in fast and "time" in exact else "")
        lines.append(f"{head}  {cells[0]}  {cells[1]}  {ratio:>10}  {took:<6} {timing}")
    lines.append("exact plans:")
    lines += [f"  {r['model']:<13} {r['percent']:>3}%  {r['exact'].get('plan', '-')[:110]}"
              for r in rows]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="unet4s and bench_planner's models")
    parser.add_argument("--budgets", nargs="+", type=int, default=[75, 50, 25])
    parser.add_argument("--time", action="store_true", help="time the planned steps too")
    args = parser.parse_args(argv)
    names = args.models or ["unet4s", *models()]
    rows = []
    for name in names:
        started = time.perf_counter()
        rows += measure(name, args.budgets, args.time)
        print(f"# {name}: {time.perf_counter() - started:.0f} s ({jax.default_backend()})",
              file=sys.stderr)
    print("\n".join(format_rows(rows)))


if __name__ == "__main__":
    main()
