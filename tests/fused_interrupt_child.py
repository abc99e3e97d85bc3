"""Child processes for tests/test_fused_interrupts.py: `python fused_interrupt_child.py MODE ...`.

The model is a residual MLP whose layer weights are stacked and run by `lax.scan`, trained by
`jg.fit` with `remat={"budget": "50%"}`, period 1 and no mesh: the Optimizer plans the whole
step and fuses the adam update of the stacked weights into the backward scan. With
`on_nonfinite="ignore"` the step that runs is the planned graph itself (a guard would be added
around it after planning). Every run writes its final params, optimizer state and loss history to
`OUT/NAME.npz` and its plan (the opt graph's `info["remat"]`: `fused`, `plan`, `xla_temp`,
`budget`) to `OUT/NAME.json`; the parent compares them.

    interrupt PATH OUT  prints `ready`, then runs fit with the checkpoint PATH, printing
                        `epoch E RECEIVED` after every epoch, until a Ctrl-C stops it:
                        `stopped EPOCH BATCH STEP SAME` (where the checkpoint says it stopped;
                        SAME: the checkpoint reloads bitwise to the state attached to the
                        KeyboardInterrupt, whose buffers are alive), then it exits. A run the
                        Ctrl-C missed prints `finished RECEIVED`, and the next run starts.
    resume PATH OUT     the run without remat (`plain`) and the uninterrupted fused run
                        (`reference`), then prints `ready` and waits for a line on stdin (the
                        interrupted child has exited), then fit resumes from PATH to the end
                        (`resumed`, a new plan and new executables); prints `done`

RECEIVED: the SIGINTs the child's Python handlers (its own or fit's) have received so far, from
the file `$FUSED_CHILD_SIGNALS` to which `signal.set_wakeup_fd` appends a byte per signal. The
child sets its own SIGINT handler, however it was started (the parent starts it with SIGINT
ignored, as `nohup` would): it only records the signal, so a Ctrl-C that lands outside fit's run
loop interrupts nothing.
"""

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np

LAYERS, WIDTH, BATCH, NDATA, EPOCHS = 16, 64, 32, 256, 20
RNG = np.random.default_rng(0)
P0 = {"w": (RNG.normal(size=(LAYERS, WIDTH, WIDTH)) * 0.5 * WIDTH**-0.5).astype(np.float32),
      "b": (RNG.normal(size=(LAYERS, WIDTH)) * 0.1).astype(np.float32),
      "out": (RNG.normal(size=(WIDTH, WIDTH)) * WIDTH**-0.5).astype(np.float32)}
X = RNG.normal(size=(NDATA, WIDTH)).astype(np.float32)
Y = RNG.normal(size=(NDATA, WIDTH)).astype(np.float32)
FUSED = {"budget": "50%"}


def model(p, x):
    import jax
    import jax.numpy as jnp

    def layer(h, wb):
        w, b = wb
        return h + jnp.tanh(h @ w + b), None

    h, _ = jax.lax.scan(layer, x, (p["w"], p["b"]))
    return h @ p["out"]


def fit(remat, **extra):
    import jax
    import optax

    import jgraph as jg

    return jg.fit(model, P0, jg.Dataset(X, Y), loss="mse", tx=optax.adam(1e-3), epochs=EPOCHS,
                  batch_size=BATCH, val_split=0.25, progress=False, key=jax.random.PRNGKey(1),
                  remat=remat, on_nonfinite="ignore", **extra)


def leaves(tree) -> dict:
    import jax

    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def write(out: str, name: str, state, history) -> None:
    """The run's state and losses to `out/name.npz`, its plan to `out/name.json`."""
    arrays = {f"params{k}": v for k, v in leaves(state.params).items()}
    arrays |= {f"opt_state{k}": v for k, v in leaves(state.opt_state).items()}
    arrays |= {"train_loss": np.asarray(history.train_loss),
               "val_loss": np.asarray(history.val_loss)}
    np.savez(Path(out) / f"{name}.npz", **arrays)
    info = history.optimizer.graphs["opt"].info.get("remat") or {}
    plan = {k: info.get(k) for k in ("fused", "plan", "xla_temp", "budget")}
    (Path(out) / f"{name}.json").write_text(json.dumps(plan))


def same(a, b) -> bool:
    x, y = leaves(a), leaves(b)
    return x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and x[k].tobytes() == y[k].tobytes() for k in x)


SIGNALS = [-1]


def received() -> int:
    return os.fstat(SIGNALS[0]).st_size


def say(text: str) -> None:
    print(text, flush=True)


def interrupt(path: str, out: str) -> None:
    import jax

    def after_epoch(e, history):
        say(f"epoch {e} {received()}")

    say("ready")
    while True:
        try:
            fit(FUSED, checkpoint_path=path, checkpoint_every=3, callback=after_epoch)
        except KeyboardInterrupt as e:
            if not hasattr(e, "state"):
                say("LOST no state attached to the KeyboardInterrupt")
                return
            opt = e.history.optimizer
            back, extra = opt.load(path, extra=True)
            alive = not any(isinstance(a, jax.Array) and a.is_deleted()
                            for a in jax.tree.leaves(e.state))
            where = extra["fit"]
            write(out, "interrupted", e.state, e.history)
            say(f"stopped {where['epoch']} {where['batch']} {where['step']} "
                f"{same(back, e.state) and alive}")
            return
        os.remove(path)
        say(f"finished {received()}")


def resume(path: str, out: str) -> None:
    params, history = fit(None)
    write(out, "plain", history.state, history)
    params, history = fit(FUSED)
    write(out, "reference", history.state, history)
    say("ready")
    if sys.stdin.readline().strip() != "go":
        return  # the parent gave up
    if not os.path.exists(path):
        say("LOST no checkpoint to resume from")
        return
    params, history = fit(FUSED, checkpoint_path=path, checkpoint_every=3)
    write(out, "resumed", history.state, history)
    say("done")


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    SIGNALS[0] = os.open(os.environ["FUSED_CHILD_SIGNALS"], os.O_WRONLY | os.O_APPEND)
    os.set_blocking(SIGNALS[0], False)  # as set_wakeup_fd requires (a no-op for a file)
    signal.set_wakeup_fd(SIGNALS[0])
    signal.signal(signal.SIGINT, lambda signum, frame: None)  # whatever we were started with
    {"interrupt": interrupt, "resume": resume}[mode](*args)
