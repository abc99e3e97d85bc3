"""A TPU step's fit figure against the smallest HBM size at which it compiles (issue 50).

For the donated steps of `reference/tpu-figures.md` (an 8-layer `tanh(h @ w)` MLP, d 1024, SGD,
batch 4096 and 16384, with and without `jax.checkpoint` per layer; the scanned 8-layer LM of
`bench_max_batch` at vocab 4096 with adam, batch 16 and 64, with and without
`scan(checkpoint(body))`), compiled ahead of time for one TPU v5e chip with the compiler's own
rematerialization off: jgraph's exact figure (`jgraph.memory.hbm.smallest_size`: the compiles it
took and their seconds), its one-compile estimate and its error, `peak_memory_in_bytes`, and the
smallest size the reference measured by bisection. Needs `pip install 'jgraph[tpu]'`.

    JAX_PLATFORMS=cpu python -m benchmarks.bench_fit [--quick]
"""

from __future__ import annotations

import sys
import time
import warnings

import jax
import jax.numpy as jnp
import optax

from benchmarks.bench_max_batch import model as max_batch_model
from jgraph.memory import hbm
from jgraph.target import resolve

MIB = 2**20
# The smallest HBM size (MiB) at which each step compiles, bisected (reference/tpu-figures.md).
REFERENCE = {("mlp", 4096, False): 98, ("mlp", 4096, True): 55, ("mlp", 16384, False): 648,
             ("mlp", 16384, True): 363, ("tlm", 16, False): 615, ("tlm", 16, True): 147,
             ("tlm", 64, False): 2294, ("tlm", 64, True): 354}


def mlp_step(batch: int, remat: bool, target, d: int = 1024, layers: int = 8):
    def layer(h, w):
        return jnp.tanh(h @ w)

    def loss(ws, x):
        h = x
        for w in ws:
            h = (jax.checkpoint(layer) if remat else layer)(h, w)
        return jnp.mean(h**2)

    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        return [w - 1e-3 * g for w, g in zip(ws, grads, strict=True)], value

    sharding = target.sharding(None, True)
    ws = [jax.ShapeDtypeStruct((d, d), jnp.float32, sharding=sharding) for _ in range(layers)]
    x = jax.ShapeDtypeStruct((batch, d), jnp.float32, sharding=sharding)
    return jax.jit(step, donate_argnums=0).lower(ws, x)


def lm_step(batch: int, remat: bool, target):
    plain, params, hand, _ = max_batch_model("scanlm-4096")
    fn = hand["scan(checkpoint(body, nothing_saveable))"] if remat else plain
    tx = optax.adam(1e-3)

    def step(params, state, tokens):
        value, grads = jax.value_and_grad(fn)(params, tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    sharding = target.sharding(None, True)
    place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)  # noqa: E731
    params = jax.tree.map(place, jax.eval_shape(lambda p: p, params))
    state = jax.tree.map(place, jax.eval_shape(tx.init, params))
    tokens = jax.ShapeDtypeStruct((batch, 128), jnp.int32, sharding=sharding)
    return jax.jit(step, donate_argnums=(0, 1)).lower(params, state, tokens)


def main(quick: bool = False):
    from jax.experimental import topologies

    chip = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    target = resolve(chip)
    options = target.compile_options
    compiles = []
    measured = hbm.at_size

    def counted(lowered, options, size_mib=None):
        started = time.perf_counter()
        got = measured(lowered, options, size_mib)
        compiles.append(time.perf_counter() - started)
        return got

    hbm.at_size = counted
    print("| step | exact (MiB) | compiles, s | estimate (MiB), error | peak (MiB) | bisected |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for (kind, batch, remat), reference in REFERENCE.items():
        if quick and batch not in (4096, 16):
            continue
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            lowered = (mlp_step if kind == "mlp" else lm_step)(batch, remat, target)
        compiles.clear()
        size, first = hbm.smallest_size(lowered, options)
        estimate = -(-first.hbm_used // MIB)
        peak = first.compiled.memory_analysis().peak_memory_in_bytes / MIB
        error = estimate / size - 1
        worst = max(worst, error)
        name = f"{kind} {batch}" + (", checkpointed" if remat else "")
        print(f"| {name} | {size} | {len(compiles)}, {sum(compiles):.1f} | {estimate}, "
              f"{error:+.1%} | {peak:.1f} | {reference} |", flush=True)
    print(f"worst estimate error: {worst:+.1%}")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
