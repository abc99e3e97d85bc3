"""Child processes for tests/test_sharding.py: `python sharding_children.py MODE ...`.

JAX fixes its device count when it starts, so every check on many devices runs here, in a
process started with `--xla_force_host_platform_device_count` (8 host devices: meshes of 1, 2, 4
and 8 of them). Each check prints one JSON line `{"name": ..., ...figures}`; the parent asserts.

MODE `suite` / `suite-slow`: the checks on one process (slow: the full matrix).
MODE `worker ID NPROC PORT OUT`: one of NPROC processes of a `jax.distributed` run on the
loopback address (2 host devices each, CPU collectives): trains on the global mesh and saves the
final states (process 0 writes them) to OUT.

Hang protection is not a speed test: every line a child prints is progress. The child's
watchdog (`faulthandler.dump_traceback_later(exit=True)`) is re-armed at every report and at the
start of every check (a `# check ...` line), so a child that hangs (a peer that died inside a
collective) dumps its stack and ends after JGRAPH_CHILD_STALL seconds without progress, however
long a loaded machine makes the whole run; the parent kills it only after a longer silence.
"""

import faulthandler
import json
import os
import sys

DEVICES = {"suite": 8, "suite-slow": 8, "worker": 2}[sys.argv[1]]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}")
os.environ["JAX_PLATFORMS"] = "cpu"
STALL = float(os.environ.get("JGRAPH_CHILD_STALL", "540"))  # seconds without progress


def progress(text: str) -> None:
    """A line of progress (ignored by the parent's parser), and the watchdog re-armed."""
    print(f"# {text}", flush=True)
    faulthandler.dump_traceback_later(STALL, exit=True)


