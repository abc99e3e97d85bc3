"""Below the floor (issue 28): the largest batch whose donated adam step fits a fixed memory.

The memory is fixed per model: the temp XLA:CPU gives JAX's own no-remat adam step at batch 8
(`jax.jit(step, donate_argnums=(0, 1))`, params and optimizer state donated). For each model, the
largest batch whose step's temp stays within it:
- JAX, every hand-written arrangement: no remat; a `jax.checkpoint` per layer (or, scanned, on the
  scan's body) with `nothing_saveable`, `dots_saveable`, `dots_with_no_batch_dims_saveable`;
  2-layer segments (unrolled); each with XLA's default flags and with `cse_barrier_expander` off
  (`KEEP_BARRIERS`, which keeps JAX's remat alive on XLA:CPU);
- jgraph: the step graph `without_grads(jg.optimizer_step(jg.backward(jg.trace(loss)), adam))`
  (the step returns no gradients, as JAX's does not) planned whole by
  `jg.remat(go, budget=that memory)`: loop modes, the updates fused into the backward
  (`jg.fuse_updates`), the loss head in chunks.
  A batch fits when the planner returns a plan without a `BudgetWarning` and XLA's temp of the
  returned step is within the memory.
Then the time per example of each side's best (largest-batch) step at its largest batch, timed
interleaved in one process (medians): jgraph's over JAX's.

A batch is searched from the temp's slope in the batch (XLA's temp is close to affine in it):
two compiles place it, a few more confirm it (the largest fitting batch, the next one not).

    python -m benchmarks.bench_max_batch [--quick] [models...]
    python -m benchmarks.bench_max_batch MODEL --time-at JAX_ARRANGEMENT JAX_BATCH JGRAPH_BATCH
    python -m benchmarks.bench_max_batch --dropin [models...]

Models: `scanlm-4096`, `scanlm-32768` (the 8-layer transformer LM of `bench_planner`, d 256,
seq 128, 4 heads, layers in a `lax.scan`) and their unrolled twins `lm-4096`, `lm-32768`.
`--quick`: only batches, no timing; JAX's arrangements with barriers kept only (no remat with
both), `dots_with_no_batch_dims` left out. `--jax-only`: JAX's side alone (no planning, no
timing). `--time-at`: the time ratio alone, at the batches an earlier run found. `--dropin`:
the largest batch of `jg.jit(step, budget=memory)` over the step as a user writes it
(`jg.value_and_grad`, then optax), beside the step graph's (what `jg.Optimizer` plans).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import optax

import jgraph as jg
from benchmarks import interleaved_medians
from benchmarks.bench_planner import (
    KEEP_BARRIERS,
    scanned_lm,
    scanned_lm_args,
    transformer,
    transformer_args,
)
from jgraph.fuse import without_grads
from jgraph.planner.search import xla_temp

MIB = 2**20
BASE_BATCH = 8
MAX_BATCH = 4096
cp = jax.checkpoint_policies
POLICIES = {"nothing_saveable": cp.nothing_saveable, "dots_saveable": cp.dots_saveable,
            "dots_with_no_batch_dims": cp.dots_with_no_batch_dims_saveable}


def tx():
    return optax.adam(1e-3)


# -- models --------------------------------------------------------------------------------------
def model(name: str):
    """(loss of (params, tokens), params, {arrangement: loss}, tokens of a batch)."""
    kind, vocab = name.split("-")
    vocab = int(vocab)
    if kind == "scanlm":
        params, _ = scanned_lm_args(vocab=vocab)
        hand = {f"scan(checkpoint(body, {p}))": scanned_lm(
            lambda f, p=policy: jax.checkpoint(f, policy=p)) for p, policy in POLICIES.items()}
        plain = scanned_lm()
    else:
        params, _ = transformer_args(layers=8, vocab=vocab)
        hand = {f"checkpoint per layer, {p}": transformer(
            lambda f, p=policy: jax.checkpoint(f, policy=p)) for p, policy in POLICIES.items()}
        hand["2-layer segments"] = transformer(jax.checkpoint, 2)
        plain = transformer()
    return plain, params, {"no remat": plain, **hand}, vocab


def tokens(batch: int, vocab: int):
    return jax.random.randint(jax.random.PRNGKey(batch), (batch, 128), 0, vocab)


# -- JAX's side ----------------------------------------------------------------------------------
def jax_adam_step(fn, options=None):
    opt = tx()

    def step(params, state, tokens):
        loss, grads = jax.value_and_grad(fn)(params, tokens)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return jax.jit(step, donate_argnums=(0, 1), compiler_options=options)


def jax_temp(fn, params, batch: int, options=None) -> int:
    state = jax.eval_shape(tx().init, params)
    toks = jax.ShapeDtypeStruct((batch, 128), jnp.int32)
    compiled = jax_adam_step(fn, options).lower(params, state, toks).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


# -- jgraph's side -------------------------------------------------------------------------------
def jgraph_step_graph(fn, params, batch: int, vocab: int, cap: int):
    """The planned, fused step graph at `batch`, or None when no plan fits `cap`."""
    gb = jg.backward(jg.trace(fn, params, tokens(batch, vocab), param_argnums=0))
    go = without_grads(jg.optimizer_step(gb, tx()))  # planned whole, its updates fused
    with warnings.catch_warnings():
        warnings.simplefilter("error", jg.BudgetWarning)
        try:
            planned = jg.remat(go, budget=cap)
        except (jg.BudgetWarning, jg.TransformError):
            planned = None
    candidates = [planned] if planned is not None else []
    candidates.append(jg.fuse_updates(go))
    fitting = [(xla_temp(g), g) for g in candidates]
    fitting = [f for f in fitting if f[0] <= cap]
    return min(fitting, key=lambda f: f[0])[1] if fitting else None


# -- the user's own step under `jg.jit` (issue 40) ------------------------------------------------
def dropin_step(fn, budget):
    """The step as a user writes it (`jax_adam_step` with `jg.value_and_grad`) under `jg.jit`."""
    opt = tx()

    def step(params, state, tokens):
        loss, grads = jg.value_and_grad(fn)(params, tokens)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return jg.jit(step, budget=budget, donate_argnums=(0, 1))


def dropin_fits(fn, params, batch: int, vocab: int, cap: int) -> bool:
    """Whether `jg.jit(step, budget=cap)` plans the step at `batch` within `cap` (no
    `BudgetWarning`, and XLA's temp of the step it runs within it)."""
    step = dropin_step(fn, cap)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jg.BudgetWarning)
        try:
            lowered = step.lower(params, tx().init(params), tokens(batch, vocab))
        except (jg.BudgetWarning, jg.TransformError):
            return False
    return int(lowered.compile().memory_analysis().temp_size_in_bytes) <= cap


