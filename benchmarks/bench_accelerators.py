"""Memory planned for the chip the step runs on: the budget's figure on a TPU (compiled ahead of
time, from any host), a GPU (where one is at hand) or this CPU, against JAX's arrangements.

For each model of `bench_planner` (and `scanlm8-adam`, the scanned 8-layer LM of
`bench_max_batch` at vocab 4096 with adam, params and state donated, batch 16), on the target:
- JAX's donated step without remat and with each hand-written `jax.checkpoint` arrangement,
  compiled for the target: the budget's figure (`jgraph.target`: peak on TPU and GPU, temp on
  CPU); the least of them;
- jgraph's step without remat (its figure over JAX's: the bar is 1.02x);
- `jg.remat(budget=..., target=...)` at 75 / 50 / 25 % of jgraph's no-remat figure and at "1%"
  (the least plan): the figure the target's compiler reports for the plan (compiled again),
  whether it is met, the recompute flop-equivalents, the planning and compile seconds;
- at each arrangement's figure as a byte budget: the plan's figure and recompute flops against
  the arrangement's;
- on a TPU, the compiler's own rematerialization as the peer (issue 52): at each percentage's
  HBM size, whether JAX's step without remat compiles there with the compiler's remat on (past
  95 % of the HBM it rematerializes by itself), and the flops it adds as the compiler counts them
  (its cost analysis), beside the flops jgraph's plan adds there, counted the same way.
A TPU needs `pip install 'jgraph[tpu]'` (libtpu; no TPU device: nothing runs on a chip).

    python -m benchmarks.bench_accelerators --target tpu [--topology v5e:2x2] [--mesh] [models...]
    python -m benchmarks.bench_accelerators --target cpu unet4
"""

from __future__ import annotations

import argparse
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jgraph as jg
from benchmarks.bench_max_batch import model as max_batch_model
from benchmarks.bench_planner import models as planner_models
from benchmarks.bench_planner import traced_recompute
from jgraph.fuse import without_grads
from jgraph.memory.compiled import lowered_step, read_figures
from jgraph.memory.hbm import at_size
from jgraph.planner.cost import recompute_flops
from jgraph.target import resolve

MIB = 2**20
BUDGETS = ("75%", "50%", "25%", "1%")
QUICK = ("chain32", "unet4", "scanlm8-adam")


def target_of(platform: str, topology: str, mesh: bool):
    """The `jgraph.target.Target` named on the command line."""
    if platform == "tpu":
        from jax.experimental import topologies

        devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
        if mesh:
            return resolve(jax.sharding.Mesh(np.array(devices), ("data",)))
        return resolve(devices[0])
    return resolve(platform)


# -- the models ------------------------------------------------------------------------------------
def cases(names):
    """{name: (traced function, example args, {arrangement: function}, kind)}: kind "sgd" steps
    `p - 1e-3 g` (bench_remat's), "adam" steps optax's adam with its state donated."""
    found = {}
    planner = planner_models()
    for name in names:
        if name == "scanlm8-adam":
            plain, params, hand, vocab = max_batch_model("scanlm-4096")
            toks = jax.ShapeDtypeStruct((16, 128), jnp.int32)
            found[name] = (plain, (params, toks), hand, "adam")
        else:
            fn, args, hand = planner[name]
            found[name] = (fn, args, hand, "sgd")
    return found


def _avals(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def jax_figure(fn, args, kind: str, target) -> int:
    """The budget's figure of JAX's donated step of `fn` compiled for `target`."""
    return read_figures((target, jax_lowered(fn, args, kind, target))).budget_bytes


def jax_lowered(fn, args, kind: str, target):
    """JAX's donated step of `fn` ("sgd" or "adam", `cases`) lowered for `target`."""
    params, rest = args
    if kind == "adam":
        tx = optax.adam(1e-3)

        def step(params, state, rest):
            loss, grads = jax.value_and_grad(fn)(params, rest)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        state = jax.eval_shape(tx.init, params)
        state_args = (params, state)
    else:
        def step(params, rest):
            loss, grads = jax.value_and_grad(fn)(params, rest)
            return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), loss

        state_args = (params,)
    placed = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        np.shape(a), a.dtype, sharding=target.sharding(a, True)), s) for s in state_args]
    rest = jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        np.shape(a), a.dtype, sharding=target.sharding(a, False)), rest)
    donate = tuple(range(len(state_args)))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        return jax.jit(step, donate_argnums=donate).lower(*placed, rest)


def jgraph_graph(fn, args, kind: str):
    gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
    if kind == "adam":
        return without_grads(jg.optimizer_step(gb, optax.adam(1e-3)))
    return gb


def planned(graph, budget, target):
    """(the plan, its figure as the target's compiler reports it, seconds, unmet?)."""
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jg.BudgetWarning)
        try:
            plan = jg.remat(graph, budget=budget, target=target)
        except jg.TransformError as e:
            return None, getattr(e, "least_temp", None), time.perf_counter() - started, True
    seconds = time.perf_counter() - started
    figure = jg.compiled_memory(plan, target=target).budget_bytes
    unmet = any(issubclass(w.category, jg.BudgetWarning) for w in caught)
    return plan, figure, seconds, unmet