faulthandler.dump_traceback_later(STALL, exit=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sharding_models import BATCH, FSDP, P0, TX, X, Y, layer, model, train  # noqa: E402

import jgraph as jg  # noqa: E402
from jgraph.training.mesh import count_collectives  # noqa: E402


def constrained(mesh):
    """`model` with a sharding constraint on its hidden activations (batch split on the data
    axis), as users write it."""
    def fn(p, x):
        h = jax.lax.with_sharding_constraint(layer(p["w"], p["b"], x),
                                             NamedSharding(mesh, P("data", None)))
        return h @ p["v"]
    return fn


def mesh_of(k):
    return None if k is None else Mesh(np.array(jax.devices()[:k]), ("data",))


def optimizer(k, period, fn=model, **kw):
    return jg.Optimizer(fn, TX, loss="cross_entropy", period=period, mesh=mesh_of(k), **kw)


def rel(a, b) -> float:
    """Largest over leaves of max|a - b| / max|b|."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)))
    return worst


def same_bits(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def report(name, **figures):
    print(json.dumps({"name": name, **figures}), flush=True)
    faulthandler.dump_traceback_later(STALL, exit=True)  # progress: the watchdog starts again


REFERENCES = {}


def reference(period, remat):
    """Params after 8 optimizer steps on one device, no mesh (`remat`: True or None)."""
    if (period, remat) not in REFERENCES:
        REFERENCES[period, remat] = train(optimizer(None, period, remat=remat), 8 * period)[0]
    return REFERENCES[period, remat]


def check_equal(k, period, remat=None, fsdp=False):
    """`remat`: True (every checkpoint region), "budget" (half the step's temp) or None. A
    budget's run is compared with one device's without remat: remat changes no value (one
    device's budget run equals it bit for bit), and planning that run too took seconds."""
    planned = {"budget": "50%"} if remat == "budget" else remat
    opt = optimizer(k, period, remat=planned, param_sharding=FSDP if fsdp else None)
    state, _ = train(opt, 8 * period)
    specs = {name: a.sharding.spec for name, a in state.params.items()}
    want = reference(period, None if remat == "budget" else remat)
    report(f"equal k={k} period={period} remat={remat or False} fsdp={fsdp}",
           rel=rel(state.params, want.params),
           specs_kept=all(specs[n] == (FSDP[n] if fsdp else P()) for n in specs))


def hlo_counts(opt, state):
    """Collectives per executable of `opt` (compiled for `state` and a batch)."""
    data = opt._data(X[:BATCH], Y[:BATCH])
    ex, out = opt.executables, {}
    if opt.period == 1:
        out["opt"] = ex["opt"].lower(state.params, *data, state.opt_state)
    else:
        out["grad"] = ex["grad"].lower(state.params, *data, state.grad_acc, opt._counter(0))
        out["opt"] = ex["opt"].lower(state.params, *data, state.grad_acc,
                                     opt._counter(opt.period - 1), state.opt_state)
    return {name: count_collectives(low.compile().as_text()) for name, low in out.items()}


def check_hlo():
    for k, period, fsdp, mode in ((4, 4, False, "ignore"), (8, 4, False, "ignore"),
                                  (8, 4, True, "ignore"), (4, 1, False, "ignore"),
                                  (4, 4, False, "raise")):
        opt = optimizer(k, period, param_sharding=FSDP if fsdp else None, on_nonfinite=mode)
        state = opt.init(P0, X[:BATCH], Y[:BATCH])
        report(f"hlo k={k} period={period} fsdp={fsdp} mode={mode}",
               nleaves=len(jax.tree.leaves(P0)), **hlo_counts(opt, state))


def check_constraint():
    mesh = mesh_of(4)
    for period in (1, 4):
        opt = optimizer(4, period, fn=constrained(mesh))
        state, _ = train(opt, 8 * period)
        ref = train(jg.Optimizer(constrained_free, TX, loss="cross_entropy", period=period),
                    8 * period)[0]
        specs = {name: [str(e.params["sharding"].spec) for e in g.eqns
                        if e.op == "sharding_constraint"] for name, g in opt.graphs.items()}
        report(f"constraint period={period}", rel=rel(state.params, ref.params),
               forward=specs["forward"], grad=specs["grad"])


def constrained_free(p, x):
    return layer(p["w"], p["b"], x) @ p["v"]


def check_save_load(tmp):
    period = 4
    full, _ = train(optimizer(4, period), 12)
    ref_none, _ = train(optimizer(None, period), 12)
    for at in (8, 6):  # a period boundary, and mid-period (counter 2)
        opt = optimizer(4, period)
        state, _ = train(opt, at)
        path = os.path.join(tmp, f"at{at}.jgs")
        opt.save(state, path)
        if at == 6:
            acc_none = optimizer(None, period)
            s_none, _ = train(acc_none, 6)
            report("grad_acc mid-period", rel=rel(opt.grad_acc(state),
                                                  acc_none.grad_acc(s_none)))
        for k in (4, 2, 8, None):
            other = optimizer(k, period)
            other.init(P0, X[:BATCH], Y[:BATCH])
            loaded = other.load(path)
            resumed, _ = train(other, 12 - at, loaded, start=at)
            report(f"resume at={at} k={k}", rel=rel(resumed.params, full.params),
                   bitwise=same_bits(resumed.params, full.params))
    opt = optimizer(None, period)
    state, _ = train(opt, 6)
    opt.save(state, os.path.join(tmp, "none.jgs"))
    other = optimizer(4, period)
    other.init(P0, X[:BATCH], Y[:BATCH])
    resumed, _ = train(other, 6, other.load(os.path.join(tmp, "none.jgs")), start=6)
    report("resume no-mesh file on k=4", rel=rel(resumed.params, ref_none.params))


def check_fit():
    mesh = mesh_of(4)
    kw = dict(loss="cross_entropy", tx=TX, epochs=2, batch_size=32, physical_batch_size=8,
              val_split=0.25, progress=False, key=jax.random.PRNGKey(3))
    params, hist = jg.fit(model, P0, jg.Dataset(X, Y, mesh=mesh), **kw)
    ref, ref_hist = jg.fit(model, P0, jg.Dataset(X, Y), **kw)
    report("fit dataset mesh", rel=rel(params, ref),
           loss=[hist.train_loss, ref_hist.train_loss], val=[hist.val_loss, ref_hist.val_loss])
    params, _ = jg.fit(model, P0, jg.Dataset(X, Y), mesh=mesh, **kw)
    report("fit mesh argument", rel=rel(params, ref))


def dropout_model(p, x):
    keep = jax.random.bernoulli(p["key"], 0.9, (x.shape[0], 16))
    return (layer(p["w"], p["b"], x) * keep) @ p["v"]


def check_keys():
    """PRNG keys in params: carried unchanged; period 1 draws as one device does; with period 4
    each shard folds in its index (its own draws)."""
    params = {**P0, "key": jax.random.key(7)}
    for period in (1, 4):
        runs = []
        for k in (None, 4):
            opt = optimizer(k, period, fn=dropout_model)
            state = opt.init(params, X[:BATCH], Y[:BATCH])
            state, _ = train(opt, 8, state)
            runs.append(state.params)
        report(f"keys period={period}", rel=rel({n: runs[0][n] for n in P0},
                                                 {n: runs[1][n] for n in P0}),
               key_kept=bool(np.array_equal(jax.random.key_data(runs[1]["key"]),
                                            jax.random.key_data(params["key"]))))

    def probe(p, x):  # each row: its 16 mask bits as a number, exactly
        keep = jax.random.bernoulli(p["key"], 0.5, (x.shape[0], 16)).astype(x.dtype)
        return keep @ (2.0 ** jnp.arange(16, dtype=x.dtype)) + 0 * (x @ p["w"])[:, 0]

    opt = jg.Optimizer(probe, TX, loss="sum", period=4, mesh=mesh_of(4))
    state = opt.init(params, X[:BATCH])
    per_shard = opt.executables["grad"].jitted(
        opt._split(state.params)[0], *opt._data(X[:BATCH], None, opt._split(state.params)[1]),
        state.grad_acc, opt._counter(0))[0]
    report("keys per shard", sums=np.asarray(per_shard).tolist())


def check_fit_resume(tmp):
    """fit on 4 devices stopped after 1 epoch (its checkpoint) and resumed for a second one ends
    bitwise where the 2-epoch run ends; resumed on 2 devices, equal to rounding."""
    kw = dict(loss="cross_entropy", tx=TX, batch_size=32, physical_batch_size=8,
              progress=False, key=jax.random.PRNGKey(5))
    full, _ = jg.fit(model, P0, jg.Dataset(X, Y), epochs=2, mesh=mesh_of(4), **kw)
    path = os.path.join(tmp, "fit.jgs")
    jg.fit(model, P0, jg.Dataset(X, Y), epochs=1, mesh=mesh_of(4), checkpoint_path=path, **kw)
    resumed, hist = jg.fit(model, P0, jg.Dataset(X, Y), epochs=2, mesh=mesh_of(4),
                           checkpoint_path=path, **kw)
    report("fit resume k=4", bitwise=same_bits(resumed, full), epochs=len(hist.train_loss))
    path2 = os.path.join(tmp, "fit2.jgs")
    jg.fit(model, P0, jg.Dataset(X, Y), epochs=1, mesh=mesh_of(4), checkpoint_path=path2, **kw)
    resumed, _ = jg.fit(model, P0, jg.Dataset(X, Y), epochs=2, mesh=mesh_of(2),
                        checkpoint_path=path2, **kw)
    report("fit resume k=2", rel=rel(resumed, full))


def check_step_period():
    opt = optimizer(4, 4)
    state, _ = train(opt, 8)
    other = optimizer(4, 4)
    s = other.init(P0, X[:BATCH], Y[:BATCH])
    losses = []
    for j in range(2):
        xs = X[j * 32:(j + 1) * 32].reshape(4, BATCH, 5)
        ys = Y[j * 32:(j + 1) * 32].reshape(4, BATCH)
        s, out = other.step_period(s, xs, ys)
        losses.append(np.asarray(out.loss).tolist())
    report("step_period", rel=rel(s.params, state.params), losses=losses)


def check_nonfinite():
    opt = optimizer(4, 4, on_nonfinite="raise")
    state, _ = train(opt, 5)
    before = jax.tree.map(np.asarray, state)
    bad = X[:BATCH].copy()
    bad[5, 0] = np.nan  # one datapoint of one device's shard
    try:
        opt.step(state, bad, Y[:BATCH])
        raised = False
    except jg.training.NonFiniteError as e:
        raised = bool(same_bits(jax.tree.map(np.asarray, e.state), before))
    report("nonfinite raise", raised_and_kept=raised)
    opt = optimizer(4, 4, on_nonfinite="skip")
    state, _ = train(opt, 3)
    before = jax.tree.map(np.asarray, state.params)
    state, out = opt.step(state, bad, Y[:BATCH])
    report("nonfinite skip", kept=same_bits(state.params, before), finite=bool(out.finite))


def check_errors():
    mesh4 = mesh_of(4)
    msgs = {}

    def expect(name, fn):
        try:
            fn()
            msgs[name] = None
        except jg.JGraphError as e:
            msgs[name] = str(e)

    expect("dataset batch", lambda: jg.Dataset(X, Y, mesh=mesh4).batch(0, 6))
    expect("fit batch", lambda: jg.fit(model, P0, jg.Dataset(X, Y), mesh=mesh4, epochs=1,
                                       batch_size=6, loss="cross_entropy", progress=False))
    opt = optimizer(4, 1)
    state = opt.init(P0, X[:BATCH], Y[:BATCH])
    expect("step batch", lambda: opt.step(state, X[:6], Y[:6]))
    expect("spec divisible", lambda: optimizer(8, 1, param_sharding={
        "w": P(None, "data"), "b": None, "v": P(None, "data")}).init(P0, X[:8], Y[:8]))
    expect("spec axis", lambda: optimizer(4, 1, param_sharding=lambda leaf: P("model")).init(
        P0, X[:8], Y[:8]))
    expect("data axis", lambda: jg.Optimizer(model, TX, mesh=mesh4, data_axis="batch"))
    explicit = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,),
                             devices=jax.devices()[:4])
    expect("explicit mesh", lambda: jg.Optimizer(model, TX, mesh=explicit))
    report("errors", **msgs)


def check_jit_shardings():
    """`jg.jit(step, in_shardings=, out_shardings=)` as `jax.jit` takes them (a prefix of the
    arguments, static ones left out; of the result): the params and adam's state replicated,
    the batch split on the data axis, FSDP-sharded params; trained as `jax.jit` trains."""
    mesh = mesh_of(4)
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    fsdp = {k: NamedSharding(mesh, spec) for k, spec in FSDP.items()}

    def make(grad):
        def step(params, opt_state, x, y, scale):
            def loss(p):
                logits = model(p, x)
                return scale * jnp.mean(
                    jax.nn.logsumexp(logits, -1)
                    - jnp.take_along_axis(logits, y[:, None], -1)[:, 0])
            value, g = grad(loss)(params)
            updates, opt_state = TX.update(g, opt_state, params)
            return jax.tree.map(lambda a, u: a + u, params, updates), opt_state, value
        return step

    for name, param_sharding in (("replicated", rep), ("fsdp", fsdp)):
        kw = dict(in_shardings=(param_sharding, None, rows, rows),
                  out_shardings=(param_sharding, None, rep), static_argnums=4,
                  donate_argnums=(0, 1))
        runs = []
        for jit, grad in ((jax.jit, jax.value_and_grad),
                          (jg.jit, jg.value_and_grad)):
            step = jit(make(grad), **kw)
            params = jax.device_put(jax.tree.map(jnp.asarray, P0), param_sharding)
            opt_state = TX.init(params)
            for _ in range(3):
                params, opt_state, value = step(params, opt_state, X[:64], Y[:64], 1.0)
            runs.append((params, value))
        (want, _), (got, value) = runs
        specs = {k: str(a.sharding.spec) for k, a in got.items()}
        wanted = {k: str((param_sharding if name == "replicated" else fsdp[k]).spec)
                  for k in got}
        report(f"jit shardings {name}", rel=rel(got, want), specs_kept=specs == wanted,
               loss_spec=str(value.sharding.spec))


def suite(slow: bool):
    import tempfile

    def run(check, *args, **kw):
        progress(f"check {check.__name__}{args}{kw or ''}")
        check(*args, **kw)

    periods, ks = (1, 4), (1, 2, 4, 8)
    if slow:
        for period in periods:
            for k in ks:
                run(check_equal, k, period)
                run(check_equal, k, period, remat=True)
                run(check_equal, k, period, fsdp=True)
                run(check_equal, k, period, remat=True, fsdp=True)
        return
    for k, period in ((1, 1), (2, 4), (4, 1), (8, 1), (8, 4)):  # every k, both periods
        run(check_equal, k, period)
    run(check_equal, 8, 4, remat=True)
    run(check_equal, 4, 4, remat="budget")
    run(check_equal, 8, 1, remat=True)
    run(check_equal, 4, 4, fsdp=True)
    run(check_equal, 8, 1, fsdp=True)
    run(check_equal, 8, 4, remat=True, fsdp=True)
    run(check_hlo)
    run(check_constraint)
    with tempfile.TemporaryDirectory() as tmp:
        run(check_save_load, tmp)
        run(check_fit_resume, tmp)
    for check in (check_fit, check_keys, check_step_period, check_nonfinite, check_errors,
                  check_jit_shardings):
        run(check)


# -- multi-process ------------------------------------------------------------------------------
def worker(process_id: int, nprocs: int, port: int, out: str):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", nprocs, process_id,
                               # generous: a loaded machine is slow, not dead (a dead peer
                               # ends the run by the watchdog, or by these, later)
                               initialization_timeout=180, heartbeat_timeout_seconds=120,
                               shutdown_timeout_seconds=180)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    report("worker", process=jax.process_index(), devices=len(jax.devices()),
           local=len(jax.local_devices()))
    ds = jg.Dataset(X, Y, mesh=mesh)
    for period in (1, 4):
        progress(f"worker {jax.process_index()} period {period}")
        opt = jg.Optimizer(model, TX, loss="cross_entropy", period=period, mesh=mesh,
                           remat=True)
        state = opt.init(P0, *ds.batch(0, BATCH))
        result = jg.Result()
        for i in range(8 * period):
            state, step_out = opt.step(state, *ds.batch(i % (len(X) // BATCH), BATCH))
            result.add(step_out)
        opt.save(state, os.path.join(out, f"period{period}.jgs"))
        if jax.process_index() == 0:
            with open(os.path.join(out, f"period{period}.json"), "w") as f:
                json.dump([float(v) for v in result.losses()], f)
    report("worker done", process=jax.process_index())
    jax.distributed.shutdown()


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode.startswith("suite"):
        suite(mode == "suite-slow")
    else:
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
