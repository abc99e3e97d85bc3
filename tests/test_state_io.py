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
from jgraph.training.state_io import MAGIC

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
    with pytest.raises(StateFileError, match="expected"):
        other.load(path)
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
