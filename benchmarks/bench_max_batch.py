"""Below the floor (issue 28): the largest batch whose donated adam step fits a fixed memory.

The memory is fixed per model: the temp XLA:CPU gives JAX's own no-remat adam step at batch 8
(`jax.jit(step, donate_argnums=(0, 1))`, params and optimizer state donated). For each model, the
largest batch whose step's temp stays within it:
- JAX, every hand-written arrangement: no remat; a `jax.checkpoint` per layer (or, scanned, on the
  scan's body) with `nothing_saveable`, `dots_saveable`, `dots_with_no_batch_dims_saveable`;
  2-layer segments (unrolled); the expert's step (issue 43): the layers checkpointed with
  `nothing_saveable` or `dots_saveable` and the loss head written by hand as a `lax.scan` over 8
  checkpointed chunks of rows (`bench_planner.lm_head_loss`); each with XLA's default flags and
  with `cse_barrier_expander` off (`KEEP_BARRIERS`, which keeps JAX's remat alive on XLA:CPU);
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
    python -m benchmarks.bench_max_batch --dropin [--quick] [models...]

Models: `scanlm-4096`, `scanlm-32768` (the 8-layer transformer LM of `bench_planner`, d 256,
seq 128, 4 heads, layers in a `lax.scan`), their unrolled twins `lm-4096`, `lm-32768`, and
`flax-scanlm-4096`, `flax-scanlm-32768`: the flax linen LM of `examples/flax_scan_lm.py` (its
blocks stacked by `nn.scan`, the head tied to the embedding, the example's next-token loss: 127
positions of the 128 tokens) at the same sizes, its loss a pure function of flax's params dict.
Its hand arrangements are a flax user's: the scanned block under
`nn.remat(Block, prevent_cse=False, policy=...)`. `tiny-flax-scanlm-VOCAB` (d 32, 2 layers, 2
heads) is for smoke tests, with `--limit`.
`--quick`: only batches, no timing; JAX's arrangements with barriers kept only (no remat with
both), `dots_with_no_batch_dims` left out. `--jax-only`: JAX's side alone (no planning, no
timing). `--time-at`: the time ratio alone, at the batches an earlier run found. `--limit`: the
largest batch searched. `--dropin` (issue 40): the largest batch of `jg.jit(step,
budget=memory)` over the step as a user writes it (`jg.value_and_grad`, then optax), beside the
step graph's (what `jg.Optimizer` plans) and JAX's best hand arrangement's, and (unless
`--quick`) jg.jit's time per example at its largest batch over JAX's best at its own, against
the issue's bar (>= 0.95x the step graph's batch, >= 10x JAX's, <= 1.15x its time per example).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import jgraph as jg
from benchmarks import interleaved_medians
from benchmarks.bench_planner import (
    KEEP_BARRIERS,
    scanned_lm,
    scanned_lm_args,
    transformer,
    transformer_args,
)
from examples.flax_scan_lm import LM, Block, next_token_loss
from jgraph.fuse import without_grads
from jgraph.planner.search import xla_temp

MIB = 2**20
BASE_BATCH = 8
MAX_BATCH = 4096
DROPIN_MODELS = ["scanlm-4096", "scanlm-32768", "flax-scanlm-4096", "flax-scanlm-32768"]
cp = jax.checkpoint_policies
POLICIES = {"nothing_saveable": cp.nothing_saveable, "dots_saveable": cp.dots_saveable,
            "dots_with_no_batch_dims": cp.dots_with_no_batch_dims_saveable}
# The expert's step (issue 43): the layers checkpointed as above and the loss head written in
# checkpointed chunks of rows by hand (`bench_planner.lm_head_loss`), as a JAX user training
# with a large vocabulary writes it.
HEAD_CHUNKS = 8
EXPERT_POLICIES = ("nothing_saveable", "dots_saveable")


def tx():
    return optax.adam(1e-3)


# -- models --------------------------------------------------------------------------------------
FLAX_SIZES = {"flax-scanlm": {"width": 256, "heads": 4, "layers": 8},
              "tiny-flax-scanlm": {"width": 32, "heads": 2, "layers": 2}}  # for smoke tests


def flax_scanlm(vocab: int, width: int, heads: int, layers: int, length: int = 128):
    """The example's flax LM: (its loss of (params, tokens), flax's params, {arrangement: loss})
    with the arrangements a flax user writes, `nn.remat` of the scanned block."""

    def loss_of(block):
        module = LM(vocab=vocab, width=width, heads=heads, layers=layers, length=length,
                    block=block)

        def loss(params, tokens):
            return next_token_loss(module.apply, params, tokens)

        return loss

    init = LM(vocab=vocab, width=width, heads=heads, layers=layers, length=length).init
    params = init(jax.random.PRNGKey(5), jnp.zeros((1, length), jnp.int32))["params"]
    hand = {f"nn.scan(nn.remat(Block, {p}))": loss_of(
        nn.remat(Block, prevent_cse=False, policy=policy)) for p, policy in POLICIES.items()}
    return loss_of(Block), params, hand


def model(name: str):
    """(loss of (params, tokens), params, {arrangement: loss}, the vocabulary's size)."""
    kind, vocab = name.rsplit("-", 1)
    vocab = int(vocab)
    if kind in FLAX_SIZES:
        plain, params, hand = flax_scanlm(vocab, **FLAX_SIZES[kind])
    elif kind == "scanlm":
        params, _ = scanned_lm_args(vocab=vocab)
        hand = {f"scan(checkpoint(body, {p}))": scanned_lm(
            lambda f, p=policy: jax.checkpoint(f, policy=p)) for p, policy in POLICIES.items()}
        hand.update({f"scan(checkpoint(body, {p})), head in {HEAD_CHUNKS} chunks": scanned_lm(
            lambda f, p=POLICIES[p]: jax.checkpoint(f, policy=p), HEAD_CHUNKS)
            for p in EXPERT_POLICIES})
        plain = scanned_lm()
    elif kind == "lm":
        params, _ = transformer_args(layers=8, vocab=vocab)
        hand = {f"checkpoint per layer, {p}": transformer(
            lambda f, p=policy: jax.checkpoint(f, policy=p)) for p, policy in POLICIES.items()}
        hand["2-layer segments"] = transformer(jax.checkpoint, 2)
        hand.update({f"checkpoint per layer, {p}, head in {HEAD_CHUNKS} chunks": transformer(
            lambda f, p=POLICIES[p]: jax.checkpoint(f, policy=p), head_chunks=HEAD_CHUNKS)
            for p in EXPERT_POLICIES})
        plain = transformer()
    else:
        raise SystemExit(f"unknown model {name!r}: scanlm-, lm-, flax-scanlm-, "
                         "tiny-flax-scanlm- and a vocabulary size")
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


def run_dropin(name: str, quick: bool = False, limit: int = MAX_BATCH) -> dict:
    """The largest batch of `jg.jit` over the user's step, beside the step graph's
    (`jgraph_step_graph`, what `jg.Optimizer` plans) and JAX's best hand arrangement's, in the
    same memory; then (unless `quick`) jg.jit's time per example over JAX's best's."""
    plain, params, hand, vocab = model(name)
    cap = jax_temp(plain, params, BASE_BATCH)
    found = {"cap": cap, "name": name, "jax": jax_arrangements(name, hand, params, cap, quick,
                                                               limit)}
    best_label = max(found["jax"], key=found["jax"].get)
    found["jax_best"] = (best_label, found["jax"][best_label])

    def jit_fits(b):
        ok = dropin_fits(plain, params, b, vocab, cap)
        print(f"#   {name} jg.jit batch {b}: {'fits' if ok else 'does not fit'}", file=sys.stderr)
        return ok

    def graph_fits(b):
        ok = jgraph_step_graph(plain, params, b, vocab, cap) is not None
        print(f"#   {name} step graph batch {b}: {'fits' if ok else 'does not fit'}",
              file=sys.stderr)
        return ok

    found["jit"] = largest_batch(jit_fits, low=max(1, found["jax_best"][1]), limit=limit)
    found["graph"] = largest_batch(graph_fits, low=max(1, found["jit"]), limit=limit)
    if not quick and found["jit"] > 0:
        jax_batch = found["jax_best"][1]
        found["time"] = time_ratio(jit_run(plain, cap, params, found["jit"], vocab), found["jit"],
                                   jax_run(hand, best_label, params, jax_batch, vocab), jax_batch)
    return found


def format_dropin(r: dict, limit: int) -> list[str]:
    """`run_dropin`'s findings against issue 40's bar."""

    def batch(b):
        return f"{b}{' (the search limit)' if b >= limit else ''}"

    def ratio(a, b):
        return a / b if b else float("nan")

    label, jax_batch = r["jax_best"]
    jit_graph, jit_jax = ratio(r["jit"], r["graph"]), ratio(r["jit"], jax_batch)
    lines = [f"{r['name']}: memory {r['cap'] / MIB:.1f} MiB (JAX's no-remat step at batch "
             f"{BASE_BATCH})",
             f"  jg.jit(budget=memory) batch {batch(r['jit'])}",
             f"  jg.Optimizer (the step graph) batch {batch(r['graph'])}: jg.jit / it "
             f"{jit_graph:.2f}x (bar >= 0.95: {'met' if jit_graph >= 0.95 else 'missed'})",
             f"  JAX's best, {label}: batch {batch(jax_batch)}: jg.jit / it {jit_jax:.2f}x "
             f"(bar >= 10: {'met' if jit_jax >= 10 else 'missed'})"]
    if "time" in r:
        lines.append(f"  time per example, jg.jit at batch {r['jit']} over JAX's best at batch "
                     f"{jax_batch}: {r['time']:.2f}x "
                     f"(bar <= 1.15: {'met' if r['time'] <= 1.15 else 'missed'})")
    lines += [f"    JAX {arrangement}: {b}" for arrangement, b in r["jax"].items()]
    return lines


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


def jax_arrangements(name: str, hand: dict, params, cap: int, quick: bool,
                     limit: int = MAX_BATCH) -> dict[str, int]:
    """{"arrangement, flags": its largest batch} for JAX's hand arrangements in `cap`."""
    found = {}
    flag_sets = (("XLA defaults", None), ("barriers kept", KEEP_BARRIERS))
    for label, fn in hand.items():
        if quick and "dots_with_no_batch_dims" in label:
            continue
        for flags, options in flag_sets[1:] if quick and label != "no remat" else flag_sets:
            def temp_of(b, fn=fn, options=options):
                return jax_temp(fn, params, b, options)
            best = largest_batch(lambda b, t=temp_of: t(b) <= cap, temp_of=temp_of, cap=cap,
                                 limit=limit)
            found[f"{label}, {flags}"] = best
            print(f"#   {name} JAX {label}, {flags}: batch {best}", file=sys.stderr)
    return found


def run_model(name: str, quick: bool, jax_only: bool = False, limit: int = MAX_BATCH) -> dict:
    plain, params, hand, vocab = model(name)
    cap = jax_temp(plain, params, BASE_BATCH)
    found = {"cap": cap, "jax": jax_arrangements(name, hand, params, cap, quick, limit),
             "name": name}
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
    found["jgraph"] = largest_batch(fits, low=low, limit=limit)
    if not quick and found["jgraph"] > 0:
        jax_batch, jg_batch = found["jax_best"][1], found["jgraph"]
        found["time"] = time_ratio(graph_run(graphs[jg_batch], params, jg_batch, vocab), jg_batch,
                                   jax_run(hand, best_label, params, jax_batch, vocab), jax_batch)
    return found


# -- timing --------------------------------------------------------------------------------------
def jax_run(hand: dict, label: str, params, batch: int, vocab: int):
    """One call of JAX's `label` ("arrangement, flags") step at `batch` on its own state."""
    name, flags = label.rsplit(", ", 1)
    step = jax_adam_step(hand[name], KEEP_BARRIERS if flags == "barriers kept" else None)
    return _stepping(step, params, batch, vocab)


def graph_run(graph, params, batch: int, vocab: int):
    """One call of jgraph's planned step graph at `batch` on its own state."""
    step = jg.compile(graph, donate_argnums=(0, 2))  # (params, tokens, opt_state)
    box = {"p": jax.tree.map(jnp.copy, params), "s": tx().init(params)}
    toks = tokens(batch, vocab)

    def run():
        loss, box["p"], box["s"] = step(box["p"], toks, box["s"])
        return loss

    return run


def jit_run(fn, cap: int, params, batch: int, vocab: int):
    """One call of the user's step under `jg.jit(budget=cap)` at `batch` on its own state."""
    return _stepping(dropin_step(fn, cap), params, batch, vocab)


def _stepping(step, params, batch: int, vocab: int):
    """One call of `step(params, opt_state, tokens) -> (params, opt_state, loss)` on its own
    state, carried from call to call."""
    box = {"p": jax.tree.map(jnp.copy, params), "s": tx().init(params)}
    toks = tokens(batch, vocab)

    def run():
        box["p"], box["s"], loss = step(box["p"], box["s"], toks)
        return loss

    return run


def time_ratio(ours, our_batch: int, jax_step, jax_batch: int) -> float:
    """Our time per example over JAX's, each step at its own batch, timed interleaved."""
    t = interleaved_medians({"jax": jax_step, "jgraph": ours}, repeats=5)
    return (t["jgraph"] / our_batch) / (t["jax"] / jax_batch)


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
    return time_ratio(graph_run(graph, params, jg_batch, vocab), jg_batch,
                      jax_run(hand, jax_label, params, jax_batch, vocab), jax_batch)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="scanlm-4096 scanlm-32768 lm-4096 lm-32768 "
                        "flax-scanlm-4096 flax-scanlm-32768 (tiny-flax-scanlm-VOCAB: a smoke test)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--limit", type=int, default=MAX_BATCH,
                        help=f"the largest batch searched (default {MAX_BATCH})")
    parser.add_argument("--time-at", nargs=3, metavar=("JAX_ARRANGEMENT", "JAX_BATCH",
                                                      "JGRAPH_BATCH"),
                        help="only time one model (the one named) at the largest batches an "
                        "earlier run found, e.g. 'scan(checkpoint(body, nothing_saveable)), "
                        "barriers kept' 12 171")
    parser.add_argument("--jax-only", action="store_true",
                        help="JAX's arrangements only (every one, unless --quick): no planning")
    parser.add_argument("--dropin", action="store_true",
                        help="jg.jit over the user's own step against the step graph "
                        "jg.Optimizer plans and JAX's best arrangement, in the same memory "
                        "(issue 40)")
    args = parser.parse_args(argv)
    if args.dropin:
        for name in args.models or DROPIN_MODELS:
            started = time.perf_counter()
            r = run_dropin(name, args.quick, args.limit)
            print("\n".join(format_dropin(r, args.limit)), flush=True)
            print(f"# {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
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
        results.append(run_model(name, args.quick, args.jax_only, args.limit))
        print(f"# {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print("\n".join(format_rows(results)))


if __name__ == "__main__":
    main()
