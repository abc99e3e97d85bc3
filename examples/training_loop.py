"""The low-level training API: an explicit loop over `jg.Optimizer`, as ggml-opt's alloc/eval.

Shows the three graphs, micro-steps with gradient accumulation, the fused `step_period`, results
with uncertainties, and saving / resuming the whole state mid-period.
Run: `python examples/training_loop.py`.
"""

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jgraph as jg


def model(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 8)).astype(np.float32)
    y = (x[:, 0] * x[:, 1] > 0).astype(np.int32)  # a non-linear two-class problem
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {"w1": jax.random.normal(k1, (8, 32), jnp.float32) * jnp.float32(0.5),
              "b1": jnp.zeros(32, jnp.float32),
              "w2": jax.random.normal(k2, (32, 2), jnp.float32) * jnp.float32(0.5)}
    period, micro = 4, 16
    opt = jg.Optimizer(model, optax.adam(3e-2), loss="cross_entropy", period=period)
    state = opt.init(params, x[:micro], y[:micro])
    print("the grad graph (forward + backward + accumulate):")
    print(opt.graphs["grad"])

    ds = jg.Dataset(x, y)
    key = jax.random.PRNGKey(1)
    for epoch in range(1, 11):
        key, sub = jax.random.split(key)
        ds.shuffle(sub)
        result = jg.Result()
        for ibatch in range(ds.ndata // (period * micro)):
            xs, ys = ds.batch(ibatch, period * micro)
            state, out = opt.step_period(state, xs.reshape(period, micro, 8),
                                         ys.reshape(period, micro))
            result.add(out)
        (loss, unc), (acc, acc_unc) = result.loss(), result.accuracy()
        print(f"epoch {epoch}: loss {loss:.4f} ± {unc:.4f}, accuracy {acc:.3f} ± {acc_unc:.3f}")

    state, _ = opt.step(state, x[:micro], y[:micro])  # stop in the middle of a period ...
    path = Path(tempfile.mkdtemp()) / "state.jgs"
    opt.save(state, path, dataset=ds)
    resumed = opt.load(path, dataset=ds)  # ... and resume from the file, bit for bit
    print(f"saved and reloaded at micro-step {int(resumed.counter)} of {period}: {path}")


if __name__ == "__main__":
    main()
