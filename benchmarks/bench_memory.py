"""jg.memory against XLA: the estimate of the donated step's temp bytes vs `temp_size_in_bytes`.

For every model of the test suite's corpus (`tests/models.py`) and of its real-model suite
(`tests/real_models.py`: flax, haiku, equinox), the DESIGN §5 reference models of
`benchmarks/bench_remat.py` (a 32-layer tanh chain, a 16-block residual MLP) with and without
remat, a transformer LM (embedding, pre-LN blocks, tied head) with and without remat, scanned
models of `benchmarks/bench_loops.py` and the demo's training graphs: the joint graph
(`jg.backward`, regions applied with `jg.remat`), `jg.memory(graph).peak_bytes` and
`jg.compiled_memory(graph, *args).temp_bytes` (XLA:CPU, default flags), and their ratio. The
issue's bar: every ratio within [0.75, 1.25].

    python -m benchmarks.bench_memory [--quick] [--plot memory.png]

With `--target cpu|tpu`: the model of `jgraph.memory.model` against the target's own fit figure
(temp on CPU; on TPU the HBM need, exact), per model and plan: every hand-written arrangement
of `bench_planner`'s models and the scanned LM (traced as checkpoint regions, `jg.remat`), two
graphs no rule was written against, the real-model suite of the tests (flax, haiku, equinox, with
their own `remat` as written), and on CPU the planner's plans at 75 / 50 / 25 %; each predicted
from the one calibration compile of its unplanned step. On TPU (ahead of time, `pip install
'jgraph[tpu]'`, JAX_PLATFORMS=cpu), models whose activations exceed the VMEM: the 8-layer MLP
of `reference/tpu-figures.md` (d 1024, batch 4096 and 16384) and the scanned LM at vocab 4096
(batch 16 and 64). The issue's bar: every error within 10 %.

    python -m benchmarks.bench_memory --target cpu|tpu [--quick] [--all] [--models NAME,...]

`--all` on TPU adds `bench_planner`'s models, the unseen graphs and the real-model suite (their
plans as on CPU, the planner's at 50 %): about two hours of compiles. On CPU (and on TPU with
`--all`) training steps as jgraph builds them come last: a scanned MLP's adam step, alone and
accumulating over a period, unfused and with its updates fused, and the planner's plans of them;
on CPU before them whole steps a user writes, as `jg.jit(budget=...)` plans them (an MLP's and a
transformer block's adam steps, Haiku's MNIST update).
`--models` keeps the models named by the comma-separated words or whose name contains one (a
long run resumed where it stopped).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jgraph as jg

MIB = 2**20
BAR = (0.75, 1.25)


# -- a transformer LM --------------------------------------------------------------------------
def _layer_norm(x, p):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def lm_block(p, x, heads):
    b, t, d = x.shape
    q, k, v = jnp.split(_layer_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
    split = lambda a: a.reshape(b, t, heads, d // heads)  # noqa: E731
    scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(d // heads)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), split(v)).reshape(b, t, d)
    x = x + attn @ p["proj"]
    return x + jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["up"]) @ p["down"]


def transformer_lm(remat=False, heads=4):
    """A GPT-style LM: token and position embeddings, pre-LN blocks, tied head, mean
    cross-entropy of the next token. With `remat`, each block is a `jax.checkpoint`."""
    block = jax.checkpoint(lm_block, static_argnums=(2,)) if remat else lm_block

    def loss(params, tokens):
        x = params["embed"][tokens[:, :-1]] + params["pos"]
        for p in params["blocks"]:
            x = block(p, x, heads)
        logits = _layer_norm(x, params["ln"]) @ params["embed"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss


def lm_args(layers=2, d=64, t=32, batch=2, vocab=128):
    rng = np.random.default_rng(3)

    def w(*shape):
        return jnp.asarray((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32))

    def ln():
        return {"scale": jnp.ones(d, jnp.float32), "bias": jnp.zeros(d, jnp.float32)}

    blocks = [{"ln1": ln(), "qkv": w(d, 3 * d), "proj": w(d, d), "ln2": ln(), "up": w(d, 4 * d),
               "down": w(4 * d, d)} for _ in range(layers)]
    params = {"embed": w(vocab, d), "pos": w(t, d) * 0.1, "blocks": blocks, "ln": ln()}
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, t + 1), dtype=np.int32))
    return params, tokens


# -- the cases ---------------------------------------------------------------------------------
def _joint(fn, args, param_argnums=0, has_aux=False, policy=None):
    gb = jg.backward(jg.trace(fn, *args, param_argnums=param_argnums, has_aux=has_aux))
    if policy is not None or gb.regions:
        gb = jg.remat(gb, policy=policy)
    return gb


def _budget(fn, args, fraction):
    """The joint graph planned by `jg.remat(gb, budget=...)` at `fraction` of no remat's estimate
    (None when the planner finds no plan)."""
    gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
    try:
        return jg.remat(gb, budget=int(fraction * jg.memory(gb).peak_bytes)), args
    except jg.TransformError:
        return None


def _suite_cases():
    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import models
    import real_models

    for spec in models.MODELS:
        args = spec.args(seed=0)
        yield f"corpus {spec.name}", lambda s=spec, a=args: (
            _joint(s.fn, a, s.param_argnums, s.has_aux), a)
    for model in real_models.MODELS:
        yield f"real {model.name}", lambda m=model: (
            _joint(m.built[0], m.built[1], 0, m.has_aux), m.built[1])


def _reference_cases(quick):
    from benchmarks import bench_loops as loops
    from benchmarks import bench_remat as remat

    chain_args = remat.chain_args(layers=8 if quick else 32)
    for name, fn in (("no remat", remat.chain()), ("checkpoint per layer", remat.chain(1)),
                     ("sqrt(N) segments", remat.chain(2 if quick else 6))):
        yield f"chain{len(chain_args[0])} {name}", lambda f=fn: (_joint(f, chain_args),
                                                                 chain_args)
    yield f"chain{len(chain_args[0])} budget 50%", lambda: _budget(remat.chain(), chain_args, 0.5)
    yield f"chain{len(chain_args[0])} dots_saveable", lambda: (
        _joint(remat.chain(), chain_args, policy=jg.policies.dots_saveable), chain_args)
    block_args = remat.block_args(blocks=4 if quick else 16)
    for name, fn in (("no remat", remat.blocks()), ("checkpoint per block", remat.blocks(True))):
        yield f"resmlp{len(block_args[0])} {name}", lambda f=fn: (_joint(f, block_args),
                                                                  block_args)
    shape = dict(layers=2, d=64, t=64, batch=4) if quick else dict(layers=8, d=256, t=256,
                                                                   batch=8)
    args = lm_args(**shape)
    label = f"transformer LM x{shape['layers']} d{shape['d']} seq{shape['t']}"
    yield f"{label} no remat", lambda: (_joint(transformer_lm(), args), args)
    yield f"{label} checkpoint per block", lambda: (_joint(transformer_lm(True), args), args)
    yield f"{label} budget 75%", lambda: _budget(transformer_lm(), args, 0.75)
    yield f"{label} dots_saveable", lambda: (
        _joint(transformer_lm(), args, policy=jg.policies.dots_saveable), args)
    margs = loops.mlp_args(16 if quick else 64)
    yield f"scanned MLP L={len(margs[0][0])}", lambda: (_joint(loops.scanned_mlp, margs), margs)
    targs = loops.transformer_args(layers=2 if quick else 6, d=64 if quick else 256,
                                   t=32 if quick else 128, batch=4 if quick else 8)
    for ck in (False, True):
        yield (f"scanned transformer x{len(targs[0]['qkv'])}"
               f"{' checkpoint per layer' if ck else ''}"), lambda c=ck: (
            _joint(loops.scanned_transformer(c), targs), targs)
    largs = loops.lstm_args(steps=50 if quick else 200)
    yield f"LSTM {len(largs[1])} steps", lambda: (_joint(loops.lstm, largs), largs)


def _demo_cases(quick):
    from jgraph.training import demo

    ds, n_in = demo.load_digits_dataset()
    params = demo.init_params(jax.random.PRNGKey(0), n_in)
    for batch in (16,) if quick else (16, 512):
        x, y = ds.batch(0, batch)
        for remat in (False, True):
            opt = jg.Optimizer(demo.model, optax.adam(1e-3), loss="cross_entropy", period=4,
                               remat=remat or None)
            state = opt.init(params, x, y)
            for name in ("grad", "opt"):
                args = (state.params, x, y, state.grad_acc, np.int32(0)) + (
                    (state.opt_state,) if name == "opt" else ())
                yield (f"demo {name} micro-batch {batch}{' remat' if remat else ''}",
                       lambda o=opt, n=name, a=args: (o.graphs[n], a))


def cases(quick: bool = False):
    yield from _suite_cases()
    yield from _reference_cases(quick)
    yield from _demo_cases(quick)


def measure(make):
    made = make()
    if made is None:  # a budget no plan meets
        return None
    graph, args = made
    start = time.perf_counter()
    estimate = jg.memory(graph).peak_bytes
    took = time.perf_counter() - start
    with warnings.catch_warnings():  # a step that cannot reuse donated buffers says so
        warnings.simplefilter("ignore", UserWarning)
        temp = jg.compiled_memory(graph, *args).temp_bytes
    return estimate, temp, took


def _size(n: int) -> str:
    return f"{n / MIB:.2f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB"


def rows(quick: bool = False) -> list[dict]:
    out = []
    for name, make in cases(quick):
        measured = measure(make)
        if measured is None:
            continue
        estimate, temp, took = measured
        ratio = estimate / temp if temp else float(estimate == 0)
        inside = BAR[0] <= ratio <= BAR[1]
        out.append({"benchmark": f"memory {name}: estimate vs XLA temp",
                    "jgraph": _size(estimate), "reference": _size(temp), "ratio": ratio,
                    "note": f"{'ok' if inside else 'OUTSIDE'} [0.75, 1.25]; estimate "
                            f"{took * 1e3:.0f} ms"})
    return out


# -- the model against a target's figure ---------------------------------------------------------
def _tpu_models(quick: bool):
    """{name: (fn, args, {arrangement: fn})} of steps whose activations exceed a v5e's VMEM."""
    from benchmarks.bench_fit import mlp_loss as mlp
    from benchmarks.bench_max_batch import model as max_batch_model

    ws = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 8
    found = {}
    for batch in (4096,) if quick else (4096, 16384):
        x = jax.ShapeDtypeStruct((batch, 1024), jnp.float32)
        found[f"mlp8 batch {batch}"] = (mlp(False), (ws, x), {"checkpoint per layer": mlp(True)})
        found[f"mlp8 batch {batch}"][2]["policies"] = ("nothing_saveable", "dots_saveable")
    plain, params, hand, _ = max_batch_model("scanlm-4096")
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    for batch in (16,) if quick else (16, 64):
        toks = jax.ShapeDtypeStruct((batch, 128), jnp.int32)
        found[f"scanlm8 batch {batch}"] = (plain, (params, toks), {
            "scan(checkpoint(body))": hand["scan(checkpoint(body, nothing_saveable))"],
            "policies": ("dots_saveable",)})
    return found


