"""Backward benchmarks: the compiled value-and-grad step, and the cost of the `backward` transform.

Rows 1-2: step time of `jg.compile(jg.backward(jg.trace(f)))` vs `jax.jit(jax.value_and_grad(f))`
on an MLP and a transformer block (same process, interleaved runs, median; bar: ratio <= 1.02);
the note says whether the two steps' gradients are bitwise equal. Rows 3-5: `jg.backward` on
graphs of about 1k, 10k and 50k eqns; JAX tracing `value_and_grad` of the same function
(`jax.make_jaxpr`, at 1k only); bars: 10k < 1 s, and 50k <= 6x the 10k time (linear).

    python -m benchmarks.bench_backward [--quick]
"""

from __future__ import annotations

import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jgraph as jg
from benchmarks import interleaved_medians


def mlp(params, x):
    h = x
    for w, b in params[:-1]:
        h = jnp.tanh(h @ w + b)
    w, b = params[-1]
    return jnp.mean((h @ w + b) ** 2)


def _mlp_args(width, layers, batch):
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 1)
    params = [(jax.random.normal(k, (width, width), jnp.float32) * width**-0.5,
               jnp.zeros((width,), jnp.float32)) for k in keys[:-1]]
    return params, jax.random.normal(keys[-1], (batch, width), jnp.float32)


def _layer_norm(x, scale, bias):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def transformer_block(p, x):
    b, t, d = x.shape
    heads = p["heads"].shape[0]
    h = _layer_norm(x, p["ln1_s"], p["ln1_b"])
    q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
    split = lambda a: a.reshape(b, t, heads, d // heads)
    scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k)) / np.sqrt(d // heads)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), split(v)).reshape(b, t, d)
    x = x + attn @ p["proj"]
    h = jax.nn.gelu(_layer_norm(x, p["ln2_s"], p["ln2_b"]) @ p["fc"])
    return jnp.mean(jnp.square(x + h @ p["out"]))


def _block_args(batch, t, d, heads):
    k = jax.random.split(jax.random.PRNGKey(1), 5)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32) * shape[0]**-0.5
    p = {"qkv": normal(k[0], (d, 3 * d)), "proj": normal(k[1], (d, d)),
         "fc": normal(k[2], (d, 4 * d)), "out": normal(k[3], (4 * d, d)),
         "ln1_s": jnp.ones(d), "ln1_b": jnp.zeros(d), "ln2_s": jnp.ones(d), "ln2_b": jnp.zeros(d),
         "heads": jnp.zeros(heads)}
    return p, jax.random.normal(k[4], (batch, t, d), jnp.float32)


def _step_row(name, fn, args, note, quick):
    ours = jg.compile(jg.backward(jg.trace(fn, *args, param_argnums=0)))
    ref = jax.jit(jax.value_and_grad(fn))
    bitwise = all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(ours(*args)), jax.tree.leaves(ref(*args)), strict=True))
    hlo_ops = [_hlo_op_count(f, args) for f in (ours, ref)]
    t = interleaved_medians({"jgraph": lambda: ours(*args), "jax": lambda: ref(*args)},
                            repeats=20 if quick else 200, warmup=3)
    return {"benchmark": f"value_and_grad step: {name}", "jgraph": f"{t['jgraph'] * 1e3:.3f} ms",
            "reference": f"{t['jax'] * 1e3:.3f} ms", "ratio": t["jgraph"] / t["jax"],
            "note": f"{note}; grads bitwise equal: {bitwise}; optimized HLO ops "
                    f"{hlo_ops[0]} vs {hlo_ops[1]}; bar <= 1.02"}


def _hlo_op_count(jitted, args) -> int:
    """Instructions in the optimized HLO (equal counts: XLA got the same program, up to names)."""
    text = jitted.lower(*args).compile().as_text()
    return len(re.findall(r"^\s*(?:ROOT )?\S+ = ", text, flags=re.M))


def mlp_row(quick: bool) -> dict:
    width, layers, batch = (128, 4, 64) if quick else (512, 8, 256)
    return _step_row("MLP", mlp, _mlp_args(width, layers, batch),
                     f"{layers} tanh layers of width {width}, batch {batch}, f32", quick)


def transformer_row(quick: bool) -> dict:
    batch, t, d, heads = (2, 32, 64, 4) if quick else (8, 128, 256, 4)
    return _step_row("transformer block", transformer_block, _block_args(batch, t, d, heads),
                     f"pre-LN block, B={batch} T={t} D={d} H={heads}, f32", quick)


def _chain(layers):
    """A function of about 3 eqns per layer, and its args (small arrays: the graph is the size)."""

    def chain(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w + 1.0)
        return jnp.mean(x)

    return chain, ([jnp.full((4, 4), 0.1, jnp.float32)] * layers, jnp.ones((2, 4), jnp.float32))


def _median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def transform_rows(quick: bool) -> list[dict]:
    """1k: vs JAX tracing value_and_grad of the same function; 10k: vs the 1 s bar; 50k: vs 6x the
    10k time (JAX's tracing of 50k eqns takes minutes, so it is measured at 1k only)."""
    seconds, cpu, sizes = {}, {}, {}
    for target in (1_000, 10_000, 50_000):
        fn, args = _chain(target // 3)
        g = jg.trace(fn, *args, param_argnums=0)
        sizes[target] = len(g.eqns)
        repeats = 1 if quick else (5 if target < 50_000 else 3)
        start = time.process_time()
        seconds[target] = _median_seconds(lambda g=g: jg.backward(g), repeats)
        cpu[target] = (time.process_time() - start) / repeats
        if target == 1_000:
            t_jax = _median_seconds(lambda: jax.make_jaxpr(jax.value_and_grad(fn))(*args), 1)

    def row(target, reference, ratio, note):
        return {"benchmark": f"jg.backward transform, {sizes[target]} eqns",
                "jgraph": f"{seconds[target]:.3f} s", "reference": reference, "ratio": ratio,
                "note": f"wall median; cpu {cpu[target]:.3f} s per run; {note}"}

    return [
        row(1_000, f"{t_jax:.3f} s", seconds[1_000] / t_jax,
            "reference: jax.make_jaxpr(jax.value_and_grad(f))"),
        row(10_000, "1 s (bar)", seconds[10_000], "bar: < 1 s"),
        row(50_000, f"{6 * seconds[10_000]:.3f} s (6x 10k)",
            seconds[50_000] / (6 * seconds[10_000]),
            f"50k / 10k = {seconds[50_000] / seconds[10_000]:.2f}x; bar: <= 6x (linear: 5x)"),
    ]


def rows(quick: bool = False) -> list[dict]:
    return [mlp_row(quick), transformer_row(quick), *transform_rows(quick)]


if __name__ == "__main__":
    from benchmarks.run import format_table

    print(format_table(rows(quick="--quick" in sys.argv)))
