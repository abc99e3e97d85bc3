"""`python -m jgraph demo`: an MLP classifier on scikit-learn's bundled digits, trained by `jg.fit`.

Gradient accumulation (logical batch 64 = 4 micro-batches of 16), remat of every residual block
(each block is a `jax.checkpoint`), a progress bar, final loss and accuracy with uncertainties, a
memory table (no remat, every block, the budget planner's plan; jgraph's estimate vs XLA's
compiled temp), a PNG of the loss curves and one of the memory timeline beside it. Needs the
`demo` extra: scikit-learn (the data; checked first) and matplotlib (the plots; without it the
demo says so in one line and skips them). Bad arguments end in a one-line
error and exit code 2, before any training; Ctrl-C stops the training cleanly (exit code 130).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jgraph as jg

WIDTH, HIDDEN, DEPTH, CLASSES = 128, 512, 3, 10


def block(p, h):
    """A residual MLP block, h + tanh(h W1 + b1) W2 + b2: its hidden layer, four times wider
    than h, is what remat recomputes in the backward pass instead of keeping it."""
    return h + jnp.tanh(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def model(params, x):
    """An input layer, `DEPTH` residual blocks (each a checkpoint region) and a linear head."""
    h = jnp.tanh(x @ params["embed"]["w"] + params["embed"]["b"])
    for p in params["blocks"]:
        h = jax.checkpoint(block)(p, h)
    return h @ params["head"]["w"] + params["head"]["b"]


def _dense(key, n_in, n_out, gain=1.0):
    return (jax.random.normal(key, (n_in, n_out), jnp.float32) * jnp.float32(gain / np.sqrt(n_in)),
            jnp.zeros(n_out, jnp.float32))


def init_params(key, n_in: int):
    keys = jax.random.split(key, 2 * DEPTH + 2)
    w, b = _dense(keys[0], n_in, WIDTH)
    blocks = []
    for i in range(DEPTH):
        (w1, b1), (w2, b2) = (_dense(keys[2 * i + 1], WIDTH, HIDDEN),
                              _dense(keys[2 * i + 2], HIDDEN, WIDTH, gain=0.5))
        blocks.append({"w1": w1, "b1": b1, "w2": w2, "b2": b2})
    hw, hb = _dense(keys[-1], WIDTH, CLASSES)
    return {"embed": {"w": w, "b": b}, "blocks": blocks, "head": {"w": hw, "b": hb}}


def load_digits_dataset():
    from sklearn.datasets import load_digits

    digits = load_digits()  # bundled with scikit-learn: no download
    x = (digits.data / 16.0).astype(np.float32)
    return jg.Dataset(x, digits.target.astype(np.int32)), x.shape[1]


PLANS = ("no remat", "every block", "budget 50%")


def _plans():
    """The Optimizer's `remat` for each plan: none, the recorded regions (each block), and the
    budget planner (`jg.remat(gb, budget="50%")`: half of no remat's compiled temp)."""
    return {"no remat": None, "every block": True, "budget 50%": {"budget": "50%"}}


def _loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(params, x), y).mean()


def memory_table(params, ds, tx, period: int, batches):
    """Rows (graph, micro-batch, plan, jgraph estimate, XLA temp of the donated step, the
    graph's remat info, its memory report); a plan no remat fits is left out."""
    rows = []
    for batch in batches:
        x, y = ds.batch(0, batch)
        for plan, remat in _plans().items():
            opt = jg.Optimizer(model, tx, loss="cross_entropy", period=period, remat=remat)
            with warnings.catch_warnings():  # an unreachable budget: the plan's info says so
                warnings.simplefilter("ignore", jg.BudgetWarning)
                state = opt.init(params, x, y)
            acc = (state.grad_acc, np.int32(0)) if period > 1 else ()
            for name in ("grad", "opt"):
                graph = opt.graphs[name]
                args = (state.params, x, y, *acc) + ((state.opt_state,) if name == "opt" else ())
                with warnings.catch_warnings():  # the grad step cannot reuse donated params
                    warnings.simplefilter("ignore", UserWarning)
                    temp = jg.compiled_memory(graph, *args).temp_bytes
                report = jg.memory(graph)
                rows.append((name, batch, plan, report.peak_bytes, temp,
                             dict(graph.info.get("remat") or {}), report))
    return rows


