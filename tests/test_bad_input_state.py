"""Bad training state and labels: foreign states, foreign files, out-of-range class ids.

Issue 19's sweep of the training-state surface (items 2, 3, 5, 6). Each probe is classified as a
user meets it: clear (a `jgraph` error whose message names the problem), unclear (another
exception, or a message that does not name it), silent (no error), lost (an error, but a state
that existed before is gone: donated, overwritten or changed). Every probe must be clear.
Class ids in JAX arrays are not read back on the host (a per-step device sync): there an id out
of range makes the loss NaN, which `on_nonfinite="raise"` reports (see
`test_bad_input_training.py`).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 5)).astype(np.float32)
Y = RNG.integers(0, 3, 32).astype(np.int32)
ADAM = optax.adam(1e-2)


def model(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


def params(width=6):
    return {"w": (RNG.normal(size=(5, width)) * 0.5).astype(np.float32),
            "v": (RNG.normal(size=(width, 3)) * 0.5).astype(np.float32)}


P0 = params()


def started(tx=ADAM, width=6, period=1, fn=model):
    opt = jg.Optimizer(fn, tx, loss="cross_entropy", period=period)
    return opt, opt.init(params(width) if width != 6 else P0, X[:8], Y[:8])


def alive(state) -> bool:
    return not any(isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(state))


# -- probes: each returns after the call, or raises; `kept` checks nothing was lost -------------
def foreign_step(tx=None, width=6, call="step", period=1):
    opt, own = started(period=period)
    _, other = started(tx or ADAM, width, period)

    def probe():
        try:
            if call == "step":
                opt.step(other, X[:8], Y[:8])
            elif call == "evaluate":
                opt.evaluate(other, X[:8], Y[:8])
            elif call == "reset":
                opt.reset(other)
            else:
                opt.save(other, "unused.jgs")
        finally:  # neither state was donated or replaced by the refused call
            if not (alive(other) and alive(own) and opt.latest_state is own):
                raise AssertionError("lost: a state was donated or replaced")
    return probe


def foreign_file(tmp, fn=model, tx=ADAM, strict=True):
    def probe():
        writer, state = started(tx, fn=fn)
        writer.save(state, tmp / "file.jgs")
        opt, own = started()
        try:
            opt.load(tmp / "file.jgs", strict=strict)
        finally:
            if opt.latest_state is not own:
                raise AssertionError("lost: the Optimizer's state changed")
    return probe


def labels_probe(where, labels, period=1):
    def probe():
        opt, state = started(period=period)
        if where == "init":
            opt.init(P0, X[:8], labels)
        elif where == "step":
            opt.step(state, X[:8], labels)
        elif where == "step_period":
            opt.step_period(state, X[:8 * period].reshape(period, 8, 5),
                            np.asarray(labels).reshape(period, 8))
        elif where == "evaluate":
            opt.evaluate(state, X[:8], labels)
    return probe


def fit_probe(tmp, **kw):
    def probe():
        jg.fit(model, P0, kw.pop("dataset", jg.Dataset(X, Y)), loss="cross_entropy", tx=ADAM,
               batch_size=8, progress=False, **kw)
    return probe


def probes(tmp):
    bad = Y[:8].copy()
    bad[5] = 3
    return [
        # item 6: another Optimizer's state
        ("step: sgd-momentum state in an adam Optimizer",
         foreign_step(optax.sgd(0.1, momentum=0.9)),
         r"Optimizer.step: this is the state of a different Optimizer: its optimizer state is "
         r"TraceState, EmptyState, this Optimizer's is ScaleByAdamState"),
        ("step: a wider model's state", foreign_step(width=8),
         r"different Optimizer: state.params\['v'\] is float32\[8, 3\], this Optimizer's is "
         r"float32\[6, 3\]"),
        ("step: a period-2 state in a period-1 Optimizer",
         lambda: started(period=1)[0].step(started(period=2)[1], X[:8], Y[:8]),
         r"different Optimizer: .*state.grad_acc"),
        ("evaluate: a wider model's state", foreign_step(width=8, call="evaluate"),
         r"Optimizer.evaluate: this is the state of a different Optimizer"),
        ("reset: an sgd state", foreign_step(optax.sgd(0.1, momentum=0.9), call="reset"),
         r"Optimizer.reset: this is the state of a different Optimizer"),
        ("save: an sgd state", foreign_step(optax.sgd(0.1, momentum=0.9), call="save"),
         r"Optimizer.save: this is the state of a different Optimizer"),
        ("step: not a TrainState", lambda: started()[0].step({"w": 1}, X[:8], Y[:8]),
         r"Optimizer.step: expected a TrainState \(from init, step or load\), got dict"),
        ("evaluate: not a TrainState", lambda: started()[0].evaluate((1, 2), X[:8], Y[:8]),
         r"Optimizer.evaluate: expected a TrainState"),
        # item 2: files of another setup
        ("load: a sin model's file into a tanh Optimizer",
         foreign_file(tmp, fn=lambda p, x: jnp.sin(x @ p["w"]) @ p["v"]),
         r"model computing sin where this Optimizer's computes tanh"),
        ("load: an adamax file into an adam Optimizer", foreign_file(tmp, tx=optax.adamax(1e-2)),
         r"scale_by_adamax.*this Optimizer's is chain\(scale_by_adam\("),
        ("load: an sgd file, strict=False", foreign_file(tmp, tx=optax.sgd(0.1), strict=False),
         r"lacks leaves"),
        ("load: strict not a bool", lambda: started()[0].load(tmp / "x", strict="yes"),
         r"strict must be True or False"),
        ("load: before init", lambda: jg.Optimizer(model, ADAM).load(tmp / "x"),
         r"call init\(params, example_inputs\) first"),
        ("load: a folder", lambda: started()[0].load(tmp), r"cannot read state file"),
        # item 3: class ids out of range, on the host
        ("init: example label 3 of 3 classes", labels_probe("init", bad),
         r"labels \(for 'cross_entropy' over 3 outputs\) must be class ids in \[0, 3\); got 3 "
         r"at index 5"),
        ("init: a negative example label", labels_probe("init", Y[:8] - 1),
         r"class ids in \[0, 3\); got -1 at index"),
        ("step: a list of labels", labels_probe("step", bad.tolist()),
         r"built for inputs \(and labels\) float32\[8, 5\], int32\[8\], got float32\[8, 5\], "
         r"int64\[\], .*pass np.asarray"),
        ("step: uint8 labels out of range", labels_probe("step", (Y[:8] + 3).astype(np.uint8)),
         r"class ids in \[0, 3\)|static Optimizer was built for inputs"),
        ("step_period: a label out of range",
         labels_probe("step_period", np.concatenate([Y[:8], bad]), period=2),
         r"class ids in \[0, 3\); got 3 at index \(1, 5\)"),
        ("evaluate: a label out of range", labels_probe("evaluate", bad), r"got 3 at index 5"),
        ("Dataset(classes=3): label 3", lambda: jg.Dataset(X[:8], bad, classes=3),
         r"Dataset: labels must be class ids in \[0, 3\); got 3 at index 5"),
        ("Dataset(classes=3): float labels", lambda: jg.Dataset(X[:8], bad * 1.0, classes=3),
         r"Dataset: labels must be integer class ids for 3 classes, got dtype float64"),
        ("Dataset(classes=3): no labels", lambda: jg.Dataset(X[:8], classes=3),
         r"class ids are needed"),
        ("Dataset(classes=0)", lambda: jg.Dataset(X[:8], bad, classes=0),
         r"classes must be >= 1"),
        ("fit: a label out of range in the last batch",
         fit_probe(tmp, dataset=jg.Dataset(X, np.concatenate([Y[:-1], [7]]).astype(np.int32))),
         r"got 7 at index 31"),
        # paths and datasets given to save and load
        ("save: under a regular file", lambda: started()[0].save(started()[1],
                                                                 tmp / "regular" / "s.jgs"),
         r"cannot write state file .*regular/s.jgs'"),
        ("save: to a folder", lambda: started()[0].save(started()[1], tmp),
         r"Optimizer.save: .* is a folder, not a file path"),
        ("save: path None", lambda: started()[0].save(started()[1], None),
         r"Optimizer.save: path must be a str or an os.PathLike, got NoneType"),
        ("save: dataset an array", lambda: started()[0].save(started()[1], tmp / "d.jgs",
                                                             dataset=np.arange(3)),
         r"Optimizer.save: dataset must be a jg.Dataset, got ndarray"),
        ("load: path an int", lambda: started()[0].load(3),
         r"path must be a str or an os.PathLike"),
        ("load: dataset an array", lambda: started()[0].load(tmp / "x", dataset=np.arange(3)),
         r"Optimizer.load: dataset must be a jg.Dataset"),
        ("load: extra not a bool", lambda: started()[0].load(tmp / "x", extra="yes"),
         r"extra must be True or False"),
        ("reset: optimizer not a bool", lambda: (lambda o, s: o.reset(s, optimizer="yes"))(
            *started()), r"Optimizer.reset: optimizer must be True or False"),
        ("grad_acc: not a TrainState", lambda: started()[0].grad_acc({"w": 1}),
         r"Optimizer.grad_acc: expected a TrainState"),
        # item 5: checkpoint paths
        ("fit: checkpoint under a regular file", fit_probe(
            tmp, checkpoint_path=tmp / "regular" / "c.jgs"), r"cannot be written"),
        ("fit: checkpoint path is a folder", fit_probe(tmp, checkpoint_path=tmp),
         r"is a folder, not a file path"),
        ("fit: strict not a bool", fit_probe(tmp, strict=1), r"strict must be True or False"),
        ("fit: checkpoint_path not a path", fit_probe(tmp, checkpoint_path=3.5),
         r"checkpoint_path must be a str or a path"),
    ]


def classify(call, pattern) -> str:
    try:
        call()
    except AssertionError as e:
        if str(e).startswith("lost"):
            return str(e)
        raise
    except jg.JGraphError as e:
        return "clear" if re.search(pattern, str(e)) else f"unclear: {e}"
    except Exception as e:  # noqa: BLE001 - classifying is the point
        return f"unclear: {type(e).__name__}: {e}"
    return "silent"


def test_sweep(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the refused saves must never write; if they did, it is here
    (tmp_path / "regular").write_text("a file, not a folder")
    table = probes(tmp_path)
    outcomes = {what: classify(call, pattern) for what, call, pattern in table}
    tally = {k: sum(o.split(":")[0] == k for o in outcomes.values())
             for k in ("clear", "unclear", "silent", "lost")}
    print(f"\ntraining state: {len(table)} probes, {tally}")
    bad = {what: o for what, o in outcomes.items() if o != "clear"}
    assert not bad, bad
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.jgs", "regular"]


def test_a_step_refused_for_a_foreign_state_leaves_both_states_usable():
    opt, own = started()
    other_opt, other = started(optax.sgd(0.1, momentum=0.9))
    with pytest.raises(jg.JGraphError, match="different Optimizer"):
        opt.step(other, X[:8], Y[:8])
    state, out = opt.step(own, X[:8], Y[:8])  # both go on as if nothing happened
    other, _ = other_opt.step(other, X[:8], Y[:8])
    assert np.isfinite(out.loss) and alive(state) and alive(other)
    # reset(optimizer=True) rebuilds the optimizer state: a foreign one whose params fit is
    # turned into a fresh state of this Optimizer (a transfer of the params)
    fresh = opt.reset(other_opt.latest_state, optimizer=True)
    ref = ADAM.init(other_opt.latest_state.params)
    for a, b in zip(jax.tree.leaves(fresh.opt_state), jax.tree.leaves(ref), strict=True):
        assert np.array_equal(a, b)
    assert fresh.params is other_opt.latest_state.params


def test_in_range_labels_of_every_integer_kind_train():
    for dtype in (np.uint8,):  # unsigned ids (int32 is every other test's)
        opt = jg.Optimizer(model, ADAM, loss="cross_entropy", static=False)
        state = opt.init(P0, X[:8], Y[:8].astype(dtype))
        _, out = opt.step(state, X[:8], Y[:8].astype(dtype))
        ref = optax.softmax_cross_entropy_with_integer_labels(model(P0, X[:8]), Y[:8]).mean()
        np.testing.assert_allclose(out.loss, ref, rtol=1e-6)
    ds = jg.Dataset(X, Y, classes=3)
    assert ds.ndata == 32
