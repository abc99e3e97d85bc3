"""Sharding benchmarks: per-device memory and collectives of the Optimizer's steps on a mesh.

Measured in a child process with 8 forced host devices (JAX fixes its device count at start).
Models: the demo MLP (`jgraph.training.demo`, micro-batch 16) and a stack of 4 transformer blocks
(width 64, 4 heads, sequence 32, and 128 at 1 and 8 devices; micro-batch 8: one datapoint per
device at 8 devices), adam, cross-entropy. At sequence 32 the period-1 step's per-device peak on
8 devices is the gradients' all-reduce (about 1.8x the param bytes, whatever the activations), so
the activations' share shows in the grad micro-step and at sequence 128. Rows, at 1, 2, 4 and 8
devices:
- per-device temp of the donated steps (XLA's `memory_analysis`): the period-4 micro-step (`grad`,
  per-device accumulation) and the period-1 step (`opt`, the whole micro-batch partitioned by
  XLA), with params replicated and FSDP-style (a param's first axis split over the devices where
  it divides: the period-1 step's gradients and adam temporaries are param-sized, and replicated
  params keep them whole on every device); the reference is the same step on 1 device, so the
  ratio is the per-device share;
- collectives in the period-4 grad and opt executables (in the note).

    python -m benchmarks.bench_sharding
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

KIB = 1024
ROOT = Path(__file__).resolve().parent.parent


def _transformer(jnp, np, jax, seq=32):
    width, heads, depth = 64, 4, 4

    def block(p, x):
        split = lambda h: h.reshape(h.shape[:2] + (heads, width // heads))  # noqa: E731
        q, k, v = split(x @ p["wq"]), split(x @ p["wk"]), split(x @ p["wv"])
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // heads))
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape) @ p["wo"]
        return x + jnp.tanh(x @ p["w1"]) @ p["w2"]

    def model(p, x):
        for bp in p["blocks"]:
            x = jax.checkpoint(block)(bp, x)
        return jnp.mean(x, axis=1) @ p["head"]

    rng = np.random.default_rng(0)
    dense = lambda a, b: (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)  # noqa
    params = {"blocks": [{"wq": dense(width, width), "wk": dense(width, width),
                          "wv": dense(width, width), "wo": dense(width, width),
                          "w1": dense(width, 4 * width), "w2": dense(4 * width, width)}
                         for _ in range(depth)], "head": dense(width, 10)}
    x = rng.normal(size=(8, seq, width)).astype(np.float32)
    return model, params, x, rng.integers(0, 10, 8).astype(np.int32)


def _child() -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jgraph as jg
    from jgraph.training import demo
    from jgraph.training.mesh import count_collectives

    ds, n_in = demo.load_digits_dataset()
    cases = {"demo MLP": (demo.model, demo.init_params(jax.random.PRNGKey(0), n_in),
                          *ds.batch(0, 16)),
             "transformer x4": _transformer(jnp, np, jax),
             "transformer x4 seq 128": _transformer(jnp, np, jax, seq=128)}
    def fsdp(leaf):  # FSDP-style: a param's first axis split over the devices where it divides
        return P("data") if leaf.ndim and leaf.shape[0] % 8 == 0 else None

    for name, (model, params, x, y) in cases.items():
        for period, sharding in ((4, None), (1, None), (1, fsdp)):
            for k in ((1, 8) if "seq" in name else (1, 2, 4, 8)):
                mesh = Mesh(np.array(jax.devices()[:k]), ("data",))
                opt = jg.Optimizer(model, optax.adam(1e-3), loss="cross_entropy",
                                   period=period, mesh=mesh, param_sharding=sharding)
                state = opt.init(params, x, y)
                data = opt._data(x, y)
                if period == 1:
                    step = opt.executables["opt"].lower(state.params, *data, state.opt_state)
                    counts = {}
                else:
                    step = opt.executables["grad"].lower(state.params, *data, state.grad_acc,
                                                         opt._counter(0))
                    last = opt.executables["opt"].lower(state.params, *data, state.grad_acc,
                                                        opt._counter(period - 1),
                                                        state.opt_state).compile()
                    counts = count_collectives(last.as_text())
                compiled = step.compile()
                print(json.dumps({"model": name, "period": period, "devices": k,
                                  "fsdp": sharding is not None,
                                  "temp": compiled.memory_analysis().temp_size_in_bytes,
                                  "step": count_collectives(compiled.as_text()),
                                  "opt": counts}), flush=True)


def _measure() -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_sharding", "--child"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _short(counts: dict) -> str:
    return ", ".join(f"{n} {v}" for n, v in counts.items() if v) or "no collective"


def rows(quick: bool = False) -> list[dict]:
    out, single = [], {}
    for r in _measure():
        key = (r["model"], r["period"], r["fsdp"])
        if r["devices"] == 1:
            single[key] = r["temp"]
        step = "grad micro-step, period 4" if r["period"] > 1 else "opt step, period 1"
        if r["fsdp"]:
            step += ", FSDP params"
        note = f"step: {_short(r['step'])}"
        if r["opt"]:
            note += f"; opt step: {_short(r['opt'])}"
        out.append({"benchmark": f"per-device temp KiB, {r['model']}, {step}, "
                                 f"{r['devices']} devices",
                    "jgraph": r["temp"] / KIB, "reference": single[key] / KIB,
                    "ratio": r["temp"] / single[key], "note": note})
    return out


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child()
    else:
        from benchmarks.run import format_table

        print(format_table(rows("--quick" in sys.argv)))
