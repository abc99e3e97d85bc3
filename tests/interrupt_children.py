"""Child processes for tests/test_interrupts.py: run with `python interrupt_children.py MODE ...`.

Each prints `ready` once it has computed its uninterrupted reference, then trains until the
parent interrupts it, and answers every Ctrl-C with one line. Every line starts with the number of
SIGINTs the child's handlers (its own or jgraph's) have received so far, so the parent tells a
Ctrl-C not yet delivered from one lost. The parent sees two files too: `$INTERRUPT_CHILD_SIGNALS`,
to which `signal.set_wakeup_fd` appends a byte per signal a handler receives (only SIGINT has one),
and `$INTERRUPT_CHILD_STATUS`, two uint32: the steps the loop has made and the lines printed.

    ok K N         the state after the interrupt was saved, reloaded bitwise, and is the state
                   of the uninterrupted run after K steps (N: the loop's own count)
    early          (fit) the Ctrl-C came before training started; the checkpoint is intact
    done SAME      (fit) a chain of resumed runs finished; SAME: it equals the uninterrupted run
    LOST ...       anything else (a state lost, unloadable or different)

The child sets its own SIGINT handler, whatever it was started with. The handler raises
`KeyboardInterrupt` once per round; one that arrives between a Ctrl-C and the next round (the
child's own bookkeeping, its answer) is held and raised when the next round starts. So no Ctrl-C
lands in the child's bookkeeping, only in jgraph's code, and none is dropped. (Blocking SIGINT
with `pthread_sigmask` would not do: it blocks the main thread only, and the kernel hands the
signal to one of XLA's threads, whose C handler has Python run the handler in the main thread.)

MODE `loop`: a static step loop (`opt.step`, donated buffers) saved with `opt.latest_state`.
MODE `fit`: `jg.fit` with a checkpoint, resumed after every Ctrl-C.
MODE `fit-ignoring`: started with SIGINT ignored (as `nohup` or `cmd &` start it), it keeps it
ignored and runs `jg.fit` again and again (resuming from a checkpoint a killed predecessor left),
printing `ready RESUMES` and then `done SAME IGNORED` per run; IGNORED: SIGINT was still ignored
at the end of every epoch, inside the run. The parent ends it with SIGTERM.
`save_forever` is the target of a forkserver process: it saves two alternating states until the
parent kills it (SIGKILL) or interrupts it (SIGINT).
"""

import hashlib
import mmap
import os
import signal
import struct
import sys

import numpy as np

RNG = np.random.default_rng(0)
X = RNG.normal(size=(64, 5)).astype(np.float32)
Y = RNG.integers(0, 3, 64).astype(np.int32)
P0 = {"w": (RNG.normal(size=(5, 16)) * 0.5).astype(np.float32),
      "v": (RNG.normal(size=(16, 3)) * 0.5).astype(np.float32)}


def model(p, x):
    import jax.numpy as jnp

    return jnp.tanh(x @ p["w"]) @ p["v"]


def digest(tree) -> str:
    import jax

    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


SIGNALS, STATUS, COUNTS = [-1], [None], [0, 0]  # steps, lines


def share_status() -> None:
    """Open the files the parent reads: the signals received and the counts."""
    SIGNALS[0] = os.open(os.environ["INTERRUPT_CHILD_SIGNALS"], os.O_WRONLY | os.O_APPEND)
    os.set_blocking(SIGNALS[0], False)  # as set_wakeup_fd requires (a no-op for a file)
    signal.set_wakeup_fd(SIGNALS[0])
    fd = os.open(os.environ["INTERRUPT_CHILD_STATUS"], os.O_RDWR)
    STATUS[0] = mmap.mmap(fd, 8)


def received() -> int:
    """How many SIGINTs a Python-level handler of this process has received so far."""
    return os.fstat(SIGNALS[0]).st_size


def publish(steps: int = 0, lines: int = 0) -> None:
    COUNTS[0] += steps
    COUNTS[1] += lines
    STATUS[0][:8] = struct.pack("<II", *COUNTS)


def say(text: str) -> None:
    """Print a line, after the count of SIGINTs received and not held (a held one is answered
    in the next round: the parent must not take it for lost)."""
    publish(lines=1)
    print(f"{received() - HELD[0]} {text}", flush=True)


ARMED, HELD = [False], [False]


def _once(signum, frame):
    if ARMED[0]:
        ARMED[0] = HELD[0] = False
        raise KeyboardInterrupt
    HELD[0] = True  # raised when the next round starts


def hold_sigint(hold: bool) -> None:
    """Hold SIGINT for the child's bookkeeping, or start a round (raising a held one)."""
    ARMED[0] = not hold
    if not hold and HELD[0]:
        ARMED[0] = HELD[0] = False
        raise KeyboardInterrupt


