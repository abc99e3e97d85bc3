"""Training on a `jax.sharding.Mesh`: data parallel, FSDP-style params, one and many processes.

JAX fixes its device count at start, so the checks on 2, 4 and 8 devices run in children started
with forced host devices (`sharding_children.py`): one child runs the whole suite (meshes of 1, 2,
4 and 8 of its 8 devices) and reports figures that the tests below assert; two more are the two
processes of a `jax.distributed` run on the loopback address. No child can hang the suite, and
none is timed: every line a child prints is progress, its own watchdog ends it after
`CHILD_STALL` seconds without any, and the parent kills it after `PARENT_STALL` (`watch`), so a
loaded machine makes the run slower, never red. References: the same training without a mesh
(one device), which runs here, in the test process. `-m slow` adds the full matrix (remat x FSDP
x devices x period).
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jgraph as jg
from jgraph.training.state_io import read_state_file
from tests.sharding_models import BATCH, P0, TX, X, Y, model, train

HERE = Path(__file__).parent
ROOT = HERE.parent
RTOL = 1e-6


CHILD_STALL = 540  # seconds without a line of progress before a child dumps its stack and ends
PARENT_STALL = CHILD_STALL + 120  # ... and before the parent kills it (the child speaks first)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
            "JAX_PLATFORMS": "cpu", "JGRAPH_CHILD_STALL": str(CHILD_STALL)}


def watch(procs, stall: float, what: str) -> list[tuple[str, str]]:
    """`(stdout, stderr)` of each process once all have ended. Their output is read as it comes;
    they are killed (and the test fails) only when none has printed a line for `stall` seconds:
    hang protection, not a time limit."""
    last = [time.monotonic()]
    outputs = [([], []) for _ in procs]

    def read(stream, lines):
        for line in stream:
            lines.append(line)
            last[0] = time.monotonic()

    readers = [threading.Thread(target=read, args=(stream, lines), daemon=True)
               for proc, pair in zip(procs, outputs, strict=True)
               for stream, lines in zip((proc.stdout, proc.stderr), pair, strict=True)]
    for reader in readers:
        reader.start()
    try:
        while any(proc.poll() is None for proc in procs):
            if time.monotonic() - last[0] > stall:
                tail = "".join(outputs[0][1])[-3000:]
                pytest.fail(f"{what} printed nothing for {stall:.0f} s (hung); its last "
                            f"stderr:\n{tail}")
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for reader in readers:
            reader.join(timeout=10)
    return [("".join(out), "".join(err)) for out, err in outputs]


def spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "sharding_children.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=ROOT)


def reports(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def run_child(mode: str) -> dict:
    """Run `sharding_children.py mode`; its reports by name."""
    proc = spawn(mode)
    ((out, err),) = watch([proc], PARENT_STALL, f"sharding child {mode!r}")
    assert proc.returncode == 0, f"sharding child {mode!r} failed:\n{err[-4000:]}"
    return {r.pop("name"): r for r in reports(out)}


def test_watch_stops_a_silent_child_not_a_slow_one():
    """Progress, not speed: a child that talks every 0.4 s runs past the 2.5 s stall limit; a
    silent one is killed after it (and the test fails saying so)."""
    talk = "import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(0.4)"
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen([sys.executable, "-c", talk], **pipes)
    ((out, _),) = watch([proc], 2.5, "a talking child")
    assert out.split() == [str(i) for i in range(8)] and proc.returncode == 0
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], **pipes)
    with pytest.raises(pytest.fail.Exception, match="a silent child printed nothing for 1 s"):
        watch([silent], 1.0, "a silent child")
    assert silent.returncode is not None  # killed, not left behind


@pytest.fixture(scope="module")
def suite():
    return run_child("suite")


def one_device_mesh():
    return Mesh(np.array(jax.devices()[:1]), ("data",))


# -- in this process (one device) ----------------------------------------------------------------
def constrained_loss(mesh):
    def loss(p, x):
        h = jnp.tanh(x @ p["w"] + p["b"])
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None)))
        return jnp.mean(h @ p["v"])
    return loss


def test_sharding_constraint_is_an_op_with_a_vjp():
    loss = constrained_loss(one_device_mesh())
    g = jg.trace(loss, P0, X[:BATCH], param_argnums=0)
    assert [e.op for e in g.eqns].count("sharding_constraint") == 1
    assert "sharding_constraint[sharding=NamedSharding" in str(g)
    gb = jg.backward(g)
    jg.check(gb)
    # the cotangent is constrained as the value was (JAX's transpose of the constraint)
    assert [e.op for e in gb.eqns].count("sharding_constraint") == 2
    value, grads = jg.compile(gb)(P0, X[:BATCH])
    ref_value, ref_grads = jax.value_and_grad(loss)(P0, X[:BATCH])
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_compile_passes_shardings_to_jit():
    mesh = one_device_mesh()
    loss = constrained_loss(mesh)
    gb = jg.backward(jg.trace(loss, P0, X[:BATCH], param_argnums=0))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    f = jg.compile(gb, in_shardings=(rep, rows), out_shardings=(rep, rep), donate_argnums=())
    value, grads = f(P0, X[:BATCH])
    assert value.sharding == rep and all(a.sharding == rep for a in jax.tree.leaves(grads))
    plain = jg.compile(gb)(P0, X[:BATCH])
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves((value, grads)),
                                                    jax.tree.leaves(plain), strict=True))
    text = f.lower(P0, X[:BATCH]).as_text()
    assert "sharding" in text
    donated = jg.compile(gb, donate_argnums=(0,))
    params = jax.tree.map(jnp.array, P0)
    donated(params, X[:BATCH])
    assert all(a.is_deleted() for a in jax.tree.leaves(params))


@pytest.mark.parametrize("period", [1, 4])
def test_one_device_mesh_equals_no_mesh(period):
    ref, ref_losses = train(jg.Optimizer(model, TX, loss="cross_entropy", period=period), 8)
    opt = jg.Optimizer(model, TX, loss="cross_entropy", period=period, mesh=one_device_mesh())
    state, losses = train(opt, 8)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref.params), strict=True):
        if period == 1:  # the same program: bitwise
            assert np.array_equal(a, b)
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)


def test_state_file_is_the_same_with_and_without_a_mesh(tmp_path):
    files = {}
    for name, mesh in (("none", None), ("mesh", one_device_mesh())):
        opt = jg.Optimizer(model, TX, loss="cross_entropy", period=4, mesh=mesh)
        state, _ = train(opt, 2)
        assert np.shape(state.grad_acc["w"]) == ((1, 5, 16) if mesh else (5, 16))
        opt.save(state, tmp_path / name)
        header, arrays = read_state_file(tmp_path / name)
        files[name] = {k: (v.shape, str(v.dtype)) for k, v in arrays.items()}
        np.testing.assert_allclose(arrays[".grad_acc['w']"], np.asarray(opt.grad_acc(state)["w"]))
    assert files["none"] == files["mesh"]


def test_mesh_arguments_are_checked():
    mesh = one_device_mesh()
    with pytest.raises(jg.JGraphError, match="param_sharding needs a mesh"):
        jg.Optimizer(model, TX, param_sharding={"w": P("data")})
    with pytest.raises(jg.JGraphError, match="data_axis 'batch' is not an axis"):
        jg.Optimizer(model, TX, mesh=mesh, data_axis="batch")
    with pytest.raises(jg.JGraphError, match="must be a jax.sharding.Mesh"):
        jg.Optimizer(model, TX, mesh="data")
    bad = [({"w": P("model"), "b": None, "v": None}, r"params\['w'\].*'model', not an axis"),
           ({"w": "data", "b": None, "v": None}, r"params\['w'\]: expected a PartitionSpec"),
           ({"w": P(None, None, "data"), "b": None, "v": None}, "more entries than"),
           ({"w": P()}, "must be shaped like the params")]
    for spec, message in bad:
        opt = jg.Optimizer(model, TX, loss="cross_entropy", mesh=mesh, param_sharding=spec)
        with pytest.raises(jg.JGraphError, match=message):
            opt.init(P0, X[:BATCH], Y[:BATCH])
    opt = jg.Optimizer(model, TX, loss="cross_entropy", mesh=mesh)
    with pytest.raises(jg.JGraphError, match="same leading batch axis"):
        opt.init(P0, (X[:BATCH], X[:4]), Y[:BATCH])
    other = Mesh(np.array(jax.devices()[:1]), ("batch",))
    with pytest.raises(jg.JGraphError, match="differ from the dataset's"):
        jg.fit(model, P0, jg.Dataset(X, Y, mesh=mesh), mesh=other, data_axis="batch",
               loss="cross_entropy", progress=False)


# -- many devices, in a child process ------------------------------------------------------------
@pytest.mark.extended
def test_params_equal_the_single_device_run(suite):
    """8 optimizer steps on 1, 2, 4 and 8 devices, period 1 and 4, with remat and with FSDP."""
    equal = {name: r for name, r in suite.items() if name.startswith("equal")}
    assert {int(name.split()[1][2:]) for name in equal} == {1, 2, 4, 8}
    assert any("remat=True" in n for n in equal) and any("fsdp=True" in n for n in equal)
    assert "equal k=4 period=4 remat=budget fsdp=False" in equal
    for name, r in equal.items():
        assert r["rel"] <= RTOL, (name, r)
        assert r["specs_kept"], name  # params keep their sharding through every step


@pytest.mark.extended
def test_jg_jit_takes_shardings_as_jax_jit_does(suite):
    """`jg.jit(in_shardings=, out_shardings=)` on 4 devices: a prefix of the arguments (the
    static one left out) and of the result, replicated or FSDP params, a batch split on the
    data axis; the params trained as `jax.jit`'s step trains them, their shardings kept."""
    for name in ("replicated", "fsdp"):
        r = suite[f"jit shardings {name}"]
        assert r["rel"] <= RTOL and r["specs_kept"] and r["loss_spec"] == "P()", r


