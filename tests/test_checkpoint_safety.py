"""`fit(checkpoint_path=...)` never trains into a checkpoint it cannot write (issue 19, item 5).

The path is probed before the first step (a real file created and removed in its folder), and a
write that fails later raises `CheckpointError` with the trained state, params and history
attached, as a Ctrl-C does. Tests run as root on some machines, where a read-only folder is still
writable: unwritable folders are simulated by making `os.open` refuse, as the kernel would.
"""

import errno
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg
from jgraph.training import CheckpointError, Optimizer

RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 5)).astype(np.float32)
Y = RNG.integers(0, 3, 32).astype(np.int32)
P0 = {"w": (RNG.normal(size=(5, 6)) * 0.5).astype(np.float32),
      "v": (RNG.normal(size=(6, 3)) * 0.5).astype(np.float32)}
KW = dict(loss="cross_entropy", tx=optax.adam(1e-2), epochs=2, batch_size=8, progress=False,
          key=jax.random.PRNGKey(1))


def model(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


@pytest.fixture
def no_step(monkeypatch):
    """Fail the test if any training step runs (the path must be refused before)."""
    monkeypatch.setattr(Optimizer, "step", lambda *a, **k: pytest.fail("a step ran"))


def refuse_writes_in(monkeypatch, folder):
    """`os.open` of a new file in `folder` fails with EACCES (a read-only folder, even for root)."""
    real = os.open

    def guarded(path, flags, *args, **kw):
        if os.path.dirname(os.fspath(path)) == os.fspath(folder) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", guarded)


def test_unwritable_paths_are_refused_before_the_first_step(tmp_path, monkeypatch, no_step):
    regular = tmp_path / "file.txt"
    regular.write_text("not a folder")
    folder = tmp_path / "folder"
    folder.mkdir()
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    refuse_writes_in(monkeypatch, readonly)
    cases = [(regular / "ckpt.jgs", "its folder .*file.txt' cannot be made"),
             (regular / "deeper" / "ckpt.jgs", "cannot be made"),
             (folder, "is a folder, not a file path"),
             (readonly / "ckpt.jgs", "no file can be created in .*readonly'.*Permission denied")]
    for path, pattern in cases:
        with pytest.raises(jg.JGraphError, match=pattern):
            jg.fit(model, P0, jg.Dataset(X, Y), checkpoint_path=path, **KW)
    assert sorted(os.listdir(readonly)) == [] and sorted(os.listdir(folder)) == []
    with pytest.raises(jg.JGraphError, match="checkpoint_path must be a str or a path"):
        jg.fit(model, P0, jg.Dataset(X, Y), checkpoint_path=3, **KW)


def test_a_missing_folder_is_made_and_the_probe_leaves_nothing(tmp_path):
    path = tmp_path / "a" / "b" / "ckpt.jgs"
    jg.fit(model, P0, jg.Dataset(X, Y), checkpoint_path=path, **KW)
    assert os.listdir(path.parent) == ["ckpt.jgs"]


def fail_replace_after(monkeypatch, n):
    """`os.replace` (the atomic rename of a save) works `n` times, then fails: a full disk."""
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) > n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    return calls


def test_a_failed_final_write_hands_over_the_trained_state(tmp_path, monkeypatch):
    ref_params, ref_history = jg.fit(model, P0, jg.Dataset(X, Y), **KW)
    path = tmp_path / "ckpt.jgs"
    fail_replace_after(monkeypatch, 0)
    with pytest.raises(CheckpointError, match="No space left on device") as e:
        jg.fit(model, P0, jg.Dataset(X, Y), checkpoint_path=path, **KW)
    err = e.value
    assert isinstance(err, OSError) and isinstance(err.__cause__, OSError)
    for a, b in zip(jax.tree.leaves(err.params), jax.tree.leaves(ref_params), strict=True):
        assert np.array_equal(a, b)  # bitwise the uninterrupted run's result
    assert err.history.train_loss == ref_history.train_loss and len(err.history.seconds) == 2
    assert err.history.state is err.state and err.state.params is err.params
    assert not path.exists() and os.listdir(tmp_path) == []
    monkeypatch.undo()
    err.history.optimizer.save(err.state, tmp_path / "elsewhere.jgs")  # as the message says
    back = err.history.optimizer.load(tmp_path / "elsewhere.jgs")
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(ref_params), strict=True):
        assert np.array_equal(a, b)


def test_a_failed_write_mid_run_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.jgs"
    calls = fail_replace_after(monkeypatch, 1)
    with pytest.raises(CheckpointError, match=r"in epoch 1 after 2 micro-steps") as e:
        jg.fit(model, P0, jg.Dataset(X, Y), checkpoint_path=path, checkpoint_every=1, **KW)
    assert len(calls) == 2
    err = e.value
    assert err.history.interrupted and not any(a.is_deleted() for a in jax.tree.leaves(
        err.state.params))
    assert err.state is err.history.optimizer.latest_state  # the state after the second step
    monkeypatch.undo()
    # the checkpoint of step 1 is intact, and resuming from it ends where an uninterrupted run
    # ends (bitwise)
    ref_params, _ = jg.fit(model, P0, jg.Dataset(X, Y), **KW)
    params, history = jg.fit(model, P0, jg.Dataset(X, Y), checkpoint_path=path, **KW)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        assert np.array_equal(a, b)
    assert os.listdir(tmp_path) == ["ckpt.jgs"]