def gated_mlp(wrap=lambda f: f):
    """A gated residual MLP whose blocks all read the input (`wrap` around each block): XLA:CPU
    writes the gate's product and the residual sum to buffers where jgraph's fusion rules alone
    would fuse them."""
    def block(h, x0, p):
        z = h + 0.5 * x0
        return h + (jax.nn.silu(z @ p["g"]) * (z @ p["u"])) @ p["o"]

    def loss(ps, x):
        h = x
        for p in ps:
            h = wrap(block)(h, x, p)
        return jnp.mean(jnp.square(h))
    return loss


def _unseen_models():
    """Graphs no planner rule or test was written against: a gated residual MLP whose blocks all
    read the input too, and a U-Net-shaped MLP whose decoder multiplies its skips in."""
    ckpt = jax.checkpoint
    rng = np.random.default_rng(7)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)

    d, hidden, batch, n = 384, 1024, 192, 10
    gated_params = [{"g": w(d, hidden), "u": w(d, hidden), "o": w(hidden, d)} for _ in range(n)]
    x = jnp.asarray(rng.standard_normal((batch, d)), jnp.float32)

    gated = gated_mlp
    widths = [512, 384, 256, 192, 128]
    unet_params = {"down": [w(a, b) for a, b in zip(widths, widths[1:], strict=False)],
                   "up": [w(b, a) for a, b in zip(widths, widths[1:], strict=False)][::-1]}
    xu = jnp.asarray(rng.standard_normal((256, widths[0])), jnp.float32)

    def unet(wrap=lambda f: f):
        down = wrap(lambda h, m: jax.nn.gelu(h @ m))
        up = wrap(lambda h, skip, m: jnp.tanh(h @ m) * (1 + jax.nn.sigmoid(skip)))

        def loss(p, x):
            skips, h = [], x
            for m in p["down"]:
                skips.append(h)
                h = down(h, m)
            for m, skip in zip(p["up"], reversed(skips), strict=True):
                h = up(h, skip, m)
            return jnp.mean(h**2)
        return loss

    return {
        "gated10 (unseen)": (gated(), (gated_params, x), {
            "checkpoint per block": gated(ckpt),
            "per block, dots_saveable": gated(
                lambda f: ckpt(f, policy=jax.checkpoint_policies.dots_saveable))}),
        "unet-mul5 (unseen)": (unet(), (unet_params, xu), {
            "checkpoint per layer": unet(ckpt)}),
    }


