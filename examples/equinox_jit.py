"""Equinox's CNN-on-MNIST training loop, its whole step planned by jgraph under a budget.

The twin of `examples/equinox.py`: two lines differ from the Equinox tutorial,
`@jg.jit(budget="95%", donate_argnums=(0, 1))` where it has `@eqx.filter_jit`, and
`jg.filter_value_and_grad` where it has `eqx.filter_value_and_grad`. `jg.jit` traces the model's
arrays and keeps its other leaves (activation functions) static, as `filter_jit` does, traces
`make_step` whole into one jgraph graph (the loss's forward and backward, adam), plans it under
95 % of its unplanned temp, and runs it as one `jax.jit` writing the new model and optimizer
state into the donated ones.

    python examples/equinox_jit.py [--steps 300]
"""

import argparse
import os
import sys

# `python examples/equinox_jit.py` puts this folder first on sys.path, where this file would shadow
# the equinox library it shows: look for the library elsewhere.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import equinox as eqx  # noqa: E402 - after the sys.path fix
import jax  # noqa: E402 - after the sys.path fix
import jax.numpy as jnp  # noqa: E402 - after the sys.path fix
import numpy as np  # noqa: E402 - after the sys.path fix
import optax  # noqa: E402 - after the sys.path fix
from sklearn.datasets import load_digits  # noqa: E402 - after the sys.path fix

import jgraph as jg  # noqa: E402 - after the sys.path fix


class CNN(eqx.Module):
    layers: list

    def __init__(self, key):
        key1, key2, key3 = jax.random.split(key, 3)
        # Standard CNN setup: convolutional layer, followed by flattening,
        # with a small MLP on top.
        self.layers = [
            eqx.nn.Conv2d(1, 8, kernel_size=3, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(8 * 5 * 5, 64, key=key2),
            jax.nn.sigmoid,
            eqx.nn.Linear(64, 10, key=key3),
            jax.nn.log_softmax,
        ]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def loss(model, x, y):
    # Our input has the shape (BATCH_SIZE, 1, 8, 8), but our model operates on a single input
    # input image of shape (1, 8, 8). So we use jax.vmap to map our model over the batch.
    pred_y = jax.vmap(model)(x)
    return cross_entropy(y, pred_y)


def cross_entropy(y, pred_y):
    # y are the true targets, and should be integers 0-9.
    # pred_y are the log-softmax'd predictions.
    pred_y = jnp.take_along_axis(pred_y, jnp.expand_dims(y, 1), axis=1)
    return -jnp.mean(pred_y)


@eqx.filter_jit
def compute_accuracy(model, x, y):
    pred_y = jnp.argmax(jax.vmap(model)(x), axis=1)
    return jnp.mean(y == pred_y)


def load_data():
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    return images, digits.target.astype(np.int32)


def batches(x, y, batch_size, seed):
    """Shuffled batches, one epoch after another, forever."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(y))
        for start in range(0, len(y) - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield x[idx], y[idx]


def train(steps=300, batch_size=32, seed=0, log_every=0, learning_rate=3e-3):
    x, y = load_data()
    model = CNN(jax.random.PRNGKey(seed))
    optim = optax.adamw(learning_rate)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    # Always wrap everything -- computing gradients, running the optimiser, updating
    # the model -- into a single JIT region. This ensures things run as fast as
    # possible.
    @jg.jit(budget="95%", donate_argnums=(0, 1))  # the tutorial: @eqx.filter_jit
    def make_step(model, opt_state, x, y):
        loss_value, grads = jg.filter_value_and_grad(loss)(model, x, y)  # eqx.filter_value_...
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss_value

    for step, (xb, yb) in zip(range(1, steps + 1), batches(x, y, batch_size, seed), strict=False):
        model, opt_state, train_loss = make_step(model, opt_state, xb, yb)
        if log_every and step % log_every == 0:
            print(f"step {step}: loss {float(train_loss):.4f}")
    return model, (x, y)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    model, (x, y) = train(args.steps, log_every=50)
    print(f"accuracy on all digits: {float(compute_accuracy(model, x, y)):.3f}")


if __name__ == "__main__":
    main()