@pytest.mark.extended
def test_gradients_cross_devices_once_per_period(suite):
    """Compiled HLO: with period 4 the grad executable has no collective; the opt executable
    reduces the accumulated gradients once (XLA combines the leaves into one all-reduce)."""
    none = dict.fromkeys(("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                          "collective-permute"), 0)
    for k in (4, 8):
        r = suite[f"hlo k={k} period=4 fsdp=False mode=ignore"]
        assert r["grad"] == none, r
        assert r["opt"] == {**none, "all-reduce": 1}, r
    # period 1: the gradients are reduced in the one step (and the loss, predictions too)
    assert suite["hlo k=4 period=1 fsdp=False mode=ignore"]["opt"]["all-reduce"] >= 1
    # on_nonfinite="raise": each micro-step agrees on one finite flag (one all-reduce of a bool)
    r = suite["hlo k=4 period=4 fsdp=False mode=raise"]
    assert r["grad"] == {**none, "all-reduce": 1}, r
    # FSDP: micro-steps gather params; the opt step also reduces the gradients
    r = suite["hlo k=8 period=4 fsdp=True mode=ignore"]
    assert r["grad"]["all-gather"] >= 1 and r["opt"]["all-reduce"] > r["grad"]["all-reduce"]


@pytest.mark.extended
def test_sharding_constraint_in_the_model(suite):
    for period in (1, 4):
        r = suite[f"constraint period={period}"]
        assert r["rel"] <= RTOL, r
        assert r["forward"] == ["P('data', None)"]
    # period 1: the whole micro-batch (constraint and its cotangent kept); period 4: one data
    # shard's program, whose constraints drop the data axis (vmap's spmd_axis_name adds it back)
    assert suite["constraint period=1"]["grad"] == ["P('data', None)"] * 2
    assert suite["constraint period=4"]["grad"] == ["P(None, None)"] * 2


@pytest.mark.extended
def test_state_files_move_between_meshes(suite):
    """Saved on 4 devices at a period boundary (micro-step 8) and mid-period (micro-step 6);
    resumed on 4, 2, 8 devices and on none; compared with the uninterrupted 4-device run."""
    assert suite["resume at=8 k=4"]["bitwise"]
    for name, r in suite.items():
        if name.startswith("resume"):
            assert r["rel"] <= RTOL, (name, r)
    assert suite["grad_acc mid-period"]["rel"] <= RTOL


@pytest.mark.extended
def test_fit_and_dataset_on_a_mesh(suite):
    for name in ("fit dataset mesh", "fit mesh argument"):
        assert suite[name]["rel"] <= RTOL, suite[name]
    mesh_run, ref = suite["fit dataset mesh"]["loss"]
    np.testing.assert_allclose(mesh_run, ref, rtol=RTOL)
    np.testing.assert_allclose(*suite["fit dataset mesh"]["val"], rtol=RTOL)


@pytest.mark.extended
def test_fit_checkpoints_resume_on_a_mesh(suite):
    r = suite["fit resume k=4"]
    assert r["bitwise"] and r["epochs"] == 2, r
    assert suite["fit resume k=2"]["rel"] <= RTOL


@pytest.mark.extended
def test_prng_keys_in_params_on_a_mesh(suite):
    assert suite["keys period=1"]["rel"] <= RTOL  # the whole micro-batch: one device's draws
    for period in (1, 4):
        assert suite[f"keys period={period}"]["key_kept"]
    # period 4: each shard draws its own mask (the key folded with the shard index)
    sums = suite["keys per shard"]["sums"]
    assert len(sums) == 4 and len(set(sums)) == 4, sums


@pytest.mark.extended
def test_step_period_and_nonfinite_on_a_mesh(suite):
    assert suite["step_period"]["rel"] <= RTOL
    assert suite["nonfinite raise"]["raised_and_kept"]
    assert suite["nonfinite skip"] == {"kept": True, "finite": False}


@pytest.mark.extended
def test_errors_on_a_mesh(suite):
    errors = suite["errors"]
    expected = {"dataset batch": "batch size 6 is not divisible by the 4 devices",
                "fit batch": "physical_batch_size 6 is not divisible by the 4 devices",
                "step batch": "batch of 6 is not divisible by the 4 devices",
                "spec divisible": "axis of size 3 is not divisible by the 8 devices",
                "spec axis": "names 'model', not an axis of the mesh",
                "data axis": "data_axis 'batch' is not an axis of the mesh",
                "explicit mesh": "are Explicit"}
    for name, text in expected.items():
        assert errors[name] is not None and text in errors[name], (name, errors[name])


@pytest.mark.slow
def test_full_matrix_equals_the_single_device_run():
    found = run_child("suite-slow")
    assert len(found) == 2 * 4 * 4
    for name, r in found.items():
        assert r["rel"] <= RTOL and r["specs_kept"], (name, r)


# -- two processes on the loopback address ---------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.extended
def test_two_processes_equal_the_single_process_run(tmp_path):
    """`jax.distributed` with 2 processes x 2 host devices (gloo collectives): their run, saved by
    `Optimizer.save` (gathered, written by process 0), equals the run without a mesh here."""
    port = free_port()
    procs = [spawn("worker", i, 2, port, tmp_path) for i in range(2)]
    outputs = watch(procs, PARENT_STALL, "the distributed run")
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-4000:]
        found = reports(out)
        assert found[0]["devices"] == 4 and found[0]["local"] == 2, found
    for period in (1, 4):
        ref_opt = jg.Optimizer(model, TX, loss="cross_entropy", period=period, remat=True)
        ref, ref_losses = train(ref_opt, 8 * period)
        _, arrays = read_state_file(tmp_path / f"period{period}.jgs")
        for name, leaf in jax.tree_util.tree_flatten_with_path(ref.params)[0]:
            key = ".params" + jax.tree_util.keystr(name)
            np.testing.assert_allclose(arrays[key], leaf, rtol=RTOL, atol=1e-7, err_msg=key)
        losses = json.loads((tmp_path / f"period{period}.json").read_text())
        np.testing.assert_allclose(losses, np.asarray(ref_losses) * period,
                                   rtol=RTOL)
