"""State files record what produced them; loading or resuming into another setup is refused.

Issue 19, item 2: a state of the right shapes written by another model (`tanh` vs `sin`, same
params) or another optimizer (adam vs adamax, same `ScaleByAdamState`) used to load, and `fit`
resumed it and overwrote the checkpoint. Now `Optimizer.load(strict=True)` and `fit`'s resume
compare the file's fingerprint and say what differs; `strict=False` transfers on purpose. Files of
the previous format version (no fingerprint) still load, with a warning.
"""

import functools
import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg
from jgraph.training import StateFileError, StateFileWarning
from jgraph.training.state_io import read_state_file, save_state

HERE = Path(__file__).parent
RNG = np.random.default_rng(0)
X = RNG.normal(size=(32, 5)).astype(np.float32)
Y = RNG.integers(0, 3, 32).astype(np.int32)
P0 = {"w": (RNG.normal(size=(5, 6)) * 0.5).astype(np.float32),
      "v": (RNG.normal(size=(6, 3)) * 0.5).astype(np.float32)}


def tanh_model(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


def sin_model(p, x):  # the same params, another function
    return jnp.sin(x @ p["w"]) @ p["v"]


def saved(tmp_path, fn=tanh_model, tx=None, period=1, steps=2):
    opt = jg.Optimizer(fn, tx or optax.adam(1e-2), loss="cross_entropy", period=period)
    state = opt.init(P0, X[:8], Y[:8])
    for i in range(steps):
        state, _ = opt.step(state, X[8 * i:8 * i + 8], Y[8 * i:8 * i + 8])
    path = tmp_path / "state.jgs"
    opt.save(state, path)
    return state, path


def loader(fn=tanh_model, tx=None, period=1, x=X[:8], y=Y[:8], **kw):
    opt = jg.Optimizer(fn, tx or optax.adam(1e-2), loss="cross_entropy", period=period, **kw)
    opt.init(P0, x, y)
    return opt


def same_bits(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


def test_a_file_of_another_model_is_refused_unless_not_strict(tmp_path):
    state, path = saved(tmp_path)
    opt = loader(sin_model)
    with pytest.raises(StateFileError, match="written by another training setup") as e:
        opt.load(path)
    message = str(e.value)
    assert "the forward graph differs: the file was written for a model computing tanh where " \
           "this Optimizer's computes sin" in message, message
    assert "optimizer" not in message.split("\n")[1:-1][0]  # only the model differs
    assert "strict=False" in message
    same_bits(opt.load(path, strict=False), state)  # a deliberate transfer
    same_bits(loader().load(path), state)  # the same setup loads, strict


def test_a_file_of_another_optimizer_with_the_same_state_structure_is_refused(tmp_path):
    state, path = saved(tmp_path)
    adamax = optax.adamax(1e-2)
    assert jax.tree.structure(adamax.init(P0)) == jax.tree.structure(optax.adam(1e-2).init(P0))
    with pytest.raises(StateFileError) as e:
        loader(tx=adamax).load(path)
    message = str(e.value)
    assert "optimizer: the file's is chain(scale_by_adam(b1=0.9, b2=0.999, eps=1e-08" in message
    assert "this Optimizer's is chain(scale_by_adamax(b1=0.9, b2=0.999, eps=1e-08)" in message
    assert "forward graph" not in message
    with pytest.raises(StateFileError, match=r"scale\(step_size=-0.01\).*scale\(step_size=-0.001"
                                             r"\)"):
        loader(tx=optax.adam(1e-3)).load(path)  # a hyperparameter
    with pytest.raises(StateFileError, match="optimizer state: the file's is ScaleByAdamState, "
                                             "EmptyState; this Optimizer's is TraceState"):
        loader(tx=optax.sgd(1e-2, momentum=0.9)).load(path)
    same_bits(loader(tx=adamax).load(path, strict=False), state)


def test_other_batch_shapes_loss_settings_and_constants_are_named(tmp_path):
    _, path = saved(tmp_path)
    with pytest.raises(StateFileError) as e:
        loader(x=X[:16], y=Y[:16]).load(path)
    assert "batch: the file's is inputs float32[8, 5]; labels int32[8], this Optimizer's is " \
           "inputs float32[16, 5]; labels int32[16]" in str(e.value)
    assert "forward graph" not in str(e.value)  # the batch line explains it
    with pytest.raises(StateFileError, match="static: the file's is True, this Optimizer's is "
                                             "False"):
        loader(static=False).load(path)
    with pytest.raises(StateFileError, match="this Optimizer's model also computes "
                                             "broadcast_in_dim, mul, which the file's did not"):
        loader(lambda p, x: tanh_model(p, x) * np.float32([1, 2, 3])).load(path)
    # a closed-over constant of the same shape: the same ops, another forward graph
    _, path = saved(tmp_path, lambda p, x: tanh_model(p, x) * np.float32([1, 2, 3]))
    with pytest.raises(StateFileError, match="the same ops, with other shapes, constants"):
        loader(lambda p, x: tanh_model(p, x) * np.float32([1, 2, 4])).load(path)
    loader(lambda p, x: tanh_model(p, x) * np.float32([1, 2, 3])).load(path)
    # remat and on_nonfinite change no state: a file moves between them
    _, path = saved(tmp_path)
    loader(remat=True, on_nonfinite="raise").load(path)


def test_fit_refuses_to_resume_another_setup_and_never_overwrites_the_checkpoint(tmp_path):
    path = tmp_path / "ckpt.jgs"
    kw = dict(loss="cross_entropy", epochs=1, batch_size=8, progress=False, checkpoint_path=path)
    params, history = jg.fit(tanh_model, P0, jg.Dataset(X, Y), tx=optax.adam(1e-2), **kw)
    blob = path.read_bytes()
    for fn, tx, pattern in ((sin_model, optax.adam(1e-2), "model computing tanh where this "
                                                          "Optimizer's computes sin"),
                            (tanh_model, optax.adamax(1e-2), "scale_by_adamax")):
        with pytest.raises(StateFileError, match=pattern):
            jg.fit(fn, P0, jg.Dataset(X, Y), tx=tx, **{**kw, "epochs": 2})
        assert path.read_bytes() == blob  # refused: left exactly as it was
    # strict=False resumes the file's state: with its one epoch done, nothing is left to train
    back, resumed = jg.fit(sin_model, P0, jg.Dataset(X, Y), tx=optax.adam(1e-2), strict=False,
                           **kw)
    same_bits(back, params)
    assert resumed.train_loss == history.train_loss
    with pytest.raises(jg.JGraphError, match="strict must be True or False"):
        jg.fit(tanh_model, P0, jg.Dataset(X, Y), strict="no", **kw)


def test_files_of_format_version_2_load_with_a_warning():
    """`data/state_v2.jgs` was written by jgraph before fingerprints (format version 2): the
    Optimizer below, `init` on batch 0, three steps, a dataset of 20 shuffled by PRNGKey(3)."""
    xs = np.linspace(-2, 2, 3 * 8 * 5, dtype=np.float32).reshape(3, 8, 5)
    ys = (np.arange(24) % 3).astype(np.int32).reshape(3, 8)
    p = {"w": np.linspace(-1, 1, 30, dtype=np.float32).reshape(5, 6),
         "v": np.linspace(1, -1, 18, dtype=np.float32).reshape(6, 3)}
    opt = jg.Optimizer(tanh_model, optax.adam(1e-2), loss="cross_entropy", period=2)
    state = opt.init(p, xs[0], ys[0])
    for i in range(3):
        state, _ = opt.step(state, xs[i], ys[i])
    ds = jg.Dataset(np.arange(20))
    path = HERE / "data" / "state_v2.jgs"
    assert read_state_file(path)[0]["version"] == 2
    with pytest.warns(StateFileWarning, match="format version 2, which records no fingerprint"):
        back, extra = opt.load(path, dataset=ds, extra=True)
    assert extra == {"note": "written by jgraph 0.1.0, format version 2"}
    np.testing.assert_array_equal(ds.permutation, jg.Dataset(np.arange(20)).shuffle(
        jax.random.PRNGKey(3)).permutation)
    assert int(back.counter) == 1
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_file_without_a_fingerprint_needs_strict_false(tmp_path):
    state, path = saved(tmp_path)
    header, arrays = read_state_file(path)
    assert header["version"] == 3 and "fingerprint" in header["meta"]
    bare = tmp_path / "bare.jgs"
    meta = {k: v for k, v in header["meta"].items() if k != "fingerprint"}
    save_state(bare, state, meta=meta)  # not written by Optimizer.save
    opt = loader()
    with pytest.raises(StateFileError, match="meta.fingerprint is missing"):
        opt.load(bare)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a version-3 file warns of nothing
        same_bits(opt.load(bare, strict=False), state)
    with pytest.raises(jg.JGraphError, match="strict must be True or False"):
        opt.load(path, strict=None)


@pytest.mark.parametrize("fingerprint, pattern", [
    ("tanh", "fingerprint is of version None"),
    ({"version": 99}, "fingerprint is of version 99"),
    ({"version": 1, "model": {"sha256": "0", "ops": "tanh"}},
     "the file records no readable op counts"),
    ({"version": 1, "model": [], "optimizer": 7}, "optimizer: the file records no readable"),
])
def test_hostile_fingerprints_are_clear_errors(tmp_path, fingerprint, pattern):
    state, meta, opt = default_setup()
    path = tmp_path / "hostile.jgs"
    save_state(path, state, meta={**meta, "fingerprint": fingerprint})
    with pytest.raises(StateFileError, match=pattern):
        opt.load(path)


@functools.cache
def default_setup():
    """A saved state's leaves and meta, and an Optimizer of the same setup (built once)."""
    with tempfile.TemporaryDirectory() as folder:
        state, path = saved(Path(folder))
        header, _ = read_state_file(path)
    return jax.tree.map(np.asarray, state), header["meta"], loader()


def test_the_description_shows_hyperparameters_and_schedules():
    from jgraph.training.fingerprint import describe

    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(optax.cosine_decay_schedule(1e-3, 100), weight_decay=0.1))
    text = describe(tx)
    for part in ("clip_by_global_norm(max_norm=1.0)", "scale_by_adam(b1=0.9", "weight_decay=0.1",
                 "cosine_decay_schedule(", "decay_steps=100", "init_value=0.001"):
        assert part in text, text
    assert describe(tx) == text and " at 0x" not in text
    assert describe(optax.MultiSteps(optax.sgd(0.1), 4)).startswith("MultiSteps(")
    # inject_hyperparams keeps its numbers in the state; its init closure shows where they start
    injected = describe(optax.inject_hyperparams(optax.adam)(learning_rate=1e-3))
    assert "'learning_rate': 0.001" in injected, injected
    cyclic = [optax.sgd(0.1)]
    cyclic.append(cyclic)
    assert describe(cyclic) == "(chain(identity(), scale(step_size=-0.1)), ...)"


CHILD = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
import jgraph as jg
sys.path.insert(0, {here!r})
from test_state_fingerprints import X, Y, P0, setups
out = []
for fn, tx in setups():
    opt = jg.Optimizer(fn, tx, loss="cross_entropy")
    opt.init(P0, X[:8], Y[:8])
    out.append(opt.fingerprint())
print(json.dumps(out))
"""


def relu_scan_model(p, x):  # a custom_jvp (relu), a scan and a closed-over constant
    shift = jnp.asarray(np.linspace(-0.1, 0.1, 6, dtype=np.float32))
    h, _ = jax.lax.scan(lambda h, _: (jax.nn.relu(h) + shift, None), x @ p["w"], None, length=2)
    return jax.nn.gelu(h) @ p["v"]


def setups():
    return [(tanh_model, optax.adam(1e-2)),
            (relu_scan_model, optax.chain(optax.clip_by_global_norm(1.0),
                                          optax.adamw(optax.cosine_decay_schedule(1e-3, 100))))]


def test_fingerprints_are_the_same_in_another_process():
    """A resume happens in a new process: nothing in a fingerprint may depend on this one
    (memory addresses, hash seeds, the order objects were made in)."""
    here = []
    for fn, tx in setups():
        opt = jg.Optimizer(fn, tx, loss="cross_entropy")
        opt.init(P0, X[:8], Y[:8])
        here.append(opt.fingerprint())
    proc = subprocess.run([sys.executable, "-c", CHILD.format(here=str(HERE))],
                          capture_output=True, text=True, cwd=HERE.parent, timeout=600,
                          env={"JAX_PLATFORMS": "cpu", "PYTHONHASHSEED": "123",
                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    there = json.loads(proc.stdout.strip().splitlines()[-1])
    assert there == json.loads(json.dumps(here))
    assert here[0]["model"]["sha256"] != here[1]["model"]["sha256"]


def test_a_state_moves_between_a_mesh_and_none(tmp_path):
    """A mesh puts shardings into the traced graph (the one-hot's iota of a sharded batch); the
    fingerprint leaves placement out, as state files move between meshes of any size."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x0, y0 = jg.Dataset(X, Y, mesh=mesh).batch(0, 8)
    opt = jg.Optimizer(tanh_model, optax.adam(1e-2), loss="cross_entropy", mesh=mesh)
    state = opt.init(P0, x0, y0)
    assert "sharding=NamedSharding(mesh=" in str(opt.graphs["forward"])
    opt.save(state, tmp_path / "mesh.jgs")
    same_bits(loader().load(tmp_path / "mesh.jgs"), state)  # strict, on no mesh
