"""Remat benchmarks (DESIGN §5 shapes): jgraph's remat and `jax.checkpoint`, side by side.

Models: a 32-layer `tanh(h @ W + b)` chain (width 512, batch 256, f32) and a 16-block residual MLP
`h + tanh(h @ W1) @ W2` (width 512, hidden 2048, batch 256). Variants: no remat, a checkpoint per
layer/block, sqrt(N) segments of 6 layers, and one policy over the whole model. The same loss
function (with `jax.checkpoint` where the variant has regions) is traced by jgraph (`jg.remat` of
the joint graph, or `jg.remat(gb, policy=...)`) and differentiated by JAX.

Per variant, three rows: the donated SGD step's `temp_size_in_bytes` (jgraph vs JAX, same
variant), the `dot(` count in its compiled HLO (recomputed matmuls), and the step time relative
to JAX's no-remat step (interleaved runs, median). Default XLA flags.

    python -m benchmarks.bench_remat [--quick]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import jgraph as jg
from benchmarks import interleaved_medians
from jgraph.memory import donated_step

MIB = 2**20


def chain_args(layers=32, width=512, batch=256):
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 1)
    params = [(jax.random.normal(keys[i], (width, width), jnp.float32) * width**-0.5,
               jnp.zeros((width,), jnp.float32)) for i in range(layers)]
    return params, jax.random.normal(keys[-1], (batch, width), jnp.float32)


def chain(segment=None):
    """The tanh chain; with `segment=k`, each run of k layers is one `jax.checkpoint` region."""

    def run(params, h):
        for w, b in params:
            h = jnp.tanh(h @ w + b)
        return h

    def loss(params, x):
        h, step = x, segment or len(params)
        for i in range(0, len(params), step):
            h = (jax.checkpoint(run) if segment else run)(params[i:i + step], h)
        return jnp.mean(h * h)

    return loss


def block_args(blocks=16, width=512, hidden=2048, batch=256):
    keys = jax.random.split(jax.random.PRNGKey(1), 2 * blocks + 1)
    params = [(jax.random.normal(keys[2 * i], (width, hidden), jnp.float32) * width**-0.5,
               jax.random.normal(keys[2 * i + 1], (hidden, width), jnp.float32) * hidden**-0.5)
              for i in range(blocks)]
    return params, jax.random.normal(keys[-1], (batch, width), jnp.float32)


def blocks(per_block=False, policy=None):
    def block(h, p):
        return h + jnp.tanh(h @ p[0]) @ p[1]

    wrapped = jax.checkpoint(block, policy=policy) if per_block else block

    def loss(params, x):
        h = x
        for p in params:
            h = wrapped(h, p)
        return jnp.mean(h * h)

    return loss


def whole(fn, policy):
    """`fn` checkpointed as a whole with `policy` (JAX's counterpart of `jg.remat(policy=)`)."""
    return jax.checkpoint(fn, policy=policy)


class Stepper:
    """A donated step and its state, callable with no arguments (for interleaved timing)."""

    def __init__(self, step, state, rest):
        self.step, self.state, self.rest = step, jax.tree.map(jnp.copy, state), rest

    def __call__(self):
        self.state, out = self.step(self.state, self.rest)
        return out


def jax_step(fn, compiler_options=None):
    def step(params, x):
        loss, grads = jax.value_and_grad(fn)(params, x)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), loss

    return jax.jit(step, donate_argnums=0, compiler_options=compiler_options)


def jgraph_step(fn, args, policy=None):
    gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
    graph = jg.remat(gb, policy=policy) if (policy is not None or gb.regions) else gb
    step, split = donated_step(graph)
    return step, split(*args)


def _figures(step, args):
    compiled = step.lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / MIB, compiled.as_text().count(" dot(")


def variants(quick):
    cp = jax.checkpoint_policies
    chain_rows = [("no remat", chain(), chain(), None),
                  ("checkpoint per layer", chain(1), chain(1), None),
                  ("sqrt(N): 6-layer segments", chain(6), chain(6), None),
                  ("policy dots_saveable, whole model", chain(), whole(chain(), cp.dots_saveable),
                   jg.policies.dots_saveable),
                  ("policy everything_saveable, whole model", chain(),
                   whole(chain(), cp.everything_saveable), jg.policies.everything_saveable)]
    block_rows = [("no remat", blocks(), blocks(), None),
                  ("checkpoint per block", blocks(True), blocks(True), None)]
    if quick:
        return [("chain32", chain_args(), chain_rows[:3:2])]
    return [("chain32", chain_args(), chain_rows), ("resmlp16", block_args(), block_rows)]


def model_rows(model, args, specs, quick):
    rows, steppers, figures = [], {}, {}
    for name, jg_fn, jax_fn, policy in specs:
        step, (state, rest) = jgraph_step(jg_fn, args, policy)
        figures[("jgraph", name)] = _figures(step, (state, rest))
        steppers[("jgraph", name)] = Stepper(step, state, rest)
        ref = jax_step(jax_fn)
        figures[("jax", name)] = _figures(ref, args)
        steppers[("jax", name)] = Stepper(ref, args[0], args[1])
    times = interleaved_medians({f"{k[0]}/{k[1]}": s for k, s in steppers.items()},
                                repeats=5 if quick else 15, warmup=1)
    base = times["jax/no remat"]
    for name, *_ in specs:
        (jt, jd), (rt, rd) = figures[("jgraph", name)], figures[("jax", name)]
        tj, tr = times[f"jgraph/{name}"], times[f"jax/{name}"]
        rows.append({"benchmark": f"remat {model} {name}: donated temp MiB", "jgraph": f"{jt:.2f}",
                     "reference": f"{rt:.2f}", "ratio": jt / rt,
                     "note": "reference: jax.checkpoint, same variant"})
        rows.append({"benchmark": f"remat {model} {name}: dots in HLO", "jgraph": jd,
                     "reference": rd, "ratio": jd / rd, "note": "recomputed matmuls survive XLA"})
        rows.append({"benchmark": f"remat {model} {name}: step time",
                     "jgraph": f"{tj * 1e3:.1f} ms", "reference": f"{base * 1e3:.1f} ms",
                     "ratio": tj / base,
                     "note": f"reference: JAX no remat; vs jgraph no remat "
                             f"{tj / times['jgraph/no remat']:.2f}x; jax.checkpoint variant "
                             f"{tr / base:.2f}x"})
    return rows


def rows(quick: bool = False) -> list[dict]:
    out = []
    for model, args, specs in variants(quick):
        out += model_rows(model, args, specs, quick)
    return out


if __name__ == "__main__":
    for row in rows(quick="--quick" in sys.argv):
        print(" | ".join(str(row[k]) if not isinstance(row[k], float) else f"{row[k]:.3f}"
                         for k in ("benchmark", "jgraph", "reference", "ratio", "note")))