def run_dropin(name: str) -> dict:
    """The largest batch of `jg.jit` over the user's step, beside the step graph's
    (`jgraph_step_graph`, what `jg.Optimizer` plans) and JAX's no remat, in the same memory."""
    plain, params, hand, vocab = model(name)
    cap = jax_temp(plain, params, BASE_BATCH)
    found = {"cap": cap, "name": name}

    def jit_fits(b):
        ok = dropin_fits(plain, params, b, vocab, cap)
        print(f"#   {name} jg.jit batch {b}: {'fits' if ok else 'does not fit'}", file=sys.stderr)
        return ok

    def graph_fits(b):
        ok = jgraph_step_graph(plain, params, b, vocab, cap) is not None
        print(f"#   {name} step graph batch {b}: {'fits' if ok else 'does not fit'}",
              file=sys.stderr)
        return ok

    found["jit"] = largest_batch(jit_fits)
    found["graph"] = largest_batch(graph_fits, low=max(1, found["jit"]))
    return found


# -- the search ----------------------------------------------------------------------------------
def largest_batch(fits, low: int = BASE_BATCH, temp_of=None, cap: int | None = None,
                  limit: int = MAX_BATCH) -> int:
    """The largest batch for which `fits(batch)`, 0 if not even 1. With `temp_of` (batch ->
    bytes) and `cap`, the first guess is where the temp's line through `low` and `2 low`
    crosses `cap`."""
    known: dict[int, bool] = {}

    def ok(b: int) -> bool:
        if b not in known:
            known[b] = b <= limit and fits(b)
        return known[b]

    guess = low
    if temp_of is not None:
        t1, t2 = temp_of(low), temp_of(2 * low)
        slope = max((t2 - t1) / low, 1.0)
        guess = max(1, min(limit, int(low + (cap - t1) / slope)))
    good, bad, step = (guess, None, max(1, guess // 16)) if ok(guess) else (0, guess, 1)
    while bad is None:  # gallop up from a fitting guess
        if ok(good + step):
            good, step = good + step, step * 2
        else:
            bad = good + step
    step = max(1, bad // 16)
    while good == 0 and bad - step > 0:  # gallop down from one that does not fit
        if ok(bad - step):
            good = bad - step
        else:
            bad, step = bad - step, step * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return good


def run_model(name: str, quick: bool, jax_only: bool = False) -> dict:
    plain, params, hand, vocab = model(name)
    cap = jax_temp(plain, params, BASE_BATCH)
    found = {"cap": cap, "jax": {}, "name": name}
    flag_sets = (("XLA defaults", None), ("barriers kept", KEEP_BARRIERS))
    for label, fn in hand.items():
        if quick and "dots_with_no_batch_dims" in label:
            continue
        for flags, options in flag_sets[1:] if quick and label != "no remat" else flag_sets:
            def temp_of(b, fn=fn, options=options):
                return jax_temp(fn, params, b, options)
            best = largest_batch(lambda b, t=temp_of: t(b) <= cap, temp_of=temp_of, cap=cap)
            found["jax"][f"{label}, {flags}"] = best
            print(f"#   {name} JAX {label}, {flags}: batch {best}", file=sys.stderr)
    best_label = max(found["jax"], key=found["jax"].get)
    found["jax_best"] = (best_label, found["jax"][best_label])
    graphs = {}

    def fits(b):
        g = jgraph_step_graph(plain, params, b, vocab, cap)
        if g is not None:
            graphs[b] = g
        print(f"#   {name} jgraph batch {b}: {'fits' if g is not None else 'does not fit'}",
              file=sys.stderr)
        return g is not None

    if jax_only:
        found["jgraph"] = 0
        return found
    low = max(1, found["jax_best"][1])
    found["jgraph"] = largest_batch(fits, low=low)
    if not quick and found["jgraph"] > 0:
        found["time"] = time_per_example(hand, best_label, params, graphs[found["jgraph"]],
                                         found["jax_best"][1], found["jgraph"], vocab)
    return found


def time_per_example(hand, label, params, graph, jax_batch, jg_batch, vocab) -> float:
    """jgraph's time per example at its largest batch over JAX's best at its own."""
    name, flags = label.rsplit(", ", 1)
    options = KEEP_BARRIERS if flags == "barriers kept" else None
    step = jax_adam_step(hand[name], options)
    state = {"p": jax.tree.map(jnp.copy, params), "s": tx().init(params)}
    toks = tokens(jax_batch, vocab)

    def run_jax():
        state["p"], state["s"], loss = step(state["p"], state["s"], toks)
        return loss

    jstep = jg.compile(graph, donate_argnums=(0, 2))  # (params, tokens, opt_state)
    box = {"p": jax.tree.map(jnp.copy, params), "s": tx().init(params)}
    jtoks = tokens(jg_batch, vocab)

    def run_jgraph():
        loss, box["p"], box["s"] = jstep(box["p"], jtoks, box["s"])
        return loss

    t = interleaved_medians({"jax": run_jax, "jgraph": run_jgraph}, repeats=5)
    return (t["jgraph"] / jg_batch) / (t["jax"] / jax_batch)


def format_rows(results) -> list[str]:
    lines = ["model          memory MiB  best JAX arrangement (batch)                          "
             "jgraph batch  x JAX  time/example vs JAX"]
    for r in results:
        label, batch = r["jax_best"]
        ratio = r["jgraph"] / batch if batch else float("inf")
        timing = f"{r['time']:.2f}x" if "time" in r else "-"
        lines.append(f"{r['name']:<14} {r['cap'] / MIB:10.1f}  {label + f' ({batch})':<54}"
                     f"{r['jgraph']:12d}  {ratio:5.2f}  {timing}")
        for arrangement, b in r["jax"].items():
            lines.append(f"    JAX {arrangement}: {b}")
    return lines


def time_at(name: str, jax_label: str, jax_batch: int, jg_batch: int) -> float:
    """The time ratio alone, at batches an earlier run found (`--time-at`): jgraph's step is
    planned at `jg_batch` under the model's fixed memory (it must fit) and timed against JAX's
    `jax_label` arrangement at `jax_batch`."""
    plain, params, hand, vocab = model(name)
    cap = jax_temp(plain, params, BASE_BATCH)
    arrangement, flags = jax_label.rsplit(", ", 1)
    if arrangement not in hand or flags not in ("XLA defaults", "barriers kept"):
        raise SystemExit(f"--time-at: unknown arrangement {jax_label!r}; known: "
                         f"{[h + ', barriers kept' for h in hand]} (or ', XLA defaults')")
    options = KEEP_BARRIERS if flags == "barriers kept" else None
    if jax_temp(hand[arrangement], params, jax_batch, options) > cap:
        raise SystemExit(f"--time-at: JAX's {jax_label} at batch {jax_batch} does not fit")
    graph = jgraph_step_graph(plain, params, jg_batch, vocab, cap)
    if graph is None:
        raise SystemExit(f"--time-at: jgraph's step at batch {jg_batch} does not fit")
    return time_per_example(hand, jax_label, params, graph, jax_batch, jg_batch, vocab)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="scanlm-4096 scanlm-32768 lm-4096 lm-32768")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--time-at", nargs=3, metavar=("JAX_ARRANGEMENT", "JAX_BATCH",
                                                      "JGRAPH_BATCH"),
                        help="only time one model (the one named) at the largest batches an "
                        "earlier run found, e.g. 'scan(checkpoint(body, nothing_saveable)), "
                        "barriers kept' 12 171")
    parser.add_argument("--jax-only", action="store_true",
                        help="JAX's arrangements only (every one, unless --quick): no planning")
    parser.add_argument("--dropin", action="store_true",
                        help="jg.jit over the user's own step against the step graph "
                        "jg.Optimizer plans, in the same memory (issue 40)")
    args = parser.parse_args(argv)
    if args.dropin:
        for name in args.models or ["scanlm-4096", "scanlm-32768"]:
            started = time.perf_counter()
            r = run_dropin(name)
            ratio = r["jit"] / r["graph"] if r["graph"] else float("nan")
            print(f"{name}: memory {r['cap'] / MIB:.1f} MiB; jg.jit batch {r['jit']}, step graph "
                  f"(jg.Optimizer) batch {r['graph']}: {ratio:.2f}x "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        return
    if args.time_at:
        if len(args.models) != 1:
            raise SystemExit("--time-at times one model: name it")
        label, jax_batch, jg_batch = args.time_at
        ratio = time_at(args.models[0], label, int(jax_batch), int(jg_batch))
        print(f"{args.models[0]}: jgraph at batch {jg_batch} over JAX's {label} at batch "
              f"{jax_batch}, time per example: {ratio:.2f}x")
        return
    results = []
    for name in args.models or ["scanlm-4096", "scanlm-32768", "lm-4096", "lm-32768"]:
        started = time.perf_counter()
        results.append(run_model(name, args.quick, args.jax_only))
        print(f"# {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print("\n".join(format_rows(results)))


if __name__ == "__main__":
    main()
