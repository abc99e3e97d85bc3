"""Drop-in benchmarks: `jg.value_and_grad` in a user's jitted train step vs `jax.value_and_grad`.

The train step is the usual one (value_and_grad + optax adam update, params and optimizer state
donated), written once with each transform. Rows, per model (the MLP and the transformer block
of `bench_backward`):
- step time: interleaved medians of the two compiled steps (bar: ratio <= 1.02);
- first call: trace + backward + compile + run of a fresh `jax.jit(train_step)` (a new function,
  so no cache of either library's is hit for it; per-process caches of both stay warm, as in a
  program that compiles several steps), interleaved medians (bar: ratio <= 1.3);
- first call in a fresh process (every cache cold: jgraph's rule templates, JAX's jaxpr caches),
  timed inside child processes started in turn, median (same bar).
The notes say whether the two steps' results are bitwise equal, and how the two optimized HLO
programs compare (identical up to names: any difference of time is noise).

    python -m benchmarks.bench_dropin [--quick]

With `--jit` (issue 40's bar): the first call of the whole step under `jg.jit` (trace, the
step's graph, its plan under the budget, compile, one step) against `jax.jit`'s first call of the
same step with `jax.value_and_grad` (the unplanned step), interleaved medians of fresh steps: no
budget (bar <= 1.1) and `budget="50%"` (bar <= 3), on the MLP, the transformer block and the
scanned 8-layer LM of `bench_planner` (vocab 4096: loop modes and fused updates planned). The
fresh steps of one process share jgraph's figure cache (a plan's compiles are served from it
after the first), so each is also timed in a new process, every cache cold: the user's first
call.

    python -m benchmarks.bench_dropin --jit [--quick]
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

import jgraph as jg
from benchmarks import interleaved_medians
from benchmarks.bench_backward import _block_args, _mlp_args, mlp, transformer_block

TX = optax.adam(1e-3)


def make_step(value_and_grad, loss):
    """A fresh jitted train step (a new function object each call: nothing cached for it)."""

    def train_step(params, opt_state, x):
        value, grads = value_and_grad(loss)(params, x)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(train_step, donate_argnums=(0, 1))


def _copy(tree):
    return jax.tree.map(lambda a: a.copy(), tree)


def step_row(name, loss, params, x, quick) -> dict:
    steps = {"jgraph": make_step(jg.value_and_grad, loss), "jax": make_step(jax.value_and_grad,
                                                                            loss)}
    states = {k: (_copy(params), TX.init(params)) for k in steps}
    results = {k: steps[k](*_copy(states[k]), x) for k in steps}
    bitwise = all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(results["jgraph"]), jax.tree.leaves(results["jax"]), strict=True))

    def run(k):
        def one():
            p, s, value = steps[k](*states[k], x)
            states[k] = (p, s)
            return value
        return one

    hlo = hlo_relation(*(step.lower(params, TX.init(params), x).compile().as_text()
                         for step in steps.values()))
    t = interleaved_medians({k: run(k) for k in steps}, repeats=30 if quick else 300, warmup=5)
    return {"benchmark": f"drop-in step: {name}", "jgraph": f"{t['jgraph'] * 1e3:.3f} ms",
            "reference": f"{t['jax'] * 1e3:.3f} ms", "ratio": t["jgraph"] / t["jax"],
            "note": f"jitted value_and_grad + adam, donated; first step bitwise equal: "
                    f"{bitwise}; optimized HLO {hlo}; bar <= 1.02"}


def hlo_relation(ours: str, theirs: str) -> str:
    """How two compiled programs compare, up to instruction names and source metadata:
    "identical", "the same instructions in another order", or their instruction counts."""
    def instructions(text):
        lines = [re.sub(r"metadata=\{.*?\}", "", line) for line in text.splitlines()
                 if " = " in line]
        return [re.sub(r"%?[\w.\-]+ = ", "v = ", re.sub(r"%[\w.\-]+", "%v", line))
                for line in lines]

    a, b = instructions(ours), instructions(theirs)
    if a == b:
        return "identical to JAX's"
    if sorted(a) == sorted(b):
        return "the same instructions as JAX's, in another order"
    return f"{len(a)} instructions vs JAX's {len(b)}"


def first_call_row(name, loss, params, x, quick) -> dict:
    def first_call(value_and_grad):
        def run():
            step = make_step(value_and_grad, loss)
            return step(_copy(params), TX.init(params), x)[2]
        return run

    # Each call builds and compiles a new step; interleaved, so both see the same machine load.
    t = interleaved_medians({"jgraph": first_call(jg.value_and_grad),
                             "jax": first_call(jax.value_and_grad)},
                            repeats=3 if quick else 9, warmup=1)
    return {"benchmark": f"drop-in first call: {name}", "jgraph": f"{t['jgraph']:.3f} s",
            "reference": f"{t['jax']:.3f} s", "ratio": t["jgraph"] / t["jax"],
            "note": "trace + backward + compile + one step of a fresh jitted train step; "
                    "bar <= 1.3"}


def _seconds_in_child(setup: str, call: str) -> float:
    """Seconds of `call` (an expression, blocked on) in a new Python process, after `setup`
    (statements run with this module's names, warnings silenced)."""
    code = (f"import time, warnings, jax; import jgraph as jg; "
            f"from benchmarks.bench_dropin import *; warnings.simplefilter('ignore'); "
            f"{setup}; start = time.perf_counter(); jax.block_until_ready({call}); "
            f"print(time.perf_counter() - start)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent)
    return float(out.stdout.strip().splitlines()[-1])


def cold_first_call_row(index, quick) -> dict:
    """The first call in a new process: each child times one first call of one library."""
    def child(library):
        return _seconds_in_child(
            f"name, loss, params, x = models({quick})[{index}]; "
            f"vg = {library}.value_and_grad; step = make_step(vg, loss); "
            f"opt = TX.init(params)", "step(params, opt, x)")

    times = {"jg": [], "jax": []}
    for _ in range(1 if quick else 3):
        for library in times:
            times[library].append(child(library))
    t = {k: float(np.median(v)) for k, v in times.items()}
    name = models(quick)[index][0]
    return {"benchmark": f"drop-in first call, new process: {name}",
            "jgraph": f"{t['jg']:.3f} s", "reference": f"{t['jax']:.3f} s",
            "ratio": t["jg"] / t["jax"],
            "note": "as above, every cache cold (a child process per figure); bar <= 1.3"}


def jit_step(jit, value_and_grad, loss, **options):
    """A fresh step (a new function object each call) under `jit` (`jax.jit` or `jg.jit`)."""

    def train_step(params, opt_state, x):
        value, grads = value_and_grad(loss)(params, x)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jit(train_step, donate_argnums=(0, 1), **options)


def jit_first_call_rows(name, loss, params, x, quick) -> list[dict]:
    def first_call(jit, value_and_grad, **options):
        def run():
            step = jit_step(jit, value_and_grad, loss, **options)
            return jax.block_until_ready(step(_copy(params), TX.init(params), x)[2])
        return run

    t = interleaved_medians({"jax": first_call(jax.jit, jax.value_and_grad),
                             "jg": first_call(jg.jit, jg.value_and_grad),
                             "jg 50%": first_call(jg.jit, jg.value_and_grad, budget="50%")},
                            repeats=3 if quick else 5, warmup=1)
    return [{"benchmark": f"jg.jit first call{label}: {name}", "jgraph": f"{t[k]:.3f} s",
             "reference": f"{t['jax']:.3f} s", "ratio": t[k] / t["jax"],
             "note": f"trace + plan + compile + one step of a fresh step, against jax.jit's "
                     f"(jax.value_and_grad, unplanned); bar <= {bar}"}
            for k, label, bar in (("jg", ", no budget", 1.1), ("jg 50%", ", budget 50%", 3))]


def cold_jit_rows(index, quick) -> list[dict]:
    """The first call of `jit_first_call_rows` in a new process (every cache cold, jgraph's
    figures and plans included): each child times one first call of one library and budget."""
    setups = {"jax": "jax.jit, jax.value_and_grad, loss", "jg": "jg.jit, jg.value_and_grad, loss",
              "jg 50%": "jg.jit, jg.value_and_grad, loss, budget='50%'"}

    def child(setup):
        return _seconds_in_child(
            f"name, loss, params, x = jit_models({quick})[{index}]; "
            f"step = jit_step({setup}); opt = TX.init(params)",
            "step(params, opt, x)[2]")

    times = {k: [] for k in setups}
    for _ in range(1 if quick else 3):
        for k, setup in setups.items():
            times[k].append(child(setup))
    t = {k: float(np.median(v)) for k, v in times.items()}
    name = jit_models(quick)[index][0]
    return [{"benchmark": f"jg.jit first call{label}, new process: {name}",
             "jgraph": f"{t[k]:.3f} s", "reference": f"{t['jax']:.3f} s",
             "ratio": t[k] / t["jax"],
             "note": f"as above, every cache cold (a child process per figure); bar <= {bar}"}
            for k, label, bar in (("jg", ", no budget", 1.1), ("jg 50%", ", budget 50%", 3))]


def jit_models(quick):
    from benchmarks.bench_planner import scanned_lm, scanned_lm_args

    params, tokens = scanned_lm_args(layers=4 if quick else 8, batch=4 if quick else 8,
                                     vocab=1024 if quick else 4096)
    return models(quick) + [(f"scanned LM, vocab {1024 if quick else 4096}", scanned_lm(),
                             params, tokens)]


def models(quick):
    width, layers, batch = (128, 4, 64) if quick else (512, 8, 256)
    b, t, d, heads = (2, 32, 64, 4) if quick else (8, 128, 256, 4)
    return [(f"MLP {layers}x{width}, batch {batch}", mlp, *_mlp_args(width, layers, batch)),
            (f"transformer block B={b} T={t} D={d}", transformer_block,
             *_block_args(b, t, d, heads))]


def rows(quick: bool = False) -> list[dict]:
    out = []
    for index, (name, loss, params, x) in enumerate(models(quick)):
        out.append(step_row(name, loss, params, x, quick))
        out.append(first_call_row(name, loss, params, x, quick))
        out.append(cold_first_call_row(index, quick))
    return out


if __name__ == "__main__":
    from benchmarks.run import format_table

    start = time.perf_counter()
    quick = "--quick" in sys.argv
    if "--jit" in sys.argv:
        print(format_table([row for index, model in enumerate(jit_models(quick))
                            for row in jit_first_call_rows(*model, quick)
                            + cold_jit_rows(index, quick)]))
    else:
        print(format_table(rows(quick)))
    print(f"# {time.perf_counter() - start:.1f} s", file=sys.stderr)
