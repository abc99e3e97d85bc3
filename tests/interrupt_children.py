"""Child processes for tests/test_interrupts.py: run with `python interrupt_children.py MODE ...`.

Each prints `ready` once it has computed its uninterrupted reference, then trains until the
parent interrupts it, and answers every Ctrl-C with one line:

    ok K N         the state after the interrupt was saved, reloaded bitwise, and is the state
                   of the uninterrupted run after K steps (N: the loop's own count)
    early          (fit) the Ctrl-C came before training started; the checkpoint is intact
    done SAME      (fit) a chain of resumed runs finished; SAME: it equals the uninterrupted run
    LOST ...       anything else (a state lost, unloadable or different)

Between a Ctrl-C and its answer the child blocks SIGINT (the parent sends the next one only after
the answer, and a blocked one waits until the child trains again), and its handler raises
`KeyboardInterrupt` once per round (a resent Ctrl-C that arrives before the block is dropped):
no Ctrl-C can land in the child's own bookkeeping, only in jgraph's code.

MODE `loop`: a static step loop (`opt.step`, donated buffers) saved with `opt.latest_state`.
MODE `fit`: `jg.fit` with a checkpoint, resumed after every Ctrl-C.
`save_forever` is the target of a forkserver process: it saves two alternating states until the
parent kills it (SIGKILL) or interrupts it (SIGINT).
"""

import hashlib
import os
import signal
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


def say(text: str) -> None:
    print(text, flush=True)


ARMED = [False]


def _once(signum, frame):
    if ARMED[0]:
        ARMED[0] = False
        raise KeyboardInterrupt


def hold_sigint(hold: bool) -> None:
    if not hold:
        ARMED[0] = True
    signal.pthread_sigmask(signal.SIG_BLOCK if hold else signal.SIG_UNBLOCK, [signal.SIGINT])


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


def save_forever(path: str, nbytes: int, ready) -> None:
    from jgraph.training.state_io import save_state

    both, i = states(nbytes), 0
    save_state(path, both[0])
    ready.set()
    while True:
        i += 1
        save_state(path, both[i % 2])


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _once)
    mode, *args = sys.argv[1:]
    if mode == "loop":
        loop(int(args[0]), int(args[1]), args[2])
    else:
        fit(int(args[0]), args[1])
