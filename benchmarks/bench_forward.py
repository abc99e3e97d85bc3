"""Forward benchmarks: the compiled traced model against `jax.jit(fn)`, and the cost of tracing.

Row 1: step time of `jg.compile(jg.trace(f, ...))` vs `jax.jit(f)` on a residual MLP (same process,
interleaved runs, median). Row 2: `jg.trace` + `jg.compile(g).lower(...).compile()` of a function of
about 2,000 eqns vs `jax.jit(f).lower(...).compile()` of the same function (bar: ratio <= 1.5).

    python -m benchmarks.bench_forward [--quick]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jgraph as jg
from benchmarks import interleaved_medians


def residual_mlp(params, x):
    h = x
    for w1, w2 in params:
        h = h + jnp.tanh(h @ w1) @ w2
    return jnp.mean(h * h)


def _mlp_args(width, hidden, blocks, batch):
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * blocks + 1)
    params = [(jax.random.normal(keys[2 * i], (width, hidden), jnp.float32) * width**-0.5,
               jax.random.normal(keys[2 * i + 1], (hidden, width), jnp.float32) * hidden**-0.5)
              for i in range(blocks)]
    return params, jax.random.normal(keys[-1], (batch, width), jnp.float32)


def forward_row(quick: bool) -> dict:
    width, hidden, blocks, batch = (128, 256, 4, 64) if quick else (512, 1024, 8, 256)
    args = _mlp_args(width, hidden, blocks, batch)
    ours = jg.compile(jg.trace(residual_mlp, *args, param_argnums=0))
    ref = jax.jit(residual_mlp)
    t = interleaved_medians({"jgraph": lambda: ours(*args), "jax": lambda: ref(*args)},
                            repeats=20 if quick else 100, warmup=2)
    return {"benchmark": "forward: compiled step time", "jgraph": f"{t['jgraph'] * 1e3:.3f} ms",
            "reference": f"{t['jax'] * 1e3:.3f} ms", "ratio": t["jgraph"] / t["jax"],
            "note": f"residual MLP {blocks}x({width}->{hidden}->{width}), batch {batch}, f32"}


def _chain_fn():
    """A fresh function object each time, so that no JAX tracing cache is hit."""

    def chain(params, x):
        h = x
        for w, b in params:
            h = h + 0.5 * jnp.tanh(h @ w + b)
        return jnp.sum(h)

    return chain


def _chain_args(layers, width=16):
    keys = jax.random.split(jax.random.PRNGKey(1), layers + 1)
    params = [(jax.random.normal(k, (width, width), jnp.float32) * 0.1,
               jnp.zeros((width,), jnp.float32)) for k in keys[:-1]]
    return params, jax.random.normal(keys[-1], (4, width), jnp.float32)


def trace_compile_row(quick: bool) -> dict:
    layers = 100 if quick else 333  # 6 eqns per layer: about 2,000 eqns
    args = _chain_args(layers)
    n_eqns = len(jg.trace(_chain_fn(), *args).eqns)

    def ours():
        g = jg.trace(_chain_fn(), *args, param_argnums=0)
        return jg.compile(g).lower(*args).compile()

    def ref():
        return jax.jit(_chain_fn()).lower(*args).compile()

    t = interleaved_medians({"jgraph": ours, "jax": ref}, repeats=3 if quick else 7)
    return {"benchmark": "trace+compile overhead", "jgraph": f"{t['jgraph']:.2f} s",
            "reference": f"{t['jax']:.2f} s", "ratio": t["jgraph"] / t["jax"],
            "note": f"{n_eqns} eqns; jg.trace + jg.compile().lower().compile() vs "
                    f"jax.jit().lower().compile(); bar <= 1.5"}


def rows(quick: bool = False) -> list[dict]:
    return [forward_row(quick), trace_compile_row(quick)]


if __name__ == "__main__":
    from benchmarks.run import format_table

    print(format_table(rows(quick="--quick" in sys.argv)))
