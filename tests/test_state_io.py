"""Saving and loading training state: bitwise round trip and resume, atomic, versioned, checked."""

import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg
from jgraph.training import StateFileError
from jgraph.training.state_io import FORMAT_VERSION, MAGIC

F32 = jnp.float32
RNG = np.random.default_rng(0)
XS = RNG.normal(size=(12, 4, 5)).astype(np.float32)
YS = RNG.integers(0, 3, size=(12, 4)).astype(np.int32)


def model(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


def params():
    return {"w": jnp.asarray(RNG.normal(size=(5, 6)), F32) * F32(0.5),
            "v": jnp.asarray(RNG.normal(size=(6, 3)), F32) * F32(0.5)}


ADAM = optax.adam(1e-2)


def make(period=4):
    return jg.Optimizer(model, ADAM, loss="cross_entropy", period=period)


def same_bits(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(u).dtype == np.asarray(v).dtype
        assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


def run(opt, state, steps):
    for i in steps:
        state, _ = opt.step(state, XS[i], YS[i])
    return state


@pytest.mark.parametrize("period", [1, 4])
def test_round_trip_is_bitwise(tmp_path, period):
    opt = make(period)
    p0 = params()
    state = run(opt, opt.init(p0, XS[0], YS[0]), range(3))
    opt.save(state, tmp_path / "s.jgs")
    back = opt.load(tmp_path / "s.jgs")
    same_bits(back, state)
    assert isinstance(back.counter, np.int32) and int(back.counter) == 3 % period


def test_resume_mid_period_is_bitwise_identical(tmp_path):
    p0 = params()
    first = make()
    want = run(first, first.init(p0, XS[0], YS[0]), range(10))
    state = run(first, first.init(p0, XS[0], YS[0]), range(6))  # stopped at micro-step 2 of 4
    ds = jg.Dataset(np.arange(20)).shuffle(jax.random.PRNGKey(3))
    first.save(state, tmp_path / "ckpt", dataset=ds)
    del first, state

    second = make()  # a fresh context, as in a new process
    second.init(params(), XS[0], YS[0])  # other params: load must replace them all
    ds2 = jg.Dataset(np.arange(20))
    state = second.load(tmp_path / "ckpt", dataset=ds2)
    assert int(state.counter) == 2
    np.testing.assert_array_equal(ds2.permutation, ds.permutation)
    same_bits(run(second, state, range(6, 10)), want)


def _saved(tmp_path):
    opt = make()
    state = run(opt, opt.init(params(), XS[0], YS[0]), range(2))
    path = tmp_path / "state"
    opt.save(state, path)
    return opt, state, path


def test_truncated_or_altered_files_raise_and_change_nothing(tmp_path):
    opt, state, path = _saved(tmp_path)
    blob = path.read_bytes()
    ds = jg.Dataset(np.arange(20))
    before = ds.permutation.copy()
    for bad in (blob[:-1], blob[: len(blob) // 2], blob[:5]):
        path.write_bytes(bad)
        with pytest.raises(StateFileError, match="truncated|too short"):
            opt.load(path, dataset=ds)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(StateFileError, match="checksum"):
        opt.load(path, dataset=ds)
    np.testing.assert_array_equal(ds.permutation, before)
    path.write_bytes(blob)
    same_bits(opt.load(path), state)


def test_other_versions_and_other_states_are_refused(tmp_path):
    import hashlib

    opt, _, path = _saved(tmp_path)
    body = bytearray(path.read_bytes()[:-32])
    struct.pack_into("<I", body, len(MAGIC), 99)
    path.write_bytes(bytes(body) + hashlib.sha256(bytes(body)).digest())
    with pytest.raises(StateFileError, match="version 99"):
        opt.load(path)
    _, _, path = _saved(tmp_path)
    other = jg.Optimizer(model, optax.sgd(0.1), loss="cross_entropy", period=4)
    other.init(params(), XS[0], YS[0])
    with pytest.raises(StateFileError, match="written by another training setup"):
        other.load(path)
    with pytest.raises(StateFileError, match="lacks leaves"):  # no transfer without the shapes
        other.load(path, strict=False)
    with pytest.raises(StateFileError, match="cannot read"):
        opt.load(tmp_path / "missing")


def test_write_is_atomic(tmp_path, monkeypatch):
    opt, state, path = _saved(tmp_path)
    blob = path.read_bytes()
    newer = run(opt, state, range(2, 3))

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        opt.save(newer, path)
    assert path.read_bytes() == blob  # the old file is intact
    assert os.listdir(tmp_path) == ["state"]  # and no temporary file is left


# -- hostile files: every field validated, nothing allocated or executed from a file ------------
def craft(path, header, payload: bytes, hlen=None, version=FORMAT_VERSION):
    """A state file with this header (dict or raw bytes) and payload, and a valid checksum."""
    import hashlib
    import json

    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = MAGIC + struct.pack("<IQ", version, len(raw) if hlen is None else hlen) + raw + payload
    path.write_bytes(body + hashlib.sha256(body).digest())


def parts(path):
    """(header, payload) of a valid file."""
    import json

    blob = path.read_bytes()
    fixed = len(MAGIC) + 12
    (hlen,) = struct.unpack_from("<Q", blob, len(MAGIC) + 4)
    return json.loads(blob[fixed:fixed + hlen]), blob[fixed + hlen:-32]  # no "version" key


def leaf(header, name):
    return next(e for e in header["leaves"] if e["path"] == name)


def with_leaf(name, **changes):
    def mutate(header, payload):
        leaf(header, name).update(changes)
        return header, payload
    return mutate


def with_counter(value):
    def mutate(header, payload):
        e = leaf(header, ".counter")
        payload = bytearray(payload)
        struct.pack_into("<i", payload, e["offset"], value)
        return header, bytes(payload)
    return mutate


def with_order(order):
    def mutate(header, payload):
        e = leaf(header, "dataset")
        payload = bytearray(payload)
        payload[e["offset"]:e["offset"] + e["nbytes"]] = np.asarray(order, np.int64).tobytes()
        return header, bytes(payload)
    return mutate


def without_dtype(header, payload):
    del leaf(header, W)["dtype"]
    return header, payload


def repeated_path(header, payload):
    header["leaves"][1]["path"] = header["leaves"][0]["path"]
    return header, payload


def raw(header_bytes, hlen=None):
    return lambda header, payload: (header_bytes, payload, hlen)


W = ".params['w']"
HOSTILE = [  # (what, mutation of (header, payload), message pattern)
    ("deep JSON", raw(b"[" * 100_000 + b"]" * 100_000), "unreadable header: RecursionError"),
    ("header not UTF-8", raw(b"\xff\xfe{}"), "unreadable header"),
    ("header not an object", raw(b"[1, 2]"), "must be an object with a list `leaves`"),
    ("hlen beyond the file", raw(b"{}", hlen=2**60), "field hlen"),
    ("unknown header field", lambda h, p: ({**h, "exec": "rm -rf"}, p), "unknown fields"),
    ("meta not an object", lambda h, p: ({**h, "meta": [1]}, p), "`meta` must be an object"),
    ("leaf not an object", lambda h, p: ({**h, "leaves": [1] + h["leaves"]}, p),
     r"leaves\[0\] must be an object"),
    ("leaf without dtype", lambda h, p: without_dtype(h, p), r"\.dtype must be a str"),
    ("unknown leaf key", with_leaf(W, code="print(1)"), "unknown keys"),
    ("negative dimension", with_leaf(W, shape=[-5, 6]), "non-negative ints"),
    ("bool dimension", with_leaf(W, shape=[True, 6]), "non-negative ints"),
    ("string dimension", with_leaf(W, shape="5,6"), r"\.shape must be a list"),
    ("rank 65", with_leaf(W, shape=[1] * 65), "at most 64"),
    ("absurd shape", with_leaf(W, shape=[2**40, 2**40]), r"nbytes .* but float32"),
    ("absurd shape and size", with_leaf(W, shape=[2**40], nbytes=2**42), "beyond the"),
    ("object dtype", with_leaf(W, dtype="object"), "not one of"),
    ("structured dtype", with_leaf(W, dtype="V8"), "not one of"),
    ("string dtype", with_leaf(W, dtype="<U4"), "not one of"),
    ("offset out of order", with_leaf(W, offset=3), r"\.offset .* expected"),
    ("float offset", with_leaf(W, offset=0.0), r"\.offset must be a int"),
    ("bogus key impl", with_leaf(W, key_impl="evil"), "key_impl"),
    ("trailing payload", lambda h, p: (h, p + b"\0" * 8), "the payload has"),
    ("repeated path", lambda h, p: repeated_path(h, p), "repeated"),
    ("period-4 file in a period-2 Optimizer", None, "field meta.period is 4, this Optimizer has 2"),
    ("mse file in a cross_entropy Optimizer", None, "field meta.loss is 'mse'"),
    ("negative counter", with_counter(-1), r"field counter is -1, outside \[0, 4\)"),
    ("counter beyond the period", with_counter(4), "field counter is 4"),
    ("order not a permutation", with_order([0] * 20), "must be a permutation of the 20 shards"),
    ("order out of range", with_order(list(range(1, 21))), "must be a permutation"),
    ("order of another dataset", "other dataset", "must be a permutation of the 30 shards"),
]


def probe_file(tmp_path, what, mutate, pattern):
    import re

    opt = make(4)
    state = run(opt, opt.init(params(), XS[0], YS[0]), range(1))
    ds = jg.Dataset(np.arange(20)).shuffle(jax.random.PRNGKey(1))
    path = tmp_path / f"{abs(hash(what))}.jgs"
    before = ds.permutation.copy()
    if mutate is None and "period" in what:
        opt.save(state, path, dataset=ds)
        opt = make(2)
        opt.init(params(), XS[0], YS[0])
    elif mutate is None:
        other = jg.Optimizer(model, ADAM, loss="mse", period=4)
        other.save(run(other, other.init(params(), XS[0], np.eye(3, dtype=np.float32)[YS[0]]),
                       ()), path, dataset=ds)
    elif mutate == "other dataset":
        opt.save(state, path, dataset=ds)
        ds = jg.Dataset(np.arange(30))
        before = ds.permutation.copy()
    else:
        opt.save(state, path, dataset=ds)
        changed = mutate(*parts(path))
        craft(path, *changed)
    try:
        opt.load(path, dataset=ds)
    except StateFileError as e:
        if not np.array_equal(ds.permutation, before):
            return "lost: the dataset order changed"
        return "clear" if re.search(pattern, str(e)) else f"unclear: {e}"
    except Exception as e:  # noqa: BLE001 - classifying is the point
        return f"unclear: {type(e).__name__}: {str(e)[:200]}"
    return "silent"


def test_hostile_files_raise_state_file_errors_naming_the_field(tmp_path):
    outcomes = {what: probe_file(tmp_path, what, m, p) for what, m, p in HOSTILE}
    tally = {k: sum(o.split(":")[0] == k for o in outcomes.values())
             for k in ("clear", "unclear", "silent", "lost")}
    print(f"\nstate files: {len(HOSTILE)} probes, {tally}")
    bad = {what: o for what, o in outcomes.items() if o != "clear"}
    assert not bad, bad


def test_booleans_must_be_0_or_1(tmp_path):
    from jgraph.training.state_io import read_state_file, save_state

    path = tmp_path / "b.jgs"
    save_state(path, {"mask": np.array([True, False, True])})
    header, payload = parts(path)
    craft(path, header, b"\x01\x02\x01")
    with pytest.raises(StateFileError, match="bytes other than 0 and 1"):
        read_state_file(path)


class _Payload:
    """Unpickling this would create a marker file: proof that something ran code from a file."""

    marker = None

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_no_code_runs_from_a_file(tmp_path, monkeypatch):
    import pickle

    _, _, path = _saved(tmp_path)
    _Payload.marker = tmp_path / "pwned"
    evil = pickle.dumps(np.array([_Payload()], dtype=object))
    header, _ = parts(path)
    header["leaves"] = [{"path": ".params['w']", "shape": [1], "dtype": "object", "offset": 0,
                         "nbytes": len(evil)}]
    craft(path, header, evil)
    for name in ("load", "loads"):  # and nothing may even try
        monkeypatch.setattr(pickle, name, lambda *a, **k: pytest.fail("pickle was called"))
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("np.load was called"))
    opt = make()
    opt.init(params(), XS[0], YS[0])
    with pytest.raises(StateFileError, match="not one of"):
        opt.load(path)
    assert not _Payload.marker.exists()


def test_save_writes_only_what_load_accepts(tmp_path):
    from jgraph.training.state_io import save_state

    with pytest.raises(jg.JGraphError, match="dtype <U1 is not one of"):
        save_state(tmp_path / "s.jgs", {"name": np.array(["a"])})
    with pytest.raises(jg.JGraphError, match="dtype object is not one of"):
        save_state(tmp_path / "s.jgs", {"f": lambda: 0})
    assert list(tmp_path.iterdir()) == []


def test_stale_temporaries_removed_are_only_our_own_dead_ones(tmp_path):
    from jgraph.training.state_io import save_state

    dead = subprocess_pid()
    ours = [f".state.{dead}-0123abcd.tmp"]
    kept = [f".state.{os.getpid()}-0123abcd.tmp",  # a live process (this one)
            f".other.{dead}-0123abcd.tmp",  # another target
            f".state.{dead}-0123abcd.tmp.bak", "state.tmp", ".state.x-0123abcd.tmp"]
    for name in ours + kept:
        (tmp_path / name).write_bytes(b"partial")
    save_state(tmp_path / "state", {"w": np.zeros(3, np.float32)})
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["state"])


def subprocess_pid() -> int:
    """The pid of a process that has exited."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("period", [1, 2])
def test_typed_prng_keys_in_params_and_inputs(tmp_path, period):
    """Keys (what flax.nnx.Rngs holds) are carried unchanged, saved, reloaded and resumed."""
    def noisy(p, inputs):
        x, key = inputs
        return model(p, x) + 0.01 * jax.random.normal(jax.random.fold_in(p["rng"], 1),
                                                      (x.shape[0], 3)) \
            + 0.01 * jax.random.normal(key, (x.shape[0], 3))

    p0 = {**params(), "rng": jax.random.key(7)}
    opt = jg.Optimizer(noisy, ADAM, loss="cross_entropy", period=period)
    state = opt.init(p0, (XS[0], jax.random.key(0)), YS[0])
    for i in range(3):
        state, out = opt.step(state, (XS[i], jax.random.key(i)), YS[i])
    assert np.isfinite(out.loss) and state.opt_state[0].mu["rng"] is None  # not trained
    assert jax.random.key_data(state.params["rng"]).tolist() == \
        jax.random.key_data(jax.random.key(7)).tolist()
    opt.save(state, tmp_path / "k.jgs")
    back = opt.load(tmp_path / "k.jgs")
    assert back.params["rng"].dtype == state.params["rng"].dtype
    same_bits(jax.tree.map(lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(
        a.dtype, jax.dtypes.prng_key) else a, back), jax.tree.map(
        lambda a: jax.random.key_data(a) if jax.dtypes.issubdtype(
            a.dtype, jax.dtypes.prng_key) else a, state))
    if period == 1:  # the trainable params follow a plain optax loop over the same loss
        def loss(trainable, x, key, y):
            logits = noisy({**trainable, "rng": p0["rng"]}, (x, key))
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        ref = {k: v for k, v in p0.items() if k != "rng"}
        opt_state = ADAM.init(ref)
        grad, update = jax.jit(jax.grad(loss)), jax.jit(ADAM.update)
        for i in range(3):
            grads = grad(ref, XS[i], jax.random.key(i), YS[i])
            updates, opt_state = update(grads, opt_state, ref)
            ref = optax.apply_updates(ref, updates)
        for k in ref:
            np.testing.assert_allclose(state.params[k], ref[k], rtol=2e-5, atol=1e-6)