def _flops(compiled) -> float:
    """The flops the target's compiler counts in a compiled step (its cost analysis)."""
    found = compiled.cost_analysis()
    found = found[0] if isinstance(found, list) else found
    return float(found.get("flops", 0.0))


def compiled_flops(lowered, target) -> float:
    """The flops of `lowered` compiled as the budget's figure is (the compiler's remat off)."""
    return _flops(lowered.compile(compiler_options=target.compile_options))


def compiler_remat(lowered, target, size_bytes: int, base_flops: float):
    """The TPU compiler's own rematerialization as the peer a plan must beat (issue 52): whether
    `lowered` (JAX's step without remat) compiles at an HBM size of `size_bytes` (whole MiB,
    rounded down as a budget is) with the compiler's rematerialization on, and the flops it adds
    over `base_flops` (the step compiled with it off) where it does."""
    options = {k: v for k, v in target.compile_options.items()
               if k != "xla_tpu_rematerialization_min_size_in_bytes"}
    got = at_size(lowered, options, max(1, size_bytes // MIB))
    return (True, _flops(got.compiled) - base_flops) if got.fits else (False, None)


def _compiler_line(case_args, target, amount: int, plan, mine_flops: float) -> str:
    """`compiler_remat` at `amount` beside jgraph's plan there, flops as the compiler counts
    them (recompute = the step's flops over its unplanned step's)."""
    jax_step, jax_flops = case_args
    fits, extra = compiler_remat(jax_step, target, amount, jax_flops)
    ours = ""
    if plan is not None:
        added = compiled_flops(lowered_step(plan, target)[1], target) - mine_flops
        ours = f"; jgraph's plan +{added / 1e9:.3g} GFLOP"
    said = f"fits, +{extra / 1e9:.3g} GFLOP" if fits else "does not fit"
    return f"    the compiler's own remat on JAX's step at that size: {said}{ours}"


def run_model(name, case, target, budgets=BUDGETS) -> list[str]:
    fn, args, hand, kind = case
    args = tuple(_avals(a) for a in args)
    lines = [f"## {name} on {target.describe()} (figure: {target.figure})"]
    arrangements = {}
    for label, variant in hand.items():
        arrangements[label] = (jax_figure(variant, args, kind, target),
                               traced_recompute(variant, args) if kind == "sgd" else None)
        lines.append(f"  JAX {label}: {arrangements[label][0] / MIB:.2f} MiB")
    least_label = min(arrangements, key=lambda k: arrangements[k][0])
    graph = jgraph_graph(fn, args, kind)
    mine = jg.compiled_memory(graph, target=target).budget_bytes
    theirs = arrangements["no remat"][0]
    lines.append(f"  jgraph no remat: {mine / MIB:.2f} MiB = {mine / theirs:.3f}x JAX's no remat")
    peer = None
    if target.platform == "tpu":  # the compiler's own remat, the peer on a TPU (issue 52)
        jax_step = jax_lowered(hand["no remat"], args, kind, target)
        peer = ((jax_step, compiled_flops(jax_step, target)),
                compiled_flops(lowered_step(graph, target)[1], target))
    for budget in budgets:
        plan, figure, seconds, unmet = planned(graph, budget, target)
        amount = mine * float(budget.rstrip("%")) / 100
        flops = None if plan is None else recompute_flops(plan)
        least = arrangements[least_label][0]
        what = "least plan" if budget == "1%" else f"{budget} = {amount / MIB:.2f} MiB"
        lines.append(f"  plan {what}: {figure / MIB if figure else float('nan'):.2f} MiB "
                     f"({'unmet' if unmet else 'met'}; {figure / least if figure else 0:.3f}x "
                     f"least JAX arrangement {least_label!r}), recompute {flops or 0:.3g} flops, "
                     f"{seconds:.1f} s")
        if peer is not None and budget != "1%":
            lines.append(_compiler_line(peer[0], target, int(amount),
                                        None if unmet else plan, peer[1]))
    for label, (figure_j, flops_j) in arrangements.items():
        if label == "no remat":
            continue
        plan, figure, seconds, unmet = planned(graph, int(figure_j), target)
        flops = None if plan is None else recompute_flops(plan)
        said = "no plan fits" if plan is None or unmet else (
            f"fits at {figure / MIB:.2f} MiB, recompute {flops:.3g}"
            + ("" if flops_j is None else f" vs {flops_j:.3g} flops"))
        lines.append(f"  = {label} ({figure_j / MIB:.2f} MiB): {said}, {seconds:.1f} s")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="tpu", choices=("tpu", "gpu", "cpu"))
    parser.add_argument("--topology", default="v5e:2x2", help="a TPU topology (tpu only)")
    parser.add_argument("--mesh", action="store_true", help="every device of the topology, "
                        "data parallel (per-device figures); else its first chip")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("models", nargs="*")
    opts = parser.parse_args(argv)
    target = target_of(opts.target, opts.topology, opts.mesh)
    names = opts.models or (list(QUICK) if opts.quick
                            else [*planner_models(), "scanlm8-adam"])
    for name, case in cases(names).items():
        for line in run_model(name, case, target):
            print(line, flush=True)


if __name__ == "__main__":
    main()
