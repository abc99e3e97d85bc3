"""The guides' pictures, drawn from the benchmarks' own models and measurements (never pasted).

    python docs/figures.py            # writes docs/figures/*.png (mkdocs build runs it when absent)

- `memory-timeline.png`: `jg.memory(...).plot` of `benchmarks.bench_remat`'s 32-layer tanh chain
  (DESIGN §5's reference shape): no remat, a `jax.checkpoint` per 6 layers (sqrt(32)), and
  `jg.remat(budget="50%")`'s plan, each with XLA's compiled temp as a line.
- `frontier.png`: `benchmarks.bench_planner`'s recompute/memory frontier of the same chain (its
  `frontier` and `jax_arrangements`: fast plans at budgets from the least to no remat, JAX's
  hand-written arrangements as points), as `python -m benchmarks.bench_planner --plot` draws it
  for every model.
"""

from __future__ import annotations

import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "figures"
MIB = 2**20


def memory_timeline(path):
    import jgraph as jg
    from benchmarks.bench_remat import chain, chain_args

    args = chain_args()
    gb = jg.backward(jg.trace(chain(), *args, param_argnums=0))
    segments = jg.remat(jg.backward(jg.trace(chain(6), *args, param_argnums=0)))
    planned = jg.remat(gb, budget="50%")
    graphs = (gb, segments, planned)
    reports = [jg.memory(g) for g in graphs]
    reports[0].plot(path, *reports[1:],
                    labels=["no remat", "jax.checkpoint per 6 layers", 'jg.remat(budget="50%")'],
                    compiled=[jg.compiled_memory(g, *args) for g in graphs],
                    title="32-layer tanh chain, width 512, batch 256 (bench_remat): live bytes")


def frontier(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import jgraph as jg
    from benchmarks.bench_planner import (
        compiled_temp,
        jax_arrangements,
        jgraph_step,
        models,
    )
    from benchmarks.bench_planner import frontier as planner_frontier

    fn, args, _ = models()["chain32"]
    gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
    no_temp = compiled_temp(*jgraph_step(gb, args))
    points = planner_frontier(no_temp, gb, args, 5)
    hand = {label: found for label, (_, found) in jax_arrangements("chain32").items()}
    fig, ax = plt.subplots(figsize=(8, 5))
    temps, flops = zip(*points, strict=True)
    ax.plot([t / MIB for t in temps], [f / 1e9 for f in flops], "o-",
            label='jg.remat(budget=..., planner="fast")')
    for k, (label, found) in enumerate(hand.items()):
        ax.scatter(found["temp"] / MIB, found["flops"] / 1e9, marker="x", color="black",
                   label="JAX's hand-written arrangements" if k == 0 else None)
        ax.annotate(label, (found["temp"] / MIB, found["flops"] / 1e9), fontsize=7)
    ax.set_title("32-layer tanh chain (bench_planner's chain32): recompute against memory")
    ax.set_xlabel("compiled temp of the donated step (MiB)")
    ax.set_ylabel("recompute GFLOP per step (jgraph's cost model)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


FIGURES = {"memory-timeline.png": memory_timeline, "frontier.png": frontier}


def main(missing_only: bool = False) -> None:
    sys.path.insert(0, str(ROOT))
    OUT.mkdir(exist_ok=True)
    for name, draw in FIGURES.items():
        path = OUT / name
        if missing_only and path.exists():
            continue
        started = time.perf_counter()
        draw(path)
        print(f"wrote {path.relative_to(ROOT)} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main(missing_only="--missing" in sys.argv[1:])