def _real_models():
    """The real-model suite of the tests (`tests/real_models.py`: flax, haiku, equinox), each as
    its library writes it (its own `remat` regions included)."""
    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import real_models

    return {f"real {m.name}": (m.built[0], m.built[1], {"has_aux": m.has_aux})
            for m in real_models.MODELS}


def target_rows(platform: str, quick: bool = False, everything: bool = False,
                models: tuple[str, ...] = ()):
    """(model, plan, predicted, compiled) per model and plan on the target; on TPU with
    `everything`, `bench_planner`'s models and the real-model suite too; with `models`, the
    models whose name contains one of them."""
    from benchmarks.bench_planner import models as planner_models
    from jgraph.target import resolve

    if platform == "tpu":
        from jax.experimental import topologies

        target = topologies.get_topology_desc(platform="tpu",
                                              topology_name="v5e:2x2").devices[0]
        found = _tpu_models(quick)
        if everything:
            found.update({**planner_models(), **_unseen_models(), **_real_models()})
        budgets = ("50%",)
    else:
        target, budgets = resolve(platform), ("75%", "50%", "25%")
        found = {**planner_models(), **_unseen_models(), **_real_models()}
        if quick:
            found = {k: found[k] for k in ("chain32", "transformer6", "scan64")}
    if models:
        found = {k: v for k, v in found.items()  # a whole name is that model alone
                 if any(m == k or (m in k and m not in found) for m in models)}
    for name, (fn, args, hand) in found.items():
        has_aux = hand.pop("has_aux", False) if "has_aux" in hand else False
        traced = jg.backward(jg.trace(fn, *args, param_argnums=0, has_aux=has_aux))
        plain = jg.remat(traced).info["unplanned"] if traced.regions else traced
        plans = {"no remat": plain}
        if traced.regions:
            plans["as written"] = jg.remat(traced)
        for arrangement, f in hand.items():
            if arrangement == "policies":
                for policy in f:
                    plans[f"{policy}, whole forward"] = jg.remat(
                        plain, policy=getattr(jg.policies, policy))
            elif arrangement != "no remat":
                plans[arrangement] = jg.remat(jg.backward(jg.trace(f, *args, param_argnums=0)))
        for budget in budgets if "scanlm" not in name or platform == "cpu" else ():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plans[f"jg.remat(budget={budget!r})"] = jg.remat(plain, budget=budget,
                                                                 target=target)
        yield from _predicted(name, plain, plans, target)
    for name, (plain, plans) in _jit_steps(models).items() if platform == "cpu" else ():
        yield from _predicted(name, plain, plans, target)
    for name, (plain, plans) in _steps().items() if platform == "cpu" or everything else ():
        if models and not any(m == name or m in name for m in models):
            continue
        for budget in budgets:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plans[f"jg.remat(budget={budget!r})"] = jg.remat(plain, budget=budget,
                                                                 target=target)
        yield from _predicted(name, plain, plans, target)


