"""Training that goes wrong: non-finite steps (raise / skip / ignore), Ctrl-C in fit, and resuming
from a fit checkpoint, bitwise. References: the unguarded step, optax.apply_if_finite,
optax.MultiSteps over it, and the uninterrupted run."""

import hashlib
import json
import os
import shutil
import signal
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg
from jgraph.training import NonFiniteError, StateFileError, guard_nonfinite
from jgraph.training.guard import unguarded
from jgraph.training.state_io import FORMAT_VERSION, MAGIC

RNG = np.random.default_rng(0)
X = RNG.normal(size=(48, 5)).astype(np.float32)
Y = RNG.integers(0, 3, 48).astype(np.int32)
ADAM = optax.adam(1e-2)


def model(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


P0 = {"w": (RNG.normal(size=(5, 6)) * 0.5).astype(np.float32),
      "v": (RNG.normal(size=(6, 3)) * 0.5).astype(np.float32)}


def bits(tree):
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()


def finite(tree):
    return all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(tree))


def ce(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(p, x), y).mean()


GRAD = jax.jit(jax.grad(ce))


# -- the guard as a graph transform ---------------------------------------------------------------
def test_guard_adds_one_finite_output_and_keeps_old_state_when_not_finite():
    gb = jg.backward(jg.trace(lambda p, x: jnp.mean(model(p, x)), P0, X[:8], param_argnums=0))
    go = jg.optimizer_step(gb, optax.sgd(0.5))
    guarded = jg.check(guard_nonfinite(go, keep=("param", "opt_state")))
    assert guarded.output_roles == go.output_roles + ("metric",)
    assert "is_finite" in str(guarded) and "metric" in str(guarded)
    run, plain = jg.compile(guarded), jg.compile(go)
    state = optax.sgd(0.5).init(P0)
    *outs, ok = run(P0, X[:8], state)
    assert bool(ok) and bits(outs) == bits(plain(P0, X[:8], state))  # bitwise when finite
    bad = X[:8].copy()
    bad[3, 1] = np.nan
    *outs, ok = run(P0, bad, state)
    assert not bool(ok) and bits(outs[2]) == bits(P0)  # new params = the old ones
    assert not finite(plain(P0, bad, state)[2])  # unguarded, the NaN lands in the params
    with pytest.raises(jg.TransformError, match="already guarded"):
        guard_nonfinite(guarded)
    undone = unguarded(guarded)  # the guard undone: the graph it was given
    assert (undone.eqns, undone.outputs, undone.output_roles, undone.out_tree, undone.info) == (
        go.eqns, go.outputs, go.output_roles, go.out_tree, go.info)
    with pytest.raises(jg.TransformError, match="not guarded"):
        unguarded(go)
    with pytest.raises(jg.TransformError, match="unknown state roles"):
        guard_nonfinite(go, keep=("weights",))


# -- Optimizer ------------------------------------------------------------------------------------
def batches(nan_at=None):
    xs = [X[i * 4:(i + 1) * 4].copy() for i in range(12)]
    if nan_at is not None:
        xs[nan_at][1, 2] = np.nan
    return xs, [Y[i * 4:(i + 1) * 4] for i in range(12)]


@pytest.mark.parametrize("period,nan_at", [(1, 5), (3, 4), (3, 5)])
def test_raise_keeps_the_state_before_the_step(period, nan_at):
    xs, ys = batches(nan_at)
    opt = jg.Optimizer(model, ADAM, loss="cross_entropy", period=period, on_nonfinite="raise")
    state = opt.init(P0, xs[0], ys[0])
    for i in range(nan_at):
        state, out = opt.step(state, xs[i], ys[i])
        assert out.finite is True
    before = bits(state)
    with pytest.raises(NonFiniteError, match=f"micro-step {nan_at % period} of period"):
        opt.step(state, xs[nan_at], ys[nan_at])
    assert bits(opt.latest_state) == before  # values and counter of the last finite state
    ref = jg.Optimizer(model, ADAM, loss="cross_entropy", period=period)  # unguarded
    want = ref.init(P0, xs[0], ys[0])
    for i in range(nan_at):
        want, _ = ref.step(want, xs[i], ys[i])
    assert bits(opt.latest_state) == bits(want)  # the guard changes no finite bit
    state, _ = opt.step(opt.latest_state, xs[nan_at + 1], ys[nan_at + 1])  # and training goes on
    assert finite(state.params)


