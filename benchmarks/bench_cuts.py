"""Fusion cuts (`jgraph.lower.fusion_cuts`): jgraph's step against JAX's, with the cuts and
without them (`jgraph.lower.FUSION_CUTS = False`), in one process.

Rows: the donated no-remat step of the planner's and remat benchmarks' models (a 6-layer
transformer LM, a 16-block residual MLP, a 32-layer tanh chain, a 64-layer scanned MLP), of the
backward benchmark's transformer block and MLP, of an 8-layer gelu MLP (width 512, batch 256) and
of 8-layer tanh, gelu and relu MLPs of widths 128 to 2048 (batch 256), against JAX's donated
`value_and_grad` + SGD step of the same function. Each ratio is the median over 5 runs of
interleaved medians (jgraph with cuts, jgraph without, JAX, in turn), with the spread of the
5; the note gives the ratio without cuts, the number of cuts and conditionals, and both compiled
temps. Bar: <= 1.02 everywhere, the transformer LM <= 0.80. Last row: the transformer LM's
Optimizer step (period 1, adam) on a 2-device mesh (the whole micro-batch partitioned by XLA, in
a child process with 2 host devices), with cuts against without, where each cut's predicate is
one scalar all-reduce: the note counts them.

    python -m benchmarks.bench_cuts [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import jgraph as jg
import jgraph.lower as lowering
from benchmarks import interleaved_medians

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def mlp(activation):
    """`activation(h @ w + b)` layers and a mean-square head (bench_backward's MLP is tanh)."""

    def loss(params, x):
        h = x
        for w, b in params[:-1]:
            h = activation(h @ w + b)
        w, b = params[-1]
        return jnp.mean((h @ w + b) ** 2)

    return loss


ACTIVATIONS = {"tanh": jnp.tanh, "gelu": jax.nn.gelu, "relu": jax.nn.relu}


def models(quick: bool) -> dict:
    from benchmarks import bench_backward as bb
    from benchmarks import bench_planner as bp
    from benchmarks import bench_remat as br

    found = {"transformer6": (bp.transformer(), bp.transformer_args()),
             "transformer block": (bb.transformer_block, bb._block_args(8, 128, 256, 4)),
             "MLP": (bb.mlp, bb._mlp_args(512, 8, 256)),
             "gelu MLP 512": (mlp(jax.nn.gelu), bb._mlp_args(512, 8, 256))}
    if not quick:
        found |= {"resmlp16": (br.blocks(), br.block_args()),
                  "chain32": (br.chain(), br.chain_args()),
                  "scan64": (bp.scanned(), bp.scanned_args())}
        found |= {f"{name} MLP {width}": (mlp(f), bb._mlp_args(width, 8, 256))
                  for name, f in ACTIVATIONS.items() for width in (128, 2048)}
    return found


def stepper(graph, args, cuts: bool):
    """(a Stepper of the donated step lowered with or without cuts, its compiled temp, the
    conditionals and the instructions in its HLO). The step runs once here, so that it is traced
    while the switch holds."""
    from benchmarks.bench_remat import Stepper
    from jgraph.memory import donated_step

    lowering.FUSION_CUTS = cuts
    try:
        step, split = donated_step(graph)
        state, rest = split(*args)
        compiled = step.lower(state, rest).compile()
        run = Stepper(step, state, rest)
        jax.block_until_ready(run())
    finally:
        lowering.FUSION_CUTS = True
    text = compiled.as_text()
    return run, compiled.memory_analysis().temp_size_in_bytes, text.count(" conditional("), \
        hlo_ops(text)


def hlo_ops(text: str) -> int:
    """Instructions in an optimized HLO text (equal counts: XLA got the same program)."""
    return len(re.findall(r"^\s*(?:ROOT )?\S+ = ", text, flags=re.M))


def jax_stepper(fn, args):
    """JAX's donated `value_and_grad` + SGD step (as `donated_step` builds jgraph's)."""
    from benchmarks.bench_remat import Stepper, jax_step

    params, x = args
    step = jax_step(fn)
    ops = hlo_ops(step.lower(params, x).compile().as_text())
    run = Stepper(step, params, x)
    jax.block_until_ready(run())
    return run, ops


def model_rows(quick: bool, runs: int = 5) -> list[dict]:
    out = []
    for name, (fn, args) in models(quick).items():
        gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
        (plain, plain_temp, _, _), (cut, cut_temp, conds, ops) = (stepper(gb, args, c)
                                                                   for c in (False, True))
        reference, reference_ops = jax_stepper(fn, args)
        steps = {"jax": reference, "cut": cut, "plain": plain}
        ratios: dict[str, list[float]] = {"cut": [], "plain": []}
        seconds: dict[str, list[float]] = {"jax": [], "cut": []}
        once = interleaved_medians(steps, repeats=1)["jax"]  # about 1 s of each step per run
        repeats = 3 if quick else min(50, max(7, round(1.0 / once)))
        for _ in range(runs):
            times = interleaved_medians(steps, repeats=repeats)
            for k in seconds:
                seconds[k].append(times[k])
            for k in ratios:
                ratios[k].append(times[k] / times["jax"])
        cut_ratio, plain_ratio = (statistics.median(ratios[k]) for k in ("cut", "plain"))
        out.append({"benchmark": f"fusion cuts, {name}: step vs JAX's",
                    "jgraph": f"{statistics.median(seconds['cut']) * 1e3:.2f} ms",
                    "reference": f"{statistics.median(seconds['jax']) * 1e3:.2f} ms",
                    "ratio": cut_ratio,
                    "note": f"spread {min(ratios['cut']):.3f}-{max(ratios['cut']):.3f}; "
                            f"no cuts {plain_ratio:.3f}; {len(lowering.fusion_cuts(gb))} cuts "
                            f"({conds} conditionals); HLO ops {ops} vs JAX's {reference_ops}; "
                            f"temp {cut_temp / MIB:.1f} vs {plain_temp / MIB:.1f} MiB"})
    return out


def _child() -> None:
    """The period-1 Optimizer step (adam) of the planner benchmark's 6-layer transformer LM on a
    2-device mesh, with and without cuts: one JSON line."""
    import numpy as np
    import optax
    from jax.sharding import Mesh

    from benchmarks.bench_planner import transformer, transformer_args
    from jgraph.training.mesh import count_collectives

    params, x = transformer_args()
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    runs, collectives = {}, {}
    for cuts in (False, True):
        lowering.FUSION_CUTS = cuts
        opt = jg.Optimizer(transformer(), optax.adam(1e-3), mesh=mesh, static=False)
        state = opt.init(params, x)
        data = opt._data(x, None)
        text = opt.executables["opt"].lower(state.params, *data, state.opt_state).compile(
            ).as_text()
        collectives[cuts] = count_collectives(text)["all-reduce"]
        state = opt.step(state, x)[0]  # traced and compiled while the switch holds

        def run(opt=opt, state=state):
            return opt.step(state, x)[0].params

        jax.block_until_ready(run())
        runs["cut" if cuts else "plain"] = run
    lowering.FUSION_CUTS = True
    times = interleaved_medians(runs, repeats=int(sys.argv[2]))
    print(json.dumps({"times": times, "all_reduces": [collectives[False], collectives[True]]}))


def mesh_row(quick: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_cuts", "--child",
                           str(5 if quick else 9)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=1200)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    found = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    times, (plain, cut) = found["times"], found["all_reduces"]
    return {"benchmark": "fusion cuts, transformer6, Optimizer step on a 2-device mesh",
            "jgraph": times["cut"], "reference": times["plain"],
            "ratio": times["cut"] / times["plain"],
            "note": f"all-reduces: {cut} with cuts, {plain} without"}


def rows(quick: bool = False) -> list[dict]:
    return model_rows(quick) + [mesh_row(quick)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    from benchmarks.run import format_table

    print(format_table(rows(args.quick)))


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child()
    else:
        main()