def loop(period: int, nref: int, path: str) -> None:
    import optax

    import jgraph as jg

    opt = jg.Optimizer(model, optax.adam(1e-2), loss="cross_entropy", period=period)
    x, y = X[:8], Y[:8]  # one batch: the trajectory does not depend on the loop's count
    state = opt.init(P0, x, y)
    index = {digest(state): 0}
    for k in range(1, nref + 1):
        state, _ = opt.step(state, x, y)
        index[digest(state)] = k
    state, n = opt.init(P0, x, y), 0
    hold_sigint(True)
    say("ready")
    while True:
        try:
            hold_sigint(False)
            while True:
                if n == nref:
                    state, n = opt.init(P0, x, y), 0
                state, _ = opt.step(state, x, y)
                n += 1
                publish(steps=1)
                if not ARMED[0]:  # our KeyboardInterrupt vanished (raised in a gc callback):
                    hold_sigint(False)  # re-arm; the parent sends the Ctrl-C again
        except KeyboardInterrupt:
            hold_sigint(True)
            latest = opt.latest_state
            want = digest(latest)
            opt.save(latest, path)
            state = opt.load(path)
            k = index.get(digest(state), -1)
            good = digest(state) == want and k >= 0 and abs(k - n) <= 1
            n = k
            say(f"ok {k} {n}" if good else f"LOST k={k} n={n}")
            if not good:
                return


def fit(epochs: int, path: str) -> None:
    import jax
    import optax

    import jgraph as jg

    ds = jg.Dataset(X, Y)
    kw = dict(loss="cross_entropy", tx=optax.adam(1e-2), epochs=epochs, batch_size=8,
              physical_batch_size=4, val_split=0.25, progress=False, key=jax.random.PRNGKey(1))
    ref_params, ref_history = jg.fit(model, P0, ds, **kw)
    want = (digest(ref_params), ref_history.train_loss, ref_history.val_loss)
    hold_sigint(True)
    say("ready")
    while True:
        try:
            hold_sigint(False)
            params, history = jg.fit(model, P0, ds, checkpoint_path=path, checkpoint_every=2,
                                     **kw)
            hold_sigint(True)
            same = (digest(params), history.train_loss, history.val_loss) == want
            os.remove(path)
            say(f"done {same}")
        except KeyboardInterrupt as e:
            hold_sigint(True)
            if not hasattr(e, "state"):  # before fit's loop: nothing trained in this call
                good = not os.path.exists(path) or _loads(path, ds)
                say("early" if good else "LOST checkpoint unreadable")
                continue
            back = e.history.optimizer.load(path)
            good = digest(back) == digest(e.state) and not any(
                isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(e.state))
            say(f"ok {int(e.state.counter)} 0" if good else "LOST checkpoint differs")


def fit_ignoring(epochs: int, path: str) -> None:
    import jax
    import optax

    import jgraph as jg

    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        say("LOST not started with SIGINT ignored")
        return
    ds = jg.Dataset(X, Y)
    kw = dict(loss="cross_entropy", tx=optax.adam(1e-2), epochs=epochs, batch_size=8,
              physical_batch_size=4, val_split=0.25, progress=False, key=jax.random.PRNGKey(1))
    ref_params, ref_history = jg.fit(model, P0, ds, **kw)
    want = (digest(ref_params), ref_history.train_loss, ref_history.val_loss)
    say(f"ready {os.path.exists(path)}")
    while True:
        seen = set()
        params, history = jg.fit(model, P0, ds, checkpoint_path=path, checkpoint_every=2,
                                 callback=lambda e, h: seen.add(signal.getsignal(signal.SIGINT)),
                                 **kw)
        same = (digest(params), history.train_loss, history.val_loss) == want
        os.remove(path)
        ignored = seen == {signal.SIG_IGN} and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        say(f"done {same} {ignored}")


def _loads(path: str, ds) -> bool:
    from jgraph.training.state_io import read_state_file

    try:
        read_state_file(path)
        return True
    except Exception:  # noqa: BLE001 - any failure is a lost state here
        return False


def states(nbytes: int):
    """The two states `save_forever` alternates (distinct in every byte of `w`)."""
    return [{"w": np.full(nbytes // 4, v, np.float32), "step": np.int32(v)} for v in (1.0, 2.0)]


def save_forever(path: str, nbytes: int, ready, saves) -> None:
    """Save forever, counting the saves in `saves` (a shared integer without a lock)."""
    from jgraph.training.state_io import save_state

    signal.signal(signal.SIGINT, signal.default_int_handler)  # however the parent was started
    both, i = states(nbytes), 0
    save_state(path, both[0])
    ready.set()
    while True:
        i += 1
        save_state(path, both[i % 2])
        saves.value = i


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    share_status()
    if mode == "fit-ignoring":
        fit_ignoring(int(args[0]), args[1])
    else:
        signal.signal(signal.SIGINT, _once)  # whatever the parent was started with
        if mode == "loop":
            loop(int(args[0]), int(args[1]), args[2])
        else:
            fit(int(args[0]), args[1])