def test_skip_equals_optax_apply_if_finite():
    xs, ys = batches(nan_at=3)
    opt = jg.Optimizer(model, ADAM, loss="cross_entropy", on_nonfinite="skip")
    state = opt.init(P0, xs[0], ys[0])
    tx = optax.apply_if_finite(ADAM, max_consecutive_errors=100)
    ref, ref_state = P0, tx.init(P0)
    update = jax.jit(tx.update)
    flags = []
    for x, y in zip(xs, ys, strict=True):
        state, out = opt.step(state, x, y)
        flags.append(bool(out.finite))
        updates, ref_state = update(GRAD(ref, x, y), ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    assert flags == [i != 3 for i in range(12)] and int(ref_state.total_notfinite) == 1
    for k in ref:
        np.testing.assert_allclose(state.params[k], ref[k], rtol=1e-5, atol=1e-7)


def test_skip_with_accumulation_drops_the_whole_period():
    """apply_if_finite over the mean gradient of each period (optax.MultiSteps over
    apply_if_finite, except that MultiSteps clears its accumulator as `(1 - emit) * acc`, which
    keeps a NaN into the next period; jgraph's accumulators restart at zero every period)."""
    xs, ys = batches(nan_at=4)  # poisons the second period (micro-steps 3, 4, 5)
    opt = jg.Optimizer(model, ADAM, loss="cross_entropy", period=3, on_nonfinite="skip")
    state = opt.init(P0, xs[0], ys[0])
    tx = optax.apply_if_finite(ADAM, max_consecutive_errors=100)
    ref, ref_state = P0, tx.init(P0)
    update = jax.jit(tx.update)
    res = jg.Result()
    for start in range(0, 12, 3):
        grads = [GRAD(ref, xs[i], ys[i]) for i in range(start, start + 3)]
        mean = jax.tree.map(lambda *g: sum(g) / 3, *grads)
        updates, ref_state = update(mean, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
        for i in range(start, start + 3):
            state, out = opt.step(state, xs[i], ys[i])
            res.add(out)
    assert res.nonfinite == 1 and int(ref_state.total_notfinite) == 1  # one update dropped
    for k in ref:
        np.testing.assert_allclose(state.params[k], ref[k], rtol=1e-5, atol=1e-7)


def test_sgd_with_an_infinite_learning_rate_is_caught():
    opt = jg.Optimizer(model, optax.sgd(float("inf")), loss="cross_entropy", on_nonfinite="raise")
    state = opt.init(P0, X[:8], Y[:8])
    with pytest.raises(NonFiniteError):
        opt.step(state, X[:8], Y[:8])
    assert bits(opt.latest_state.params) == bits(P0)


# -- fit ------------------------------------------------------------------------------------------
KW = dict(loss="cross_entropy", tx=ADAM, batch_size=8, physical_batch_size=4, val_split=0.25,
          progress=False, key=jax.random.PRNGKey(3))


def test_fit_stops_on_a_nan_datapoint_naming_the_step(tmp_path):
    data = X.copy()
    data[37, 2] = np.nan
    ds = jg.Dataset(data, Y)
    path = tmp_path / "ckpt.jgs"
    with pytest.raises(NonFiniteError, match=r"epoch 1, training batch (\d+) of 8") as info:
        jg.fit(model, P0, ds, epochs=3, checkpoint_path=path, **KW)
    e = info.value
    assert finite(e.params) and e.history.interrupted and e.history.state is e.state
    batch = int(__import__("re").search(r"training batch (\d+)", str(e)).group(1))
    opt = jg.Optimizer(model, ADAM, loss="cross_entropy", period=2)
    opt.init(P0, X[:4], Y[:4])
    order = jg.Dataset(data, Y)
    state = opt.load(path, dataset=order)  # the last finite state and the order of its epoch
    assert bits(state) == bits(e.state)
    assert list(order.permutation).index(37) // 4 == batch - 1  # the named batch holds it
    np.testing.assert_array_equal(ds.permutation, np.arange(48))  # the caller's order: as given
    params, history = jg.fit(model, P0, jg.Dataset(data, Y), epochs=3, on_nonfinite="skip", **KW)
    assert finite(params) and history.skipped == [1, 1, 1]


def test_fit_does_not_change_the_callers_dataset_and_repeats_itself():
    ds = jg.Dataset(X, Y)
    a, _ = jg.fit(model, P0, ds, epochs=2, **KW)
    b, _ = jg.fit(model, P0, ds, epochs=2, **KW)
    np.testing.assert_array_equal(ds.permutation, np.arange(48))
    assert bits(a) == bits(b)


def sigint_at_epoch(n, times=1):
    def callback(epoch, history):
        if epoch == n:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
    return callback


def test_ctrl_c_in_fit_returns_the_state_and_a_rerun_resumes_bitwise(tmp_path, sigint_handler):
    want, want_history = jg.fit(model, P0, jg.Dataset(X, Y), epochs=4, **KW)
    path = tmp_path / "ckpt.jgs"
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C in epoch 3 after 0 of 8") as info:
        jg.fit(model, P0, jg.Dataset(X, Y), epochs=4, checkpoint_path=path,
               callback=sigint_at_epoch(2), **KW)
    e = info.value
    assert len(e.history.train_loss) == 2 and bits(e.params) == bits(e.state.params)
    params, history = jg.fit(model, P0, jg.Dataset(X, Y), epochs=4, checkpoint_path=path, **KW)
    assert bits(params) == bits(want)
    assert history.train_loss == want_history.train_loss
    assert history.val_accuracy == want_history.val_accuracy
    again, _ = jg.fit(model, P0, jg.Dataset(X, Y), epochs=4, checkpoint_path=path, **KW)
    assert bits(again) == bits(want)  # a finished checkpoint: nothing left to do
    with pytest.raises(jg.training.ArgumentError, match="has 4 epochs done"):
        jg.fit(model, P0, jg.Dataset(X, Y), epochs=3, checkpoint_path=path, **KW)


def test_a_second_ctrl_c_aborts_at_once_and_writes_nothing(tmp_path, sigint_handler):
    path = tmp_path / "ckpt.jgs"
    with pytest.raises(KeyboardInterrupt) as info:
        jg.fit(model, P0, jg.Dataset(X, Y), epochs=4, checkpoint_path=path,
               callback=sigint_at_epoch(1, times=2), **KW)
    assert not path.exists() and finite(info.value.state.params)


def test_resume_from_a_periodic_checkpoint_mid_epoch_is_bitwise(tmp_path):
    want, want_history = jg.fit(model, P0, jg.Dataset(X, Y), epochs=4, **KW)
    path, snapshot = tmp_path / "ckpt.jgs", tmp_path / "epoch2.jgs"

    def keep(epoch, history):
        if epoch == 2:
            shutil.copy(path, snapshot)

    # 8 training micro-steps per epoch, period 2: every 5 optimizer steps = micro-steps 10, 20
    jg.fit(model, P0, jg.Dataset(X, Y), epochs=4, checkpoint_every=5, checkpoint_path=path,
           callback=keep, **KW)
    shutil.copy(snapshot, path)
    opt = jg.Optimizer(model, ADAM, loss="cross_entropy", period=2)
    opt.init(P0, X[:4], Y[:4])
    _, extra = opt.load(path, extra=True)
    assert (extra["fit"]["epoch"], extra["fit"]["batch"]) == (2, 2)  # mid-epoch, mid-training
    params, history = jg.fit(model, P0, jg.Dataset(X, Y), epochs=4, checkpoint_path=path, **KW)
    assert bits(params) == bits(want)
    assert history.train_loss == want_history.train_loss
    assert history.train_loss_unc == want_history.train_loss_unc


def rewrite_extra(path, change):
    blob = path.read_bytes()
    fixed = len(MAGIC) + 12
    (hlen,) = struct.unpack_from("<Q", blob, len(MAGIC) + 4)
    header = json.loads(blob[fixed:fixed + hlen])
    change(header["extra"]["fit"])
    raw = json.dumps(header).encode()
    body = MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(raw)) + raw + blob[fixed + hlen:-32]
    path.write_bytes(body + hashlib.sha256(body).digest())


def test_a_checkpoint_of_another_run_or_a_malformed_one_is_refused(tmp_path):
    path = tmp_path / "ckpt.jgs"
    jg.fit(model, P0, jg.Dataset(X, Y), epochs=1, checkpoint_path=path, **KW)
    blob = path.read_bytes()
    cases = [
        (dict(batch_size=16, physical_batch_size=8),
         r"batch: the file's is inputs float32\[4, 5\]; labels int32\[4\], this Optimizer's is "
         r"inputs float32\[8, 5\]"),
        (dict(val_split=0.5), r"config.val_split is 0.25, this run has 0.5"),
        (dict(physical_batch_size=8), r"meta.period is 2, this Optimizer has 1"),
        (dict(key=jax.random.PRNGKey(4)), r"config.key"),
        (dict(loss="mse", dataset=jg.Dataset(X, np.eye(3, dtype=np.float32)[Y])),
         r"meta.loss is 'cross_entropy'"),
    ]
    for changes, pattern in cases:
        path.write_bytes(blob)
        args = {**KW, **changes}
        data = args.pop("dataset", jg.Dataset(X, Y))
        with pytest.raises(StateFileError, match=pattern):
            jg.fit(model, P0, data, epochs=2, checkpoint_path=path, **args)
    hostile = [
        (lambda f: f.update(epoch=-1), r"extra.fit.epoch is -1"),
        (lambda f: f.update(step=3), r"extra.fit.step is 3"),
        (lambda f: f.update(batch=99), r"extra.fit.batch is 99"),
        (lambda f: f["history"]["train_loss"].append(1.0), r"history.train_loss must be 1"),
        (lambda f: f["key"].update(data=[2**40, 0]), r"extra.fit.key.data"),
        (lambda f: f.update(train={"losses": "x"}), r"extra.fit.train"),
        (lambda f: f.update(version=9), r"extra.fit.version is 9"),
        (lambda f: f.pop("seconds"), r"not a fit checkpoint"),
    ]
    for change, pattern in hostile:
        path.write_bytes(blob)
        rewrite_extra(path, change)
        with pytest.raises(StateFileError, match=pattern):
            jg.fit(model, P0, jg.Dataset(X, Y), epochs=2, checkpoint_path=path, **KW)
    opt = jg.Optimizer(model, ADAM, loss="cross_entropy", period=2)
    state = opt.init(P0, X[:4], Y[:4])
    opt.save(state, path)
    with pytest.raises(StateFileError, match="holds no dataset order"):
        jg.fit(model, P0, jg.Dataset(X, Y), epochs=2, checkpoint_path=path, **KW)
    opt.save(state, path, dataset=jg.Dataset(X, Y))  # a state file, but no fit checkpoint
    with pytest.raises(StateFileError, match="extra.fit is missing"):
        jg.fit(model, P0, jg.Dataset(X, Y), epochs=2, checkpoint_path=path, **KW)