def _predicted(name: str, plain, plans: dict, target):
    """(model, plan, predicted, compiled, seconds predicting) of each plan of `plain`."""
    for plan_name, graph in plans.items():
        started = time.perf_counter()
        predicted = jg.memory(graph, target=target, unplanned=plain).peak_bytes
        took = time.perf_counter() - started
        compiled = jg.compiled_memory(graph, target=target).budget_bytes
        yield name, plan_name, predicted, compiled, took


def _steps():
    """{name: (the step as it runs, {plan: step})} of training steps as jgraph builds them: a
    16-layer scanned MLP's adam step (`jg.optimizer_step`), alone and accumulating over 2
    micro-steps (`jg.accumulate`), its gradients left out as `jg.jit` and `jg.Optimizer` leave
    them, unfused and with every update fused into the backward scan (`jg.fuse_updates`)."""
    from jgraph.fuse import without_grads

    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    ws = jax.random.normal(k1, (16, 128, 128)) * 128**-0.5
    x = jax.random.normal(k2, (64, 128))

    def chain(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.mean(h**2)

    joint = jg.backward(jg.trace(chain, ws, x, param_argnums=0))
    found = {}
    for name, step in (("scan16 adam step", jg.optimizer_step(joint, optax.adam(1e-3))),
                       ("scan16 adam step, period 2", jg.optimizer_step(
                           jg.accumulate(joint, 2, "sum"), optax.adam(1e-3)))):
        plain = without_grads(step)
        found[name] = (plain, {"no remat": plain,
                               "updates fused": jg.fuse_updates(step, keep_grads=False)})
    return found


def _jit_steps(models: tuple[str, ...] = ()):
    """{name: (the step as it runs unplanned, {plan: step})} of whole training steps a user
    writes and `jg.jit(budget=...)` plans (forward, backward, the optax update in one graph):
    `bench_dropin`'s adam steps of an MLP and a transformer block at 50 %, and Haiku's MNIST
    update of `examples/haiku_jit.py` at its 95 %; with `models`, only those named (the others
    are not planned)."""
    import runpy

    from benchmarks.bench_dropin import TX, jit_step
    from benchmarks.bench_dropin import models as dropin_models

    found = {}
    cases = [(f"jg.jit {name}", jit_step(jg.jit, jg.value_and_grad, loss, budget="50%"),
              (params, TX.init(params), x)) for name, loss, params, x in dropin_models(True)]
    example = runpy.run_path(str(Path(__file__).resolve().parent.parent / "examples"
                                 / "haiku_jit.py"), run_name="haiku_jit")
    data = example["load_data"]()
    params = example["net"].init(jax.random.PRNGKey(0), data["image"][:1])
    cases.append(("jg.jit Haiku MNIST update", example["update"],
                  (params, example["opt"].init(params), next(example["batches"](data, 32, 0)))))
    for name, step, args in cases:
        if models and not any(m == name or m in name for m in models):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = step.graph(*args)
        plain = step.info(*args)["unplanned"]
        found[name] = (plain, {"no remat": plain,
                               f"jg.jit(budget={plan.info['remat']['budget_given']!r})": plan})
    return found


def print_target_rows(platform: str, quick: bool, everything: bool = False,
                      models: tuple[str, ...] = ()) -> None:
    print(f"| model | plan | predicted | {platform}'s figure | error | predicted in |")
    print("|---|---|---|---|---|---|")
    errors = []
    for name, plan, predicted, compiled, took in target_rows(platform, quick, everything, models):
        error = predicted / compiled - 1 if compiled else float(predicted != 0)
        errors.append(abs(error))
        print(f"| {name} | {plan} | {_size(predicted)} | {_size(compiled)} | {error:+.1%} | "
              f"{took:.2f} s |", flush=True)
    errors.sort()
    print(f"median error {errors[len(errors) // 2]:.1%}, worst {errors[-1]:.1%}; "
          f"{sum(e <= 0.10 for e in errors)} of {len(errors)} within 10 %")


if __name__ == "__main__":
    if "--target" in sys.argv:
        models = sys.argv[sys.argv.index("--models") + 1] if "--models" in sys.argv else ""
        print_target_rows(sys.argv[sys.argv.index("--target") + 1], "--quick" in sys.argv,
                          "--all" in sys.argv, tuple(filter(None, models.split(","))))
        sys.exit(0)
    table = rows(quick="--quick" in sys.argv)
    for row in table:
        print(f"{row['benchmark']:78s} {row['jgraph']:>11s} {row['reference']:>11s} "
              f"{row['ratio']:6.2f}  {row['note']}", flush=True)
    bad = [r for r in table if not BAR[0] <= r["ratio"] <= BAR[1]]
    print(f"{len(table) - len(bad)} of {len(table)} within {BAR}")
