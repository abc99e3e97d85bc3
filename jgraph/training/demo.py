"""`python -m jgraph demo`: an MLP classifier on scikit-learn's bundled digits, trained by `jg.fit`.

Gradient accumulation (logical batch 64 = 4 micro-batches of 16), remat of every block (each block
is a `jax.checkpoint`), a progress bar, final loss and accuracy with uncertainties, a memory table
(no remat vs remat; jgraph's estimate on the schedule vs XLA's compiled temp) and a PNG of the loss
curves. Needs the `demo` extra: scikit-learn (the data; checked first) and matplotlib (the plot;
without it the demo says so in one line and skips the plot). Bad arguments end in a one-line
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

WIDTH, DEPTH, CLASSES = 128, 2, 10


def block(p, h):
    """Two tanh layers; remat recomputes the inner activation in the backward pass."""
    inner = jnp.tanh(h @ p["w1"] + p["b1"])
    return jnp.tanh(inner @ p["w2"] + p["b2"])


def model(params, x):
    """`DEPTH` blocks and a linear head; each block is a checkpoint region."""
    h = x
    for p in params["blocks"]:
        h = jax.checkpoint(block)(p, h)
    return h @ params["head"]["w"] + params["head"]["b"]


def _dense(key, n_in, n_out):
    return (jax.random.normal(key, (n_in, n_out), jnp.float32) * jnp.float32(1 / np.sqrt(n_in)),
            jnp.zeros(n_out, jnp.float32))


def init_params(key, n_in: int):
    keys = jax.random.split(key, 2 * DEPTH + 1)
    blocks = []
    for i in range(DEPTH):
        (w1, b1), (w2, b2) = (_dense(keys[2 * i], n_in if i == 0 else WIDTH, WIDTH),
                              _dense(keys[2 * i + 1], WIDTH, WIDTH))
        blocks.append({"w1": w1, "b1": b1, "w2": w2, "b2": b2})
    scale = lambda n: jnp.float32(1.0 / np.sqrt(n))  # noqa: E731
    head = {"w": jax.random.normal(keys[-1], (WIDTH, CLASSES), jnp.float32) * scale(WIDTH),
            "b": jnp.zeros(CLASSES, jnp.float32)}
    return {"blocks": blocks, "head": head}


def load_digits_dataset():
    from sklearn.datasets import load_digits

    digits = load_digits()  # bundled with scikit-learn: no download
    x = (digits.data / 16.0).astype(np.float32)
    return jg.Dataset(x, digits.target.astype(np.int32)), x.shape[1]


def memory_table(params, ds, tx, period: int, batches):
    """Rows (graph, micro-batch, remat, jgraph peak estimate, XLA temp of the donated step)."""
    rows = []
    for batch in batches:
        x, y = ds.batch(0, batch)
        for remat in (False, True):
            opt = jg.Optimizer(model, tx, loss="cross_entropy", period=period, remat=remat or None)
            state = opt.init(params, x, y)
            acc = (state.grad_acc, np.int32(0)) if period > 1 else ()
            for name in ("grad", "opt"):
                graph = opt.graphs[name]
                args = (state.params, x, y, *acc) + ((state.opt_state,) if name == "opt" else ())
                with warnings.catch_warnings():  # the grad step cannot reuse donated params
                    warnings.simplefilter("ignore", UserWarning)
                    temp = jg.compiled_memory(graph, *args).temp_bytes
                rows.append((name, batch, remat, jg.memory(graph).peak_bytes, temp))
    return rows


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


def parse_args(argv=None) -> argparse.Namespace:
    parser = _Parser(prog="python -m jgraph demo", description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=_bounded_int(1, 100_000), default=40)
    parser.add_argument("--batch-size", type=_bounded_int(1, 2**20), default=64)
    parser.add_argument("--physical-batch-size", type=_bounded_int(1, 2**20), default=16)
    parser.add_argument("--lr", type=_learning_rate, default=1e-3)
    parser.add_argument("--plot", type=Path, default=Path("jgraph-demo-loss.png"))
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
    print(f"digits: {ds.ndata} images of {n_in} pixels; MLP of {DEPTH} blocks of 2 tanh layers "
          f"x {WIDTH}, adam "
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
    print("(jgraph estimate: peak bytes of intermediate values alive at once on the graph's "
          "schedule,\n the graph's inputs and outputs not counted, as XLA's temp does not count "
          "them;\n XLA temp: temp_size_in_bytes of the compiled step with params and state "
          "donated)")
    print(f"  {'graph':5s} {'micro-batch':>11s} {'remat':>6s} {'jgraph estimate':>16s} "
          f"{'XLA temp':>13s}")
    big = min(32 * args.physical_batch_size, ds.ndata)  # a micro-batch the data can fill
    batches = (args.physical_batch_size,) + ((big,) if big > args.physical_batch_size else ())
    for name, batch, remat, estimate, temp in memory_table(params, ds, tx, period, batches):
        print(f"  {name:5s} {batch:11d} {'yes' if remat else 'no':>6s} {estimate / 1024:12.1f} "
              f"KiB {temp / 1024:9.1f} KiB")

    if not args.no_plot:
        plot(history, args.plot)
        print(f"\nloss curves written to {args.plot.resolve()}")
    val_acc = history.val_accuracy[-1]
    print(f"validation accuracy {100 * val_acc:.2f} % ({'>=' if val_acc >= 0.95 else '<'} 95 %),"
          f" total {time.perf_counter() - start:.1f} s")
    return 0 if val_acc >= 0.95 else 1
