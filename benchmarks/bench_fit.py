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

import jax
import jax.numpy as jnp

from benchmarks.bench_accelerators import jax_lowered
from benchmarks.bench_max_batch import model as max_batch_model
from jgraph.memory import hbm
from jgraph.target import resolve

MIB = 2**20
# The smallest HBM size (MiB) at which each step compiles, bisected (reference/tpu-figures.md).
REFERENCE = {("mlp", 4096, False): 98, ("mlp", 4096, True): 55, ("mlp", 16384, False): 648,
             ("mlp", 16384, True): 363, ("tlm", 16, False): 615, ("tlm", 16, True): 147,
             ("tlm", 64, False): 2294, ("tlm", 64, True): 354}


def mlp_loss(remat: bool):
    """The 8-layer `tanh(h @ w)` MLP's loss; with `remat`, `jax.checkpoint` per layer."""
    def layer(h, w):
        return jnp.tanh(h @ w)

    def loss(ws, x):
        h = x
        for w in ws:
            h = (jax.checkpoint(layer) if remat else layer)(h, w)
        return jnp.mean(h**2)

    return loss


def step(kind: str, batch: int, remat: bool, target):
    """JAX's donated step of the case, lowered for `target` (`bench_accelerators.jax_lowered`)."""
    if kind == "mlp":
        ws = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32)] * 8
        args = (ws, jax.ShapeDtypeStruct((batch, 1024), jnp.float32))
        return jax_lowered(mlp_loss(remat), args, "sgd", target)
    plain, params, hand, _ = max_batch_model("scanlm-4096")
    fn = hand["scan(checkpoint(body, nothing_saveable))"] if remat else plain
    args = (jax.eval_shape(lambda p: p, params), jax.ShapeDtypeStruct((batch, 128), jnp.int32))
    return jax_lowered(fn, args, "adam", target)


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
        lowered = step(kind, batch, remat, target)
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
