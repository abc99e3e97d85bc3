"""Issue 19 sweep probes: state fingerprints and `strict=`, foreign states, class ids, checkpoint
paths and save failures (`Optimizer`, `jg.fit`).

Each function returns `(probes, slow_names)`; see tests/test_sweep_issue19.py.
"""

import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jgraph as jg


def training_probes():
    RNG = np.random.default_rng(0)
    X = RNG.normal(size=(32, 5)).astype(np.float32)
    Y = RNG.integers(0, 3, 32).astype(np.int32)
    P0 = {"w": (RNG.normal(size=(5, 6)) * 0.5).astype(np.float32), "v": (RNG.normal(size=(6,
        3)) * 0.5).astype(np.float32)}
    def model(p, x): return jnp.tanh(x @ p["w"]) @ p["v"]
    def model_sin(p, x): return jnp.sin(x @ p["w"]) @ p["v"]
    T = tempfile.mkdtemp()
    FILE = os.path.join(T, "afile")
    open(FILE, "w").write("x")

    def opt(fn=model, tx=None, **kw):
        return jg.Optimizer(fn, tx or optax.adam(1e-2), **{"loss": "cross_entropy", **kw})
    def started(fn=model, tx=None, x=X[:8], p=P0, **kw):
        o = opt(fn, tx, **kw)
        return o, o.init(p, x, Y[:8])
    _n = [0]
    def saved(fn=model, tx=None, **kw):
        o, s = started(fn, tx, **kw)
        s, _ = o.step(s, X[:8], Y[:8])
        _n[0] += 1
        path = os.path.join(T, f"s{_n[0]}.jgs")
        o.save(s, path)
        return path, s
    def fit(**kw):
        args = dict(loss="cross_entropy", tx=optax.sgd(0.1), epochs=1, batch_size=8, progress=False)
        return jg.fit(kw.pop("fn", model), P0, kw.pop("dataset", jg.Dataset(X, Y)), **{**args,
            **kw})

    def load_into(path_state, **kw):
        path, _ = path_state
        o, _ = started(**{k: v for k, v in kw.items() if k != "strict"})
        return o.load(path, strict=kw.get("strict", True))
    def step_foreign(a, b):
        (o1, _), (_, s2) = a, b
        return o1.step(s2, X[:8], Y[:8])
    def fit_then_fail_save():
        orig = jg.Optimizer.save
        calls = [0]
        def boom(self, *a, **k):
            calls[0] += 1
            raise OSError(28, "No space left on device")
        jg.Optimizer.save = boom
        try:
            return fit(checkpoint_path=os.path.join(T, "boom.jgs"), epochs=2)
        except jg.JGraphError as e:
            ok = hasattr(e, "state") and hasattr(e, "params") and hasattr(e, "history")
            raise type(e)(str(e) + (" [attached]" if ok else " [NOT ATTACHED]")) from e
        finally:
            jg.Optimizer.save = orig
    def fit_resume(first, second, **kw):
        path = os.path.join(T, f"r{len(os.listdir(T))}.jgs")
        fit(checkpoint_path=path, **first)
        before = open(path, "rb").read()
        try:
            return fit(checkpoint_path=path, **second, **kw)
        finally:
            assert open(path,
                "rb").read() == before or kw.get("strict") is False, "checkpoint overwritten"
    def labels_probe(labels, where="init"):
        o = opt()
        if where == "init":
            return o.init(P0, X[:len(labels)], labels)
        s = o.init(P0, X[:8], Y[:8])
        return o.step(s, X[:len(labels)], labels) if where == "step" else o.evaluate(s,
            X[:len(labels)], labels)

    def finite_state(r):
        return all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(r))

    PROBES = [
      ("load strict='yes'", lambda: load_into(saved(), strict="yes"),
          r"strict must be True or False"),
      ("load strict=None", lambda: load_into(saved(), strict=None),
          r"strict must be True or False"),
      ("load strict=1", lambda: load_into(saved(), strict=1), r"strict must be True or False"),
      ("load missing file", lambda: started()[0].load(os.path.join(T, "nope.jgs")), r"nope.jgs"),
      ("load a folder", lambda: started()[0].load(T), r"folder|directory|Is a directory"),
      ("load a text file", lambda: started()[0].load(FILE), r"afile"),
      ("load path None", lambda: started()[0].load(None), r"path"),
      ("load path int", lambda: started()[0].load(3), r"path"),
      ("load another model", lambda: load_into(saved(fn=model_sin)), r"differs|model|forward"),
      ("load another model, not strict", lambda: load_into(saved(fn=model_sin), strict=False),
          finite_state),
      ("load adam into adamax", lambda: load_into(saved(tx=optax.adam(1e-2)),
          tx=optax.adamax(1e-2)), r"optimizer|differs"),
      ("load adam lr 1e-2 into 1e-3", lambda: load_into(saved(tx=optax.adam(1e-2)),
          tx=optax.adam(1e-3)), r"learning_rate|differs|optimizer"),
      ("load sgd into adam", lambda: load_into(saved(tx=optax.sgd(0.1)), tx=optax.adam(1e-2)),
          r"differ|optimizer|state"),
      ("load sgd into adam, not strict", lambda: load_into(saved(tx=optax.sgd(0.1)),
          tx=optax.adam(1e-2), strict=False), r"state|structure|differ"),
      ("load period 2 into period 1", lambda: load_into(saved(period=2), period=1), r"period"),
      ("load wider model", lambda: load_into(saved(), p={"w": np.zeros((5, 7), np.float32),
          "v": np.zeros((7, 3), np.float32)}), r"params|shape|\[5, 7\]|differs"),
      ("load wider model not strict", lambda: load_into(saved(), p={"w": np.zeros((5, 7),
          np.float32), "v": np.zeros((7,
              3), np.float32)}, strict=False), r"params|shape|\[5, 7\]|differs"),
      ("load mean loss file into cross_entropy", lambda: load_into(saved(loss="mean")), r"loss"),
      ("load other batch size", lambda: load_into(saved(),
          x=X[:4]) if False else (lambda o: o.load(saved()[0]))(opt().__class__(model,
              optax.adam(1e-2), loss="cross_entropy")), r"init|example|before"),
      ("load before init", lambda: opt().load(saved()[0]), r"init"),
      ("save before init", lambda: opt().save(None, os.path.join(T, "x.jgs")), r"init|state"),
      ("step adam state into sgd opt", lambda: step_foreign(started(tx=optax.sgd(0.1)),
          started(tx=optax.adam(1e-2))), r"different Optimizer"),
      ("step wider state", lambda: step_foreign(started(), started(p={"w": np.zeros((5, 7),
          np.float32), "v": np.zeros((7, 3), np.float32)})), r"different Optimizer"),
      ("step period-2 state into period-1", lambda: step_foreign(started(), started(period=2)),
          r"different Optimizer|counter|period"),
      ("step state None", lambda: started()[0].step(None, X[:8], Y[:8]), r"expected a TrainState"),
      ("step state a dict", lambda: started()[0].step({"params": P0}, X[:8], Y[:8]),
          r"expected a TrainState"),
      ("step state params only", lambda: (lambda o, s: o.step(s.params, X[:8], Y[:8]))(*started()),
          r"expected a TrainState"),
      ("step state adamw into adam", lambda: step_foreign(started(tx=optax.adam(1e-2)),
          started(tx=optax.adamw(1e-2))),
              r"different Optimizer: its optimizer state is ScaleByAdamState, EmptyState, "
              r"EmptyState"),
      ("step state of other model fn, same shapes", lambda: step_foreign(started(),
          started(fn=model_sin)), lambda r: True),
      ("evaluate another optimizer's state (params only)", lambda: (lambda a, b: a[0].evaluate(b[1],
          X[:8], Y[:8]))(started(tx=optax.sgd(0.1)), started(tx=optax.adam(1e-2))),
              lambda out: np.allclose(out.loss,
                  optax.softmax_cross_entropy_with_integer_labels(model(P0, X[:8]), Y[:8]).mean(),
                      rtol=1e-5)),
      ("reset(optimizer=True) of another optimizer's state", lambda: (lambda a, b: (a[0].reset(b[1],
          optimizer=True), a[0].init(P0, X[:8], Y[:8])))(started(tx=optax.sgd(0.1)),
              started(tx=optax.adam(1e-2))),
                  lambda r: jax.tree.structure(r[0]) == jax.tree.structure(r[1])),
      ("reset(optimizer=False) of another optimizer's state", lambda: (lambda a,
          b: a[0].reset(b[1]))(started(tx=optax.sgd(0.1)), started(tx=optax.adam(1e-2))),
              r"different Optimizer"),
      ("grad_acc foreign state", lambda: (lambda a, b: a[0].grad_acc(b[1]))(started(period=2),
          started()), r"different Optimizer|accumulator|period"),
      ("labels 3 of 3 classes", lambda: labels_probe(np.array([0, 1, 3, 0, 1, 2, 0, 1], np.int32)),
          r"\[0, 3\).*got 3 at index 2"),
      ("labels -1", lambda: labels_probe(np.array([0, 1, 2, 0, 1, 2, 0, -1], np.int32)),
          r"got -1 at index 7"),
      ("labels uint8 255", lambda: labels_probe(np.array([0, 1, 2, 0, 1, 2, 0, 255], np.uint8)),
          r"255"),
      ("labels int64 huge", lambda: labels_probe(np.array([0, 1, 2, 0, 1, 2, 0, 2**40], np.int64)),
          r"class ids|1099511627776|int32|range"),
      ("labels int8 -128", lambda: labels_probe(np.array([0, 1, 2, 0, 1, 2, 0, -128], np.int8)),
          r"-128"),
      ("labels bool", lambda: labels_probe(np.ones(8, bool)), r"labels|bool|class"),
      ("labels float NaN", lambda: labels_probe(np.array([0, 1, 2, 0, 1, 2, 0, np.nan],
          np.float32)), r"labels|NaN|nan|class|integer"),
      ("labels float fractional", lambda: labels_probe(np.array([0, 1.5, 2, 0, 1, 2, 0, 1],
          np.float32)), r"labels|class|integer|1.5"),
      ("labels shape (8,1)", lambda: labels_probe(Y[:8, None]), r"labels|shape"),
      ("labels shape (4,) for 8 inputs", lambda: opt().init(P0, X[:8], Y[:4]), r"labels|4|8"),
      ("labels None with cross_entropy", lambda: opt().init(P0, X[:8], None), r"labels"),
      ("labels out of range at step", lambda: labels_probe(np.array([0, 1, 2, 0, 1, 2, 0, 5],
          np.int32), "step"), r"got 5 at index 7"),
      ("labels out of range at evaluate", lambda: labels_probe(np.array([0, 1, 2, 0, 1, 2, 0, 5],
          np.int32), "evaluate"), r"got 5 at index 7"),
      ("labels jnp array out of range: NaN loss", lambda: labels_probe(jnp.array([0, 1, 2, 0, 1, 2,
          0, 9], jnp.int32), "step"), lambda r: bool(np.isnan(r[1].loss))),
      ("labels jnp array out of range, on_nonfinite=raise", lambda: (lambda o: o.step(o.init(P0,
          X[:8], Y[:8]), X[:8], jnp.array([0, 1, 2, 0, 1, 2, 0,
              9], jnp.int32)))(opt(on_nonfinite="raise")), r"non-finite"),
      ("save name too long", lambda: (lambda o, s: o.save(s, os.path.join(T,
          "b" * 300)))(*started()), r"too long"),
      ("load name too long", lambda: started()[0].load(os.path.join(T, "b" * 300)), r"too long"),
      ("labels (8, 2) class ids for 3 classes", lambda: labels_probe(np.zeros((8, 2), np.int32)),
          r"labels|match"),
      ("labels one-hot with cross_entropy", lambda: labels_probe(np.eye(3,
          dtype=np.float32)[Y[:8]]), lambda r: True),
      ("one-hot labels wrong width", lambda: labels_probe(np.eye(4, dtype=np.float32)[Y[:8]]),
          r"labels|shape|4|3"),
      ("Dataset labels out of range in fit", lambda: fit(dataset=jg.Dataset(X, np.where(Y == 0, 7,
          Y))), r"got 7 at index"),
      ("Dataset uint labels in fit", lambda: fit(dataset=jg.Dataset(X, Y.astype(np.uint8))),
          lambda r: finite_state(r[0])),
      ("fit checkpoint under a file", lambda: fit(checkpoint_path=os.path.join(FILE, "c.jgs")),
          r"cannot be written"),
      ("fit checkpoint is a folder", lambda: fit(checkpoint_path=T), r"folder"),
      ("fit checkpoint empty string", lambda: fit(checkpoint_path=""),
          r"checkpoint_path|folder|file"),
      ("fit checkpoint name too long", lambda: fit(checkpoint_path=os.path.join(T,
          "a" * 300 + ".jgs")), r"cannot be used: File name too long"),
      ("fit checkpoint path int", lambda: fit(checkpoint_path=5), r"checkpoint_path must be a str"),
      ("fit checkpoint path bytes", lambda: fit(checkpoint_path=b"/tmp/x.jgs"), r"checkpoint_path"),
      ("fit save fails mid-run: state attached", fit_then_fail_save, r"\[attached\]"),
      ("fit checkpoint_every epoch", lambda: fit(checkpoint_path=os.path.join(T, "ep.jgs"),
          checkpoint_every="epoch", epochs=2), lambda r: finite_state(r[0])),
      ("fit checkpoint_every 'Epoch'", lambda: fit(checkpoint_path=os.path.join(T, "ep2.jgs"),
          checkpoint_every="Epoch"), r"checkpoint_every"),
      ("fit checkpoint_every -1", lambda: fit(checkpoint_path=os.path.join(T, "ep3.jgs"),
          checkpoint_every=-1), r"checkpoint_every"),
      ("fit resume another model", lambda: fit_resume({}, {"fn": model_sin}),
          r"differs|model|forward"),
      ("fit resume another optimizer", lambda: fit_resume({}, {"tx": optax.adam(0.1)}),
          r"differs|optimizer"),
      ("fit resume another model strict=False", lambda: fit_resume({}, {"fn": model_sin,
          "epochs": 2}, strict=False), lambda r: finite_state(r[0])),
      ("fit resume other batch size", lambda: fit_resume({}, {"batch_size": 16}), r"batch|differs"),
      ("fit resume strict='no'", lambda: fit_resume({}, {}, strict="no"),
          r"strict must be True or False"),
      ("fit resume a non-fit state file", lambda: fit(checkpoint_path=saved(tx=optax.sgd(0.1))[0]),
          r"no dataset order"),
      ("fit resume with fewer epochs", lambda: fit_resume({"epochs": 2}, {"epochs": 1}), r"epochs"),
      ("fit resume a truncated checkpoint", lambda: (lambda p: (fit(checkpoint_path=p), open(p,
          "r+b").truncate(100), fit(checkpoint_path=p))[-1])(os.path.join(T, "trunc.jgs")),
              r"trunc.jgs"),
    ]
    return PROBES, ['load another model', 'load another model, not strict', 'load adam into adamax',
        'load adam lr 1e-2 into 1e-3', 'load sgd into adam', 'load sgd into adam, not strict',
            'load period 2 into period 1', 'load wider model', 'load wider model not strict',
                'load mean loss file into cross_entropy',
                    "evaluate another optimizer's state (params only)",
                        'fit resume another model strict=False', 'fit resume with fewer epochs',
                            'fit resume a truncated checkpoint', 'Dataset uint labels in fit']