def describe_plan(info: dict) -> str:
    """The planner's choice, from the `remat` info of a planned graph (`jg.remat(budget=)`)."""
    if not info:
        return "no remat"
    recomputed = sum((info.get("recomputed_eqns") or {}).values())
    kib = 1024
    fit = ("within it" if not info.get("unmet") else
           "not reachable: the least temp a plan reaches")
    return (f"{info.get('plan', 'no remat')}; gradient step's XLA temp "
            f"{info['xla_temp'] / kib:.1f} KiB for a budget of {info['budget'] / kib:.1f} KiB "
            f"({info.get('budget_given')}, {fit}); "
            f"{recomputed} eqns recomputed, {info.get('recompute_flops', 0):.3g} flops; planned "
            f"{info.get('used', info.get('planner'))} in {info.get('planning_seconds', 0):.2f} s")


def plot_memory(rows, path: Path) -> None:
    """The memory timeline of each plan's grad micro-step at the largest micro-batch."""
    batch = max(r[1] for r in rows)
    chosen = [r for r in rows if r[0] == "grad" and r[1] == batch]
    chosen[0][6].plot(path, *(r[6] for r in chosen[1:]), labels=[r[2] for r in chosen],
                      compiled=[r[4] for r in chosen],
                      title=f"demo grad micro-step, micro-batch {batch}: live temp bytes")


