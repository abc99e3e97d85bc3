"""Bad numbers and options given to Dataset, fit, Optimizer and the losses: each a named error.

`test_sweep` feeds every probe and classifies the outcome as ggml-opt's users would meet it:
clear (a `jgraph` error whose message names the problem), unclear (any other exception, or a
message that does not name it), silent (no error). It prints the tally (`pytest -s`) and asserts
that every probe is clear. Out-of-range class ids on the device make the loss NaN (as optax's
integer-label cross-entropy does), which the non-finite guard then reports.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg
from jgraph.training import ArgumentError, NonFiniteError

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 5)).astype(np.float32)
Y = RNG.integers(0, 3, 32).astype(np.int32)
SGD = optax.sgd(0.1)


def model(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


P0 = {"w": (RNG.normal(size=(5, 6)) * 0.5).astype(np.float32),
      "v": (RNG.normal(size=(6, 3)) * 0.5).astype(np.float32)}


def ds():
    return jg.Dataset(X, Y)


def fit(**kw):
    args = dict(loss="cross_entropy", tx=SGD, epochs=1, batch_size=8, progress=False)
    return jg.fit(model, P0, kw.pop("dataset", ds()), **{**args, **kw})


def optimizer(**kw):
    return jg.Optimizer(model, kw.pop("tx", SGD), **{"loss": "cross_entropy", **kw})


def started(period=1):
    opt = optimizer(period=period)
    return opt, opt.init(P0, X[:8], Y[:8])


def stale_state():
    opt, state = started()
    opt.step(state, X[:8], Y[:8])  # donates `state`
    return opt, state


# (what, call, message pattern)
PROBES = [
    ("Dataset.batch negative size", lambda: ds().batch(0, -4), "batch_size must be >= 1"),
    ("Dataset.batch size 0", lambda: ds().batch(0, 0), "batch_size must be >= 1"),
    ("Dataset.batch float size", lambda: ds().batch(0, 2.0), "batch_size must be an int"),
    ("Dataset.batch bool size", lambda: ds().batch(0, True), "batch_size must be an int"),
    ("Dataset.batch negative index", lambda: ds().batch(-1, 4), "ibatch must be >= 0"),
    ("Dataset.batch float index", lambda: ds().batch(1.0, 4), "ibatch must be an int"),
    ("Dataset.batch past the end", lambda: ds().batch(8, 4), "out of range"),
    ("Dataset shard size 0", lambda: jg.Dataset(X, shard_size=0), "shard_size must be >= 1"),
    ("Dataset float shard size", lambda: jg.Dataset(X, shard_size=2.5), "must be an int"),
    ("Dataset shard larger than data", lambda: jg.Dataset(X, shard_size=33), "exceeds"),
    ("Dataset string labels", lambda: jg.Dataset(X, np.array(["a"] * 32)), "must hold numbers"),
    ("Dataset object data", lambda: jg.Dataset(np.array([object()] * 4)), "must hold numbers"),
    ("Dataset scalar data", lambda: jg.Dataset(np.float32(3)), "leading axis"),
    ("Dataset label count", lambda: jg.Dataset(X, Y[:-1]), "31 labels for 32"),
    ("Dataset.shuffle float idata", lambda: ds().shuffle(jax.random.PRNGKey(0), 2.5),
     "idata must be an int"),
    ("Dataset.shuffle not a key", lambda: ds().shuffle("seed"), "key must be a JAX PRNG key"),
    ("fit negative batch", lambda: fit(batch_size=-8), "batch_size must be >= 1"),
    ("fit batch 0", lambda: fit(batch_size=0), "batch_size must be >= 1"),
    ("fit float batch", lambda: fit(batch_size=8.0), "batch_size must be an int"),
    ("fit bool batch", lambda: fit(batch_size=True), "batch_size must be an int"),
    ("fit batch beyond data", lambda: fit(batch_size=64), "exceeds the 32 datapoints"),
    ("fit physical 0", lambda: fit(physical_batch_size=0), "physical_batch_size must be >= 1"),
    ("fit physical not dividing", lambda: fit(physical_batch_size=3), "not a multiple"),
    ("fit negative epochs", lambda: fit(epochs=-3), "epochs must be >= 1"),
    ("fit zero epochs", lambda: fit(epochs=0), "epochs must be >= 1"),
    ("fit float epochs", lambda: fit(epochs=1.5), "epochs must be an int"),
    ("fit string epochs", lambda: fit(epochs="3"), "epochs must be an int"),
    ("fit NaN val_split", lambda: fit(val_split=float("nan")), "val_split must be finite"),
    ("fit val_split 1", lambda: fit(val_split=1.0), r"val_split must be in \[0.0, 1.0\)"),
    ("fit negative val_split", lambda: fit(val_split=-0.1), "val_split must be in"),
    ("fit string val_split", lambda: fit(val_split="0.2"), "val_split must be a real number"),
    ("fit val_split leaves nothing", lambda: fit(val_split=0.9), "leaves no training batch"),
    ("fit on_nonfinite", lambda: fit(on_nonfinite="warn"), "on_nonfinite must be one of"),
    ("fit checkpoint_every 0", lambda: fit(checkpoint_every=0, checkpoint_path="x"),
     "checkpoint_every .* must be >= 1"),
    ("fit checkpoint_every word", lambda: fit(checkpoint_every="weekly", checkpoint_path="x"),
     "checkpoint_every .* must be an int"),
    ("fit checkpoint_every without path", lambda: fit(checkpoint_every=2),
     "needs a checkpoint_path"),
    ("fit bad key", lambda: fit(key="abc"), "key must be a JAX PRNG key"),
    ("fit float key", lambda: fit(key=jnp.zeros(2)), "key must be a JAX PRNG key"),
    ("fit array not Dataset", lambda: fit(dataset=X), "dataset must be a jg.Dataset"),
    ("fit label out of range", lambda: fit(dataset=jg.Dataset(X, np.where(Y == 2, 3, Y))),
     r"class ids in \[0, 3\).* got 3 at index"),
    ("fit negative label", lambda: fit(dataset=jg.Dataset(X, Y - 1)), r"got -1 at index"),
    ("fit unknown loss", lambda: fit(loss="hinge"), "unknown loss type 'hinge'"),
    ("fit tx not optax", lambda: fit(tx="adam"), "tx must be an optax GradientTransformation"),
    ("Optimizer period 0", lambda: optimizer(period=0), "period must be in"),
    ("Optimizer period 2**31", lambda: optimizer(period=2**31),
     r"period must be in \[1, 2147483647"),
    ("Optimizer float period", lambda: optimizer(period=2.0), "period must be an int"),
    ("Optimizer bool period", lambda: optimizer(period=True), "period must be an int"),
    ("Optimizer unknown loss", lambda: optimizer(loss="l1"), "unknown loss type 'l1'"),
    ("Optimizer tx", lambda: optimizer(tx=object()), "tx must be an optax"),
    ("Optimizer fn", lambda: jg.Optimizer(42, SGD), "fn must be callable"),
    ("Optimizer on_nonfinite", lambda: optimizer(on_nonfinite="nan"), "on_nonfinite must be"),
    ("Optimizer string labels", lambda: optimizer().init(P0, X[:8], np.array(["a"] * 8)),
     r"labels must be an array of numbers"),
    ("Optimizer string param", lambda: optimizer().init({**P0, "name": "mlp"}, X[:8], Y[:8]),
     r"params\['name'\] must be an array of numbers"),
    ("step label out of range", lambda: (lambda o, s: o.step(s, X[:8], Y[:8] + 3))(*started()),
     r"class ids in \[0, 3\)"),
    ("evaluate label out of range",
     lambda: (lambda o, s: o.evaluate(s, X[:8], Y[:8] - 5))(*started()), r"class ids in"),
    ("step complex input", lambda: (lambda o, s: o.step(s, X[:8] + 0j, Y[:8]))(*started()),
     "static Optimizer was built for inputs"),
    ("step float labels for int", lambda: (lambda o, s: o.step(s, X[:8], Y[:8] * 1.0))(
        *started()), "static Optimizer was built for inputs"),
    ("step counter out of range", lambda: (lambda o, s: o.step(s._replace(counter=7), X[:8],
                                                                Y[:8]))(*started(4)),
     r"state.counter must be in \[0, 3\], got 7"),
    ("step float counter", lambda: (lambda o, s: o.step(s._replace(counter=1.5), X[:8],
                                                         Y[:8]))(*started(4)),
     "state.counter must be an int"),
    ("step on a donated state", lambda: (lambda o, s: o.step(s, X[:8], Y[:8]))(*stale_state()),
     "donated to a later step"),
    ("save a donated state", lambda: (lambda o, s: o.save(s, "unused.jgs"))(*stale_state()),
     "latest_state"),
    ("save another structure", lambda: (lambda o, s: o.save(s._replace(params={"w": 1}),
                                                            "unused.jgs"))(*started()),
     r"state of a different Optimizer: it lacks state.params\['v'\]"),
    ("save a wrong shape", lambda: (lambda o, s: o.save(s._replace(
        params={**s.params, "v": jnp.zeros((6, 4))}), "unused.jgs"))(*started()),
     r"state.params\['v'\] is float32\[6, 4\], this Optimizer's is float32\[6, 3\]"),
    ("save extra not JSON", lambda: (lambda o, s: o.save(s, "unused.jgs", extra=object()))(
        *started()), "extra` must be JSON-serialisable"),
]


def classify(call, pattern):
    import re

    try:
        call()
    except jg.JGraphError as e:
        return "clear" if re.search(pattern, str(e)) else f"unclear: {e}"
    except Exception as e:  # noqa: BLE001 - classifying is the point
        return f"unclear: {type(e).__name__}: {e}"
    return "silent"


def test_sweep(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the save probes must never write; if they did, it is here
    outcomes = {what: classify(call, pattern) for what, call, pattern in PROBES}
    tally = {k: sum(o.split(":")[0] == k for o in outcomes.values())
             for k in ("clear", "unclear", "silent")}
    print(f"\nnumbers from users: {len(PROBES)} probes, {tally}, lost 0")
    bad = {what: o for what, o in outcomes.items() if o != "clear"}
    assert not bad, bad
    assert not list(tmp_path.iterdir())  # no refused save wrote anything


def test_argument_errors_are_value_and_type_errors():
    with pytest.raises(ValueError):
        ds().batch(0, -4)
    with pytest.raises(TypeError):
        ds().batch(0, 2.0)


def test_out_of_range_class_ids_on_the_device_make_the_loss_nan():
    opt, state = started()
    bad = jnp.asarray(Y[:8]).at[3].set(3)  # a device array: not checked on the host
    assert np.isnan(opt.evaluate(state, X[:8], bad).loss)
    good = opt.evaluate(state, X[:8], jnp.asarray(Y[:8])).loss
    ref = optax.softmax_cross_entropy_with_integer_labels(model(P0, X[:8]), Y[:8]).mean()
    np.testing.assert_allclose(good, ref, rtol=1e-6)
    opt = optimizer(on_nonfinite="raise")
    state = opt.init(P0, X[:8], Y[:8])
    with pytest.raises(NonFiniteError):
        opt.step(state, X[:8], bad)


def test_a_python_int_counter_round_trips(tmp_path):
    opt, state = started(4)
    state, _ = opt.step(state, X[:8], Y[:8])
    opt.save(state._replace(counter=1), tmp_path / "s.jgs")  # a Python int, as users write it
    back = opt.load(tmp_path / "s.jgs")
    assert isinstance(back.counter, np.int32) and back.counter == 1
    with pytest.raises(ArgumentError, match="counter must be in"):
        opt.save(state._replace(counter=4), tmp_path / "t.jgs")
    assert not (tmp_path / "t.jgs").exists()
