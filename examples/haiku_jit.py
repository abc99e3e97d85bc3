"""Haiku's MNIST training loop, its whole update planned by jgraph under a budget.

The twin of `examples/haiku.py`: two lines differ from Haiku's example,
`@jg.jit(budget="95%", donate_argnums=(0, 1))` where it has `@jax.jit` on `update`, and `jg.grad`
where it has `jax.grad`. `jg.jit` traces `update` whole into one jgraph graph (the loss's forward
and backward, the weight decay, adam), plans it under 95 % of its unplanned temp (at batch 32 the
activations are a small part of it: recomputation saves 8 %), and runs it as one `jax.jit`
writing the new params and optimizer state into the donated ones.

    python examples/haiku_jit.py [--steps 300]
"""

import argparse
import os
import sys

# `python examples/haiku_jit.py` puts this folder first on sys.path, where this file would shadow
# the haiku library it shows: look for the library elsewhere.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import haiku as hk  # noqa: E402 - after the sys.path fix
import jax  # noqa: E402 - after the sys.path fix
import jax.numpy as jnp  # noqa: E402 - after the sys.path fix
import numpy as np  # noqa: E402 - after the sys.path fix
import optax  # noqa: E402 - after the sys.path fix
from sklearn.datasets import load_digits  # noqa: E402 - after the sys.path fix

import jgraph as jg  # noqa: E402 - after the sys.path fix

NUM_CLASSES = 10


def net_fn(images):
    mlp = hk.Sequential([
        hk.Flatten(),
        hk.Linear(128), jax.nn.relu,
        hk.Linear(64), jax.nn.relu,
        hk.Linear(NUM_CLASSES),
    ])
    return mlp(images)


net = hk.without_apply_rng(hk.transform(net_fn))
opt = optax.adam(1e-3)


def loss(params, batch):
    logits = net.apply(params, batch["image"])
    labels = jax.nn.one_hot(batch["label"], NUM_CLASSES)
    l2_loss = 0.5 * sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))
    softmax_xent = -jnp.sum(labels * jax.nn.log_softmax(logits))
    softmax_xent /= labels.shape[0]
    return softmax_xent + 1e-4 * l2_loss


@jax.jit
def accuracy(params, batch):
    predictions = net.apply(params, batch["image"])
    return jnp.mean(jnp.argmax(predictions, axis=-1) == batch["label"])


@jg.jit(budget="95%", donate_argnums=(0, 1))  # Haiku's example: @jax.jit
def update(params, opt_state, batch):
    grads = jg.grad(loss)(params, batch)  # Haiku's example: jax.grad
    updates, opt_state = opt.update(grads, opt_state)
    new_params = optax.apply_updates(params, updates)
    return new_params, opt_state


def load_data():
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    return {"image": images, "label": digits.target.astype(np.int32)}


def batches(data, batch_size, seed):
    """Shuffled batches, one epoch after another, forever."""
    rng = np.random.default_rng(seed)
    n = len(data["label"])
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield {k: v[idx] for k, v in data.items()}


def train(steps=300, batch_size=32, seed=0, log_every=0):
    data = load_data()
    params = net.init(jax.random.PRNGKey(seed), data["image"][:1])
    opt_state = opt.init(params)
    for step, batch in zip(range(1, steps + 1), batches(data, batch_size, seed), strict=False):
        params, opt_state = update(params, opt_state, batch)
        if log_every and step % log_every == 0:
            print(f"step {step}: loss {float(loss(params, batch)):.4f}")
    return params, data


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    params, data = train(args.steps, log_every=50)
    print(f"accuracy on all digits: {float(accuracy(params, data)):.3f}")


if __name__ == "__main__":
    main()