def plot(history, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = np.arange(1, len(history.train_loss) + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, color in (("train", "tab:blue"), ("val", "tab:orange")):
        loss = np.array(getattr(history, f"{name}_loss"))
        unc = np.nan_to_num(np.array(getattr(history, f"{name}_loss_unc")))
        ax.plot(epochs, loss, color=color, label=f"{name} loss")
        ax.fill_between(epochs, loss - unc, loss + unc, color=color, alpha=0.25)
    ax.set(xlabel="epoch", ylabel="cross-entropy", yscale="log",
           title="jgraph demo: MLP on sklearn digits")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _bounded_int(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value

    return parse


def _learning_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a positive finite number")
    return value


# The pictures go to a folder of their own (ignored by git), not among the user's files.
DEFAULT_PLOT = Path("out") / "jgraph-demo-loss.png"


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(prog="python -m jgraph demo", description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=_bounded_int(1, 100_000), default=40)
    parser.add_argument("--batch-size", type=_bounded_int(1, 2**20), default=64)
    parser.add_argument("--physical-batch-size", type=_bounded_int(1, 2**20), default=16)
    parser.add_argument("--lr", type=_learning_rate, default=1e-3)
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT,
                        help=f"the loss curves' PNG (default {DEFAULT_PLOT}; the memory "
                             "timeline goes beside it, its name ending in -memory.png)")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.batch_size % args.physical_batch_size:
        parser.error(f"--batch-size {args.batch_size} is not a multiple of "
                     f"--physical-batch-size {args.physical_batch_size}")
    if importlib.util.find_spec("sklearn") is None:
        parser.error("the demo needs scikit-learn for its data: pip install 'jgraph[demo]'")
    ndata = 1797  # sklearn's bundled digits
    most = ndata // 2  # 20% validation must leave one logical batch to train on
    if args.batch_size > most:
        parser.error(f"--batch-size {args.batch_size} leaves no training batch: at most {most} "
                     f"of the {ndata} digits (20% are held out)")
    if not args.no_plot:
        if args.plot == DEFAULT_PLOT:  # the demo's own folder, made on first use
            DEFAULT_PLOT.parent.mkdir(exist_ok=True)
        if not args.plot.resolve().parent.is_dir():
            parser.error(f"--plot {args.plot}: folder {args.plot.resolve().parent} does not "
                         f"exist")
        if importlib.util.find_spec("matplotlib") is None:
            print("note: matplotlib is not installed: no plot (pip install 'jgraph[demo]')",
                  file=sys.stderr)
            args.no_plot = True
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt as e:
        history = getattr(e, "history", None)
        done = len(history.train_loss) if history is not None else 0
        print(f"\ninterrupted after {done} of {args.epochs} epochs", file=sys.stderr)
        return 130
    except jg.JGraphError as e:
        print(f"python -m jgraph demo: error: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    start = time.perf_counter()
    ds, n_in = load_digits_dataset()
    params = init_params(jax.random.PRNGKey(0), n_in)
    tx = optax.adam(args.lr)
    period = args.batch_size // args.physical_batch_size
    print(f"digits: {ds.ndata} images of {n_in} pixels; MLP of {DEPTH} residual blocks "
          f"{WIDTH} -> {HIDDEN} -> {WIDTH}, adam "
          f"{args.lr}; logical batch {args.batch_size} = {period} micro-batches of "
          f"{args.physical_batch_size}; remat of every block; 20% validation")
    trained, history = jg.fit(model, params, ds, loss="cross_entropy", tx=tx,
                              epochs=args.epochs, batch_size=args.batch_size,
                              physical_batch_size=args.physical_batch_size, val_split=0.2,
                              remat=True, key=jax.random.PRNGKey(1),
                              progress=not args.no_progress)
    print()
    for name in ("train", "val"):
        loss, unc = getattr(history, f"{name}_loss")[-1], getattr(history, f"{name}_loss_unc")[-1]
        acc = getattr(history, f"{name}_accuracy")[-1]
        acc_unc = getattr(history, f"{name}_accuracy_unc")[-1]
        print(f"final {name:5s} loss {loss:.4f} ± {unc:.4f}   accuracy {100 * acc:.2f} ± "
              f"{100 * acc_unc:.2f} %")

    print("\nmemory of one micro-step: grad = forward + backward + accumulate, opt = grad + adam")
    print("(jgraph estimate: jg.memory(graph).peak_bytes, a model of XLA:CPU's fusion, schedule"
          " and\n buffer assignment; XLA temp: temp_size_in_bytes of the compiled step, params "
          "and state donated)")
    print(f"  {'graph':5s} {'micro-batch':>11s} {'plan':>12s} {'jgraph estimate':>16s} "
          f"{'XLA temp':>13s} {'ratio':>6s}")
    big = min(32 * args.physical_batch_size, ds.ndata)  # a micro-batch the data can fill
    batches = (args.physical_batch_size,) + ((big,) if big > args.physical_batch_size else ())
    rows = memory_table(params, ds, tx, period, batches)
    for name, batch, plan, estimate, temp, _, _ in rows:
        print(f"  {name:5s} {batch:11d} {plan:>12s} {estimate / 1024:12.1f} KiB "
              f"{temp / 1024:9.1f} KiB {estimate / max(temp, 1):6.2f}")
    for batch in batches:
        temps = {plan: temp for name, b, plan, _, temp, _, _ in rows if name == "grad"
                 and b == batch}
        planned = [info for name, b, plan, *_, info, _ in rows
                   if name == "grad" and b == batch and plan == PLANS[2]]
        print(f"micro-batch {batch}: remat of every block saves "
              f"{1 - temps[PLANS[1]] / temps[PLANS[0]]:.0%} of XLA's temp; the budget planner"
              + (f" chose: {describe_plan(planned[0])}" if planned else " found no plan"))

    if not args.no_plot:
        plot(history, args.plot)
        print(f"\nloss curves written to {args.plot.resolve()}")
        memory_png = args.plot.with_name(args.plot.stem + "-memory.png")
        plot_memory(rows, memory_png)
        print(f"memory timeline written to {memory_png.resolve()}")
    val_acc = history.val_accuracy[-1]
    print(f"validation accuracy {100 * val_acc:.2f} % ({'>=' if val_acc >= 0.95 else '<'} 95 %),"
          f" total {time.perf_counter() - start:.1f} s")
    return 0 if val_acc >= 0.95 else 1
