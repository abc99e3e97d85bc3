"""The data, model and training loop shared by tests/test_sharding.py and its children.

Importing this module has no side effects (the children set JAX's device count before importing
it; the test process imports it with its one device).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

RNG = np.random.default_rng(0)
X = RNG.normal(size=(256, 5)).astype(np.float32)
Y = RNG.integers(0, 3, 256).astype(np.int32)
P0 = {"w": (RNG.normal(size=(5, 16)) * 0.5).astype(np.float32),
      "b": np.zeros(16, np.float32),
      "v": (RNG.normal(size=(16, 3)) * 0.5).astype(np.float32)}
FSDP = {"w": P(None, "data"), "b": P("data"), "v": P("data", None)}
TX = optax.adam(1e-2)
BATCH = 8


def layer(w, b, x):
    return jnp.tanh(x @ w + b)


def model(p, x):
    """Two checkpoint regions (what remat=True recomputes)."""
    h = jax.checkpoint(layer)(p["w"], p["b"], x)
    return jax.checkpoint(lambda v, h: h @ v)(p["v"], h)


def train(opt, steps, state=None, start=0):
    """`steps` micro-steps on consecutive batches from micro-step `start`."""
    if state is None:
        state = opt.init(P0, X[:BATCH], Y[:BATCH])
    losses = []
    for i in range(start, start + steps):
        j = i % (len(X) // BATCH)
        state, out = opt.step(state, X[j * BATCH:(j + 1) * BATCH], Y[j * BATCH:(j + 1) * BATCH])
        losses.append(out.loss)
    return state, [float(v) for v in losses]
