"""Loop benchmarks (issue: structured control flow): jgraph's scan against JAX's, same program.

Rows:
- a scanned L-layer MLP `tanh(h @ W[i] + b[i])` (D=128, batch 32) at L = 8, 64, 256, 1024:
  trace + backward + compile of jgraph's donated SGD step against JAX's lower + compile of the
  same step, the donated step's temp, and the step time (interleaved, median);
- a scanned 12-layer transformer (d_model 256, seq 128, batch 8) with `jax.checkpoint` on the
  layer inside the scan: donated temp against JAX's same program and against jgraph's own scan
  without the checkpoint; `prevent_cse=False` too;
- an LSTM cell scanned over 1,000 steps, and a 2,000-step scan: compile time against JAX's.
Gradients are compared with `jax.value_and_grad` in every row.

    python -m benchmarks.bench_loops [--quick]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jgraph as jg
from benchmarks import interleaved_medians
from jgraph.memory import donated_step

MIB = 2**20


def jax_step(fn):
    def step(params, x):
        loss, grads = jax.value_and_grad(fn)(params, x)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), loss

    return jax.jit(step, donate_argnums=0)


def _compiled(step, *args):
    start = time.perf_counter()
    compiled = step.lower(*args).compile()
    return compiled, time.perf_counter() - start


def compare(name, fn, args, time_steps=True, repeats=11):
    """Rows comparing jgraph's donated step of `fn` with JAX's (compile, temp, time, grads)."""
    start = time.perf_counter()
    gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
    step, split = donated_step(gb)
    state, rest = split(*args)
    state = jax.tree.map(jnp.copy, state)  # donated by the timed steps: never the caller's
    compiled, _ = _compiled(step, state, rest)
    jg_compile = time.perf_counter() - start
    ref, ref_compile = _compiled(jax_step(fn), *args)
    jg_temp = compiled.memory_analysis().temp_size_in_bytes
    ref_temp = ref.memory_analysis().temp_size_in_bytes
    grads = jax.jit(lambda *a: jg.compile(gb)(*a)[1])(*args)
    want = jax.jit(jax.grad(fn))(*args)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / (np.max(np.abs(b)) + 1e-30)))
              for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True))
    bitwise = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(grads),
                                                       jax.tree.leaves(want), strict=True))
    rows = [
        {"benchmark": f"loops {name}: trace+backward+compile", "jgraph": f"{jg_compile:.2f} s",
         "reference": f"{ref_compile:.2f} s", "ratio": jg_compile / ref_compile,
         "note": f"reference: jit(value_and_grad) lower+compile; {len(gb.eqns)} eqns; grads "
                 f"{'bitwise' if bitwise else f'rel err {err:.1e}'}"},
        {"benchmark": f"loops {name}: donated temp", "jgraph": f"{jg_temp / MIB:.2f} MiB",
         "reference": f"{ref_temp / MIB:.2f} MiB", "ratio": jg_temp / max(ref_temp, 1),
         "note": "temp_size_in_bytes of the donated SGD step"},
    ]
    if time_steps:
        params = jax.tree.map(jnp.copy, args[0])
        holder = {"jg": (state, rest), "jax": params}

        def run_jg():
            s, r = holder["jg"]
            new, out = compiled(s, r)
            holder["jg"] = (new, r)
            return out

        def run_jax():
            new, out = ref(holder["jax"], *args[1:])
            holder["jax"] = new
            return out

        times = interleaved_medians({"jg": run_jg, "jax": run_jax}, repeats=repeats)
        rows.append({"benchmark": f"loops {name}: step time", "jgraph": f"{times['jg'] * 1e3:.2f}"
                     " ms", "reference": f"{times['jax'] * 1e3:.2f} ms",
                     "ratio": times["jg"] / times["jax"], "note": "interleaved, median"})
    return rows, jg_temp


# -- models ------------------------------------------------------------------------------------
def scanned_mlp(ps, x):
    h, _ = lax.scan(lambda h, p: (jnp.tanh(h @ p[0] + p[1]), None), x, ps)
    return jnp.mean(h * h)


def mlp_args(layers, d=128, batch=32):
    rng = np.random.default_rng(0)
    ws = (rng.standard_normal((layers, d, d)) / np.sqrt(d)).astype(np.float32)
    bs = (0.1 * rng.standard_normal((layers, d))).astype(np.float32)
    return (jnp.asarray(ws), jnp.asarray(bs)), jnp.asarray(
        rng.standard_normal((batch, d)).astype(np.float32))


def _layer_norm(x):
    mean = jnp.mean(x, -1, keepdims=True)
    return (x - mean) * lax.rsqrt(jnp.mean((x - mean) ** 2, -1, keepdims=True) + 1e-5)


def transformer_layer(h, p, heads=4):
    b, t, d = h.shape
    q, k, v = (_layer_norm(h) @ p["qkv"]).reshape(b, t, 3, heads, d // heads).transpose(
        2, 0, 3, 1, 4)
    att = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(d // heads)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    y = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(att, -1), v).transpose(0, 2, 1, 3)
    h = h + y.reshape(b, t, d) @ p["out"]
    return h + jax.nn.gelu(_layer_norm(h) @ p["up"]) @ p["down"], None


def scanned_transformer(checkpoint=False, prevent_cse=True):
    layer = jax.checkpoint(transformer_layer, prevent_cse=prevent_cse) if checkpoint else \
        transformer_layer

    def loss(params, x):
        h, _ = lax.scan(layer, x, params)
        return jnp.mean(h * h)

    return loss


def transformer_args(layers=12, d=256, t=128, batch=8):
    rng = np.random.default_rng(1)

    def w(*shape):
        return jnp.asarray((rng.standard_normal((layers, *shape)) / np.sqrt(shape[0]))
                           .astype(np.float32))

    params = {"qkv": w(d, 3 * d), "out": w(d, d), "up": w(d, 4 * d), "down": w(4 * d, d)}
    return params, jnp.asarray(rng.standard_normal((batch, t, d)).astype(np.float32))


def lstm(params, xs):
    def cell(carry, x):
        h, c = carry
        z = x @ params["wx"] + h @ params["wh"] + params["b"]
        i, f, g, o = jnp.split(z, 4, -1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    b, n = xs.shape[1], params["wh"].shape[0]
    (h, _), hs = lax.scan(cell, (jnp.zeros((b, n)), jnp.zeros((b, n))), xs)
    return jnp.mean(hs ** 2)


def lstm_args(steps=1000, d=32, n=64, batch=8):
    rng = np.random.default_rng(2)
    params = {"wx": jnp.asarray((rng.standard_normal((d, 4 * n)) / np.sqrt(d)).astype(np.float32)),
              "wh": jnp.asarray((rng.standard_normal((n, 4 * n)) / np.sqrt(n)).astype(np.float32)),
              "b": jnp.zeros(4 * n, jnp.float32)}
    return params, jnp.asarray(rng.standard_normal((steps, batch, d)).astype(np.float32))


def rows(quick: bool = False) -> list[dict]:
    out = []
    for layers in (8, 64) if quick else (8, 64, 256, 1024):
        out += compare(f"scanned MLP L={layers}", scanned_mlp, mlp_args(layers))[0]
    targs = transformer_args(layers=4 if quick else 12)
    plain_rows, plain_temp = compare("transformer x12, no remat", scanned_transformer(), targs,
                                     time_steps=False)
    ck_rows, ck_temp = compare("transformer x12, checkpoint per layer",
                               scanned_transformer(True), targs, time_steps=not quick, repeats=5)
    nocse_rows, _ = compare("transformer x12, checkpoint(prevent_cse=False)",
                            scanned_transformer(True, False), targs, time_steps=False)
    out += plain_rows + ck_rows + nocse_rows
    out.append({"benchmark": "loops transformer x12: checkpoint vs own no remat",
                "jgraph": f"{ck_temp / MIB:.2f} MiB", "reference": f"{plain_temp / MIB:.2f} MiB",
                "ratio": ck_temp / plain_temp, "note": "bar: <= 0.5x"})
    out += compare("LSTM 1000 steps", lstm, lstm_args(200 if quick else 1000),
                   time_steps=not quick)[0]
    out += compare("scan 2000 steps", scanned_mlp, mlp_args(2000, d=16, batch=4),
                   time_steps=False)[0]
    return out


if __name__ == "__main__":
    for row in rows(quick="--quick" in sys.argv):
        print(" | ".join(str(row[k]) if not isinstance(row[k], float) else f"{row[k]:.3f}"
                         for k in ("benchmark", "jgraph", "reference", "ratio", "note")),
              flush=True)
