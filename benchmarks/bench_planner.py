"""The remat planner's bar (issue 20): budgets met on XLA, gradients, step time, planning time.

Models: the 32-layer tanh chain and the 16-block residual MLP of `bench_remat`, a 6-layer
transformer LM (d_model 256, seq 128, batch 8, 4 heads, MLP 1024), a 64-layer scanned MLP
(`tanh(h @ W[i] + b[i])` in a `lax.scan`, width 128, batch 1024: activations dominate its temp;
at width 512 and batch 256 the gradients XLA stacks for the scan alone are half of it), an
8-level U-Net-shaped MLP (`unet8`: feed-forward blocks of width 256 and 1024, batch 256, each
encoder level's output added to its decoder level's input), its 4-level twin (`unet4`), and the
8-layer transformer LM with its layers in a `lax.scan` (`scanlm8`: vocab 4096, batch 8).

For each model and each budget (25%, 50%, 75% of jgraph's no-remat compiled donated temp; rows
"25%J" ... at the same fractions of JAX's no-remat temp, where that is over 10% larger; rows
"= arrangement" at the temp each hand-written arrangement takes) a row:
- the planned step's temp (compiled again here, from the real arguments) against the budget;
- the largest gradient difference with no remat, compiled, and whether the plan is bitwise
  equal to no remat under `jg.evaluate` (not for the scan: evaluating it eagerly takes minutes);
- the step time against jgraph's no-remat step, and against the fastest hand-written
  `jax.checkpoint` arrangement whose temp fits the same budget. That reference is compiled with
  XLA's `cse_barrier_expander` pass off (`jax.jit(..., compiler_options=KEEP_BARRIERS)`, the
  per-jit form of `XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander`, which keeps JAX's
  remat alive on XLA:CPU) and timed in the same process, interleaved with the plans (medians);
  the ratio is the plan's time over the arrangement's;
- the planning time, and apart from it the seconds spent compiling plans to check them; and two
  last lines: the fast planner's time on a 10k-eqn graph (a 1000-layer chain), and the auto
  planner's on a 50-level U-Net (`planning_time`).

The frontier figure (`--plot PATH`, matplotlib): per model, the recompute flop-equivalents a step
runs (jgraph's cost model, `jgraph.planner.cost.recompute_flops`: a loop body's times its trip
count, where XLA's `cost_analysis` counts a loop body once; JAX's arrangements traced and their
checkpoints applied) against the compiled temp, for budgets from the least the planner reaches to
no remat, with JAX's hand-written arrangements as points.

    python -m benchmarks.bench_planner [--quick] [--plot planner_frontier.png] [models...]

`--planning [--target cpu|tpu]` prints only the planning-time bar (issue 51): per model and
budget (75 / 50 / 25 % and "1%"), the seconds `jg.remat(budget=, target=)` takes from a traced
graph (nothing cached: the unplanned step's compile a percentage needs included) against one
compile of the unplanned step on the same target, how many compiles it ran, and whether its
plan was confirmed by a compile on the model (`info["remat"]["confirmed"]`). On TPU (v5e,
ahead of time: `pip install 'jgraph[tpu]'`, JAX_PLATFORMS=cpu) the scanned LM at batch 8.

    python -m benchmarks.bench_planner --planning [--target cpu|tpu] [models...]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jgraph as jg
from benchmarks import interleaved_medians
from benchmarks.bench_remat import Stepper, block_args, blocks, chain, chain_args, jax_step
from jgraph.memory import donated_step
from jgraph.planner.cost import recompute_flops

MIB = 2**20
BUDGETS = (75, 50, 25)
KEEP_BARRIERS = {"xla_disable_hlo_passes": "cse_barrier_expander"}
cp = jax.checkpoint_policies


# -- models --------------------------------------------------------------------------------------
def transformer_args(layers=6, d=256, seq=128, batch=8, vocab=512):
    keys = iter(jax.random.split(jax.random.PRNGKey(2), 8 * layers + 4))

    def normal(shape, scale):
        return jax.random.normal(next(keys), shape, jnp.float32) * scale

    params = {"embed": normal((vocab, d), 0.02), "lnf": jnp.ones((d,)), "layers": [
        {"ln1": jnp.ones((d,)), "wqkv": normal((d, 3 * d), d**-0.5), "wo": normal((d, d), d**-0.5),
         "ln2": jnp.ones((d,)), "w1": normal((d, 4 * d), d**-0.5),
         "w2": normal((4 * d, d), (4 * d)**-0.5)} for _ in range(layers)]}
    return params, jax.random.randint(next(keys), (batch, seq), 0, vocab)


def _layer_norm(g, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return g * (x - mean) * lax.rsqrt(var + 1e-5)


def transformer_layer(p, x, heads=4):
    b, t, d = x.shape
    h = _layer_norm(p["ln1"], x)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in jnp.split(h @ p["wqkv"], 3, -1))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // heads) ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
    x = x + a @ p["wo"]
    return x + jax.nn.gelu(_layer_norm(p["ln2"], x) @ p["w1"]) @ p["w2"]


def lm_head_loss(params, x, chunks: int | None = None):
    """The LMs' loss head: the final norm, the tied output projection, the mean of
    `-log_softmax(logits)[..., 0]`. With `chunks`, as a JAX expert writes it by hand for a
    large vocabulary (Liger's fused linear cross-entropy, Cut Cross-Entropy): a `lax.scan`
    over `chunks` runs of rows whose body is a `jax.checkpoint`, so one run's logits exist at
    a time (`chunks` divides batch x seq)."""
    if chunks is None:
        logits = _layer_norm(params["lnf"], x) @ params["embed"].T
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    @jax.checkpoint
    def run(total, rows):
        logits = _layer_norm(params["lnf"], rows) @ params["embed"].T
        return total + jnp.sum(jax.nn.logsumexp(logits, -1) - logits[:, 0]), None

    rows = x.reshape(chunks, -1, x.shape[-1])
    total, _ = lax.scan(run, jnp.zeros((), x.dtype), rows)
    return total / (x.shape[0] * x.shape[1])


def transformer(wrap=lambda f: f, segment=1, head_chunks: int | None = None):
    """The LM; `wrap` (a `jax.checkpoint`) around each run of `segment` layers; the loss head in
    `head_chunks` checkpointed runs of rows when given (`lm_head_loss`)."""

    def run(ps, x):
        for p in ps:
            x = transformer_layer(p, x)
        return x

    def loss(params, tokens):
        x, layers = params["embed"][tokens], params["layers"]
        for i in range(0, len(layers), segment):
            x = wrap(run)(layers[i:i + segment], x)
        return lm_head_loss(params, x, head_chunks)

    return loss


def scanned_args(layers=64, width=128, batch=1024):
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    return ({"w": jax.random.normal(k1, (layers, width, width)) * width**-0.5,
             "b": jnp.zeros((layers, width))}, jax.random.normal(k2, (batch, width)))


def _scan_body(h, p):
    return jnp.tanh(h @ p["w"] + p["b"]), None


def scanned(wrap=lambda f: f, split=(), inner=lambda f: f):
    """The scanned MLP; `wrap` around the body, or scans nested by `split` (the layers of each
    checkpointed chunk, outermost first: (16, 4) scans 4 chunks of 16 layers, each 4 chunks of
    4; `inner` around the innermost body)."""

    def run(h, params, sizes):
        if not sizes:
            return lax.scan(inner(wrap(_scan_body)), h, params)[0]
        chunks = jax.tree.map(lambda a: a.reshape(-1, sizes[0], *a.shape[1:]), params)
        step = jax.checkpoint(lambda h, ps: (run(h, ps, sizes[1:]), None))
        return lax.scan(step, h, chunks)[0]

    def loss(params, x):
        return jnp.mean(run(x, params, split) ** 2)

    return loss


def unet_args(levels=8, width=256, batch=256):
    """A U-Net-shaped MLP's params: per level an encoder and a decoder feed-forward block."""
    keys = iter(jax.random.split(jax.random.PRNGKey(4), 4 * levels + 2))

    def block():
        return {"w1": jax.random.normal(next(keys), (width, 4 * width)) * width**-0.5,
                "w2": jax.random.normal(next(keys), (4 * width, width)) * (4 * width)**-0.5}

    params = {"enc": [block() for _ in range(levels)], "dec": [block() for _ in range(levels)]}
    return params, jax.random.normal(next(keys), (batch, width))


def unet(wrap=lambda f: f):
    """Each encoder level's output is read again by its decoder level (long skips cross every
    cut of the chain); `wrap` (a `jax.checkpoint`) around each layer."""
    layer = wrap(lambda p, h: jnp.tanh(jax.nn.gelu(h @ p["w1"]) @ p["w2"]))

    def loss(params, x):
        skips, h = [], x
        for p in params["enc"]:
            h = layer(p, h)
            skips.append(h)
        for p, s in zip(params["dec"], reversed(skips), strict=True):
            h = layer(p, h + s)
        return jnp.mean(h**2)

    return loss


def scanned_lm_args(layers=8, d=256, seq=128, batch=8, vocab=4096):
    """The LM's params with its layers stacked for `lax.scan` (flax's `nn.scan`, MaxText)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(5), 16))

    def normal(shape, scale):
        return jax.random.normal(next(keys), shape, jnp.float32) * scale

    n = layers
    params = {"embed": normal((vocab, d), 0.02), "lnf": jnp.ones((d,)), "layers": {
        "ln1": jnp.ones((n, d)), "wqkv": normal((n, d, 3 * d), d**-0.5),
        "wo": normal((n, d, d), d**-0.5), "ln2": jnp.ones((n, d)),
        "w1": normal((n, d, 4 * d), d**-0.5), "w2": normal((n, 4 * d, d), (4 * d)**-0.5)}}
    return params, jax.random.randint(next(keys), (batch, seq), 0, vocab)


def scanned_lm(wrap=lambda f: f, head_chunks: int | None = None):
    """The transformer LM with `lax.scan` over its stacked layers; `wrap` around the body; the
    loss head in `head_chunks` checkpointed runs of rows when given (`lm_head_loss`)."""

    def body(x, p):
        return transformer_layer(p, x), None

    def loss(params, tokens):
        x, _ = lax.scan(wrap(body), params["embed"][tokens], params["layers"])
        return lm_head_loss(params, x, head_chunks)

    return loss


def _chain_nested(params, x):
    """Binary nested checkpoints over the 32 layers (recursive halves)."""
    def run(ws, h):
        if len(ws) == 1:
            w, b = ws[0]
            return jnp.tanh(h @ w + b)
        half = len(ws) // 2
        return jax.checkpoint(run)(ws[half:], jax.checkpoint(run)(ws[:half], h))

    h = run(params, x)
    return jnp.mean(h * h)


def _blocks_segments(k):
    """The residual MLP with each run of `k` blocks one `jax.checkpoint` region."""
    def run(ps, h):
        for w1, w2 in ps:
            h = h + jnp.tanh(h @ w1) @ w2
        return h

    def loss(params, x):
        h = x
        for i in range(0, len(params), k):
            h = jax.checkpoint(run)(params[i:i + k], h)
        return jnp.mean(h * h)

    return loss


def models():
    """{name: (traced function, args, {hand-written JAX arrangement: function})}."""
    ckpt = jax.checkpoint
    return {
        "chain32": (chain(), chain_args(), {
            "no remat": chain(), "checkpoint per layer": chain(1),
            **{f"{k}-layer segments": chain(k) for k in (2, 4, 6, 8, 16)},
            "nested halves": _chain_nested,
            "dots_saveable, whole model": ckpt(chain(), policy=cp.dots_saveable)}),
        "resmlp16": (blocks(), block_args(), {
            "no remat": blocks(), "checkpoint per block": blocks(True),
            "per block, dots_with_no_batch_dims": blocks(True, cp.dots_with_no_batch_dims_saveable),
            **{f"{k}-block segments": _blocks_segments(k) for k in (2, 4, 8)},
            "nothing_saveable, whole model": ckpt(blocks(), policy=cp.nothing_saveable)}),
        "transformer6": (transformer(), transformer_args(), {
            "no remat": transformer(), "checkpoint per layer": transformer(ckpt),
            "per layer, dots_saveable": transformer(lambda f: ckpt(f, policy=cp.dots_saveable)),
            "per layer, dots_with_no_batch_dims": transformer(
                lambda f: ckpt(f, policy=cp.dots_with_no_batch_dims_saveable)),
            "2-layer segments": transformer(ckpt, 2), "3-layer segments": transformer(ckpt, 3)}),
        "scan64": (scanned(), scanned_args(), {
            "no remat": scanned(), "scan(checkpoint(body))": scanned(ckpt),
            "scan(checkpoint(body, dots_saveable))": scanned(
                lambda f: ckpt(f, policy=cp.dots_saveable)),
            "8 x 8 nested scans": scanned(split=(8,)),
            "8 x 8 nested scans, checkpointed body": scanned(split=(8,), inner=ckpt),
            "4 x 4 x 4 nested scans": scanned(split=(16, 4)),
            "4 x 4 x 4 nested scans, checkpointed body": scanned(split=(16, 4), inner=ckpt)}),
        "unet4": (unet(), unet_args(levels=4), {
            "no remat": unet(), "checkpoint per layer": unet(ckpt),
            "per layer, dots_saveable": unet(lambda f: ckpt(f, policy=cp.dots_saveable))}),
        "unet8": (unet(), unet_args(), {
            "no remat": unet(), "checkpoint per layer": unet(ckpt),
            "per layer, dots_saveable": unet(lambda f: ckpt(f, policy=cp.dots_saveable))}),
        "scanlm8": (scanned_lm(), scanned_lm_args(), {
            "no remat": scanned_lm(), "scan(checkpoint(body))": scanned_lm(ckpt),
            "scan(checkpoint(body, dots_saveable))": scanned_lm(
                lambda f: ckpt(f, policy=cp.dots_saveable))}),
    }


# -- measuring -----------------------------------------------------------------------------------
def compiled_temp(step, *args) -> int:
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


def jgraph_step(graph, args):
    step, split = donated_step(graph)
    state, rest = split(*args)
    return step, state, rest


def grad_difference(gb, gr, args, evaluate):
    """(largest |difference| of the compiled gradients, bitwise under jg.evaluate or None)."""
    got, want = jg.compile(gr)(*args)[1], jg.compile(gb)(*args)[1]
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    bitwise = None
    if evaluate:
        bitwise = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
            jax.tree.leaves(jg.evaluate(gr, *args)), jax.tree.leaves(jg.evaluate(gb, *args)),
            strict=True))
    return diff, bitwise


def traced_recompute(fn, args) -> float:
    """Recompute flop-equivalents a step of `fn` runs, by jgraph's cost model (a loop body's
    times its trip count; XLA's `cost_analysis` counts a loop body once): its own
    `jax.checkpoint` regions, as jgraph applies them."""
    gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
    return recompute_flops(jg.remat(gb) if gb.regions else gb)


def jax_arrangements(name: str) -> dict:
    """{arrangement: (its Stepper, {temp, flops})}: JAX's hand-written arrangements, compiled
    with the barrier expander off (`KEEP_BARRIERS`)."""
    _, args, variants = models()[name]
    found = {}
    for label, fn in variants.items():
        step = jax_step(fn, KEEP_BARRIERS)
        temp = compiled_temp(step, *args)
        found[label] = (Stepper(step, args[0], args[1]),
                        {"temp": temp, "flops": traced_recompute(fn, args)})
    return found


def plan_model(name: str, repeats: int):
    """(rows of the bar table, the model's frontier points, JAX's arrangements)."""
    fn, args, _ = models()[name]
    gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
    step, state, rest = jgraph_step(gb, args)
    no_temp = compiled_temp(step, state, rest)
    arrangements = jax_arrangements(name)
    steppers = {"no remat": Stepper(step, state, rest)} | {
        ("jax", label): stepper for label, (stepper, _) in arrangements.items()}
    rows = []
    hand = {label: found["temp"] for label, (_, found) in arrangements.items()
            if label != "no remat"}
    for percent, budget in budgets(no_temp, arrangements["no remat"][1]["temp"], hand):
        try:
            gr = jg.remat(gb, budget=budget)
        except jg.TransformError as error:
            rows.append({"model": name, "percent": percent, "budget": budget,
                         "error": str(error)})
            continue
        step, state, rest = jgraph_step(gr, args)
        temp = compiled_temp(step, state, rest)
        diff, bitwise = grad_difference(gb, gr, args, evaluate=name not in ("scan64", "scanlm8"))
        report = gr.info["remat"]
        steppers[percent] = Stepper(step, state, rest)
        rows.append({"model": name, "percent": percent, "budget": budget, "temp": temp,
                     "flops": recompute_flops(gr), "diff": diff, "bitwise": bitwise,
                     "planning": report["planning_seconds"], "xla": report["xla_seconds"],
                     "used": report.get("used", "-"), "plan": report["plan"],
                     "no_remat": (no_temp, arrangements["no remat"][1]["temp"])})
    times = interleaved_medians(steppers, repeats=repeats, warmup=1)
    jax_no_remat = times[("jax", "no remat")]
    figures = {label: found | {"time": times[("jax", label)] / jax_no_remat}
               for label, (_, found) in arrangements.items()}
    for row in rows:
        if "temp" in row:
            row["time"] = times[row["percent"]] / times["no remat"]
            row["time_vs_jax"] = times[row["percent"]] / jax_no_remat
    return rows, (no_temp, gb, args), figures


def budgets(no_temp: int, jax_no_temp: int, hand: dict | None = None) -> list[tuple[str, int]]:
    """[(label, bytes)]: `BUDGETS` of jgraph's no-remat temp; where JAX's no-remat step needs
    over 10% more (a scan: jgraph does not stack a layer's output that is the next layer's
    input), the same fractions of JAX's too, for a comparison at the bytes JAX starts from; and
    `= arrangement` at the temp each hand arrangement (`hand`, {label: bytes}) takes, where it is
    below jgraph's no remat: the planner must meet what a user can write."""
    found = [(f"{p}%", p * no_temp // 100) for p in BUDGETS]
    if jax_no_temp > 1.1 * no_temp:
        found += [(f"{p}%J", p * jax_no_temp // 100) for p in BUDGETS]
    found += [(f"= {label}", temp) for label, temp in (hand or {}).items() if temp < no_temp]
    return found


def frontier(no_temp, gb, args, points):
    """[(compiled temp, recompute flops)] of fast plans at budgets from the least to no remat."""
    least = None
    try:
        jg.remat(gb, budget=1, planner="fast")
    except jg.TransformError as error:
        text = str(error).split("reaches is ")[1]
        least = int(text.split(" bytes")[0])
    found = [(no_temp, 0.0)]
    for budget in np.linspace(least or no_temp // 4, no_temp, points)[:-1]:
        try:
            gr = jg.remat(gb, budget=int(budget), planner="fast")
        except jg.TransformError:
            continue
        temp = compiled_temp(*jgraph_step(gr, args))
        found.append((temp, recompute_flops(gr)))
    return sorted(found)


def long_chain(layers=1000, width=16, batch=64):
    """A 10k-eqn joint graph: a tanh chain of 1000 layers (the fast planner's time bar)."""
    ws = [jnp.full((width, width), 0.01, jnp.float32) for _ in range(layers)]

    def loss(ws, h):
        for w in ws:
            h = jnp.tanh(h @ w + 1.0)
        return jnp.sum(h)

    return jg.backward(jg.trace(loss, ws, jnp.ones((batch, width)), param_argnums=0))


def planning_time() -> str:
    """The planning-time bar (issue 27): the fast planner on the 10k-eqn chain within 3 s, and
    a 50-level U-Net (`unet_args(50)`, planner="auto") within 30 s. `planning` is the report's
    `planning_seconds` (the search, without the compiles of the plans it checks with XLA, which
    `xla_seconds` counts); `in all` is `jg.remat`'s whole call, both attempts (the graph as it
    is, and with its loss head in chunks of rows) and every compile included."""
    gb = long_chain()
    report, seconds = _timed_remat(gb, planner="fast")
    fn, args = unet(), unet_args(levels=50)
    ub = jg.backward(jg.trace(fn, *args, param_argnums=0))
    unet_report, unet_seconds = _timed_remat(ub, planner="auto")
    return (f"fast planner on a {len(gb.eqns)}-eqn graph at 50%: planning "
            f"{report['planning_seconds']:.1f} s (+ {report['xla_seconds']:.1f} s compiling "
            f"{report['retries'] + 2} steps to check them; jg.remat in all {seconds:.1f} s), "
            f"temp {report['xla_temp'] / MIB:.2f}/{report['budget'] / MIB:.2f} MiB\n"
            f"50-level U-Net ({len(ub.eqns)} eqns, planner='auto', used "
            f"{unet_report.get('used')}) at 50%: planning {unet_report['planning_seconds']:.1f} s "
            f"(+ {unet_report['xla_seconds']:.1f} s compiling; jg.remat in all "
            f"{unet_seconds:.1f} s), temp {unet_report['xla_temp'] / MIB:.2f}/"
            f"{unet_report['budget'] / MIB:.2f} MiB")


def _timed_remat(gb, planner: str):
    started = time.perf_counter()
    report = jg.remat(gb, budget="50%", planner=planner).info["remat"]
    return report, time.perf_counter() - started


def best_fitting(arrangements: dict, budget: int):
    fitting = {k: v for k, v in arrangements.items() if v["temp"] <= budget}
    if not fitting:
        return None, None
    label = min(fitting, key=lambda k: fitting[k]["time"])
    return label, fitting[label]


# -- the table -----------------------------------------------------------------------------------
def run(names, quick: bool, plot: str | None):
    repeats = 7 if quick else 15  # the timings of a busy 2-core machine need many
    table, figure = [], {}
    for name in names:
        started = time.perf_counter()
        rows, (no_temp, gb, args), arrangements = plan_model(name, repeats)
        for row in rows:
            label, best = best_fitting(arrangements, row["budget"])
            row["jax"], row["jax_best"] = label, best
        table += rows
        if plot:
            figure[name] = (frontier(no_temp, gb, args, 4 if quick else 7),
                            arrangements, no_temp)
        print(f"# {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return table, figure


def format_rows(table) -> list[str]:
    lines = ["model         budget  MiB (budget)   temp ok  max|dg|   bitwise  time/no-remat  "
             "best JAX fitting (time/its no-remat)            ratio  plan s  xla s  planner"]
    for r in table:
        head = f"{r['model']:<13} {r['percent']:>5}  {r['budget'] / MIB:7.2f}"
        if "error" in r:
            lines.append(f"{head}  unreachable: {r['error'][:150]}")
            continue
        best = r["jax_best"]
        jax_text = "none fits" if best is None else f"{r['jax']} ({best['time']:.2f}x)"
        ratio = "-" if best is None else f"{r['time_vs_jax'] / best['time']:.2f}"
        bitwise = {None: "-", True: "yes", False: "NO"}[r["bitwise"]]
        fits = "yes" if r["temp"] <= r["budget"] else "NO"
        lines.append(f"{head}  {r['temp'] / MIB:7.2f} {fits:>3}  {r['diff']:8.1e}  {bitwise:>7}  "
                     f"{r['time']:12.2f}x  {jax_text:<46} {ratio:>5}  {r['planning']:6.1f}  "
                     f"{r['xla']:5.1f}  {r['used']}")
    lines.append("plans (no-remat temp of jgraph / of JAX, MiB):")
    for r in table:
        if "plan" in r:
            ours, theirs = r["no_remat"]
            lines.append(f"  {r['model']:<13} {r['percent']:>5}  ({ours / MIB:.1f} / "
                         f"{theirs / MIB:.1f})  {r['plan']}")
    return lines


def draw(figure, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, (name, (points, arrangements, _)) in zip(axes.ravel(), figure.items(),
                                                     strict=False):
        temps, flops = zip(*points, strict=True)
        ax.plot(np.array(temps) / MIB, np.array(flops) / 1e9, "o-", label="jg.remat(budget=)")
        for label, a in arrangements.items():
            ax.scatter(a["temp"] / MIB, a["flops"] / 1e9,
                       marker="x")
            ax.annotate(label, (a["temp"] / MIB, a["flops"] / 1e9), fontsize=6)
        ax.set_title(name)
        ax.set_xlabel("compiled temp (MiB)")
        ax.set_ylabel("recompute GFLOP per step (jgraph's cost model)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def rows(quick: bool = False) -> list[dict]:
    """Rows for `benchmarks.run`: per model and budget, the planned step time against the
    fastest fitting JAX arrangement (each against its own no remat)."""
    table, _ = run(["chain32", "resmlp16"] if quick else list(models()), quick, None)
    out = []
    for r in table:
        name = f"planner {r['model']} {r['percent']}"
        if "error" in r:
            out.append({"benchmark": name, "jgraph": "-", "reference": "-", "ratio": "-",
                        "note": r["error"][:100]})
            continue
        best = r["jax_best"]
        out.append({"benchmark": f"{name}: temp {r['temp'] / MIB:.1f}/{r['budget'] / MIB:.1f} "
                                 "MiB, step time vs no remat",
                    "jgraph": f"{r['time']:.2f}x",
                    "reference": "-" if best is None else f"{best['time']:.2f}x",
                    "ratio": "-" if best is None else r["time_vs_jax"] / best["time"],
                    "note": f"reference: {r['jax'] or 'no JAX arrangement fits'}"})
    return out


PLANNING_BUDGETS = ("75%", "50%", "25%", "1%")


def planning(names, platform: str) -> list[str]:
    """The planning-time table (module docstring)."""
    import warnings

    from jgraph.memory import compiled as compiled_module
    from jgraph.memory import model as model_module
    from jgraph.memory.compiled import lowered_step
    from jgraph.target import resolve

    if platform == "tpu":
        from jax.experimental import topologies

        target = resolve(topologies.get_topology_desc(platform="tpu",
                                                      topology_name="v5e:2x2").devices[0])
    else:
        target = resolve(platform)
    lines = ["model      budget   one compile s  planning s  ratio  compiles  confirmed  "
             "figure/budget"]
    measured = compiled_module._measured
    for name in names:
        fn, args, _ = models()[name]
        gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
        started = time.perf_counter()
        lowered_step(gb, target)[1].compile(compiler_options=target.compile_options)
        one = time.perf_counter() - started
        for budget in PLANNING_BUDGETS:
            compiled_module._CACHE.clear()
            model_module._CALIBRATIONS.pop(gb, None)
            compiles = []
            compiled_module._measured = lambda *a: compiles.append(a) or measured(*a)
            started = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    gr = jg.remat(gb, budget=budget, target=target)
                info = gr.info.get("remat", {})
                confirmed = info.get("confirmed", "-")
                fits = f"{info.get('xla_temp', 0) / max(info.get('budget', 1), 1):.3f}" \
                    if "budget" in info else "-"
            except jg.TransformError as error:
                confirmed, fits = "-", f"error: {str(error)[:60]}"
            finally:
                compiled_module._measured = measured
            took = time.perf_counter() - started
            lines.append(f"{name:<10} {budget:>5}  {one:13.1f}  {took:10.1f}  {took / one:5.1f}"
                         f"  {len(compiles):8d}  {confirmed:>9}  {fits}")
            print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*",
                        help="chain32 resmlp16 transformer6 scan64 unet4 unet8 scanlm8")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plot", help="write the frontier figure (PNG) here")
    parser.add_argument("--planning", action="store_true",
                        help="only the planning time against one compile (issue 51)")
    parser.add_argument("--target", default="cpu", help="cpu or tpu (with --planning)")
    args = parser.parse_args(argv)
    if args.planning:
        print("\n".join(planning(args.models or list(models()), args.target)))
        return
    table, figure = run(args.models or list(models()), args.quick, args.plot)
    print("\n".join(format_rows(table)))
    print(planning_time())
    if args.plot:
        draw(figure, args.plot)
        print(f"frontier: {args.plot}")


if __name__ == "__main__":
    main()
