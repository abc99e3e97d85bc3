"""Flax linen's quick-start training loop, its whole step planned by jgraph under a budget.

The twin of `examples/flax_linen.py`: two lines differ from the Flax tutorial's loop,
`@jg.jit(budget="95%", donate_argnums=0)` where it has `@jax.jit`, and `jg.value_and_grad` where
it has `jax.value_and_grad`. `jg.jit` traces `train_step` whole into one jgraph graph (the loss's
forward and backward, the optax update of `apply_gradients`, the accuracy), plans it under 95 %
of its unplanned temp (at batch 32 the activations are a small part of this step: a checkpoint
per layer saves 6 %), and runs it as one `jax.jit` writing the new state into the donated one.

    python examples/flax_linen_jit.py [--steps 300]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state
from sklearn.datasets import load_digits

import jgraph as jg


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=16, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=64)(x)
        x = nn.relu(x)
        return nn.Dense(features=10)(x)


def create_train_state(module, rng, learning_rate, momentum):
    params = module.init(rng, jnp.ones([1, 8, 8, 1]))["params"]
    tx = optax.sgd(learning_rate, momentum)
    return train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)


@jg.jit(budget="95%", donate_argnums=0)  # the tutorial: @jax.jit
def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["image"])
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits=logits, labels=batch["label"]).mean()
        return loss, logits

    grad_fn = jg.value_and_grad(loss_fn, has_aux=True)  # the tutorial: jax.value_and_grad
    (loss, logits), grads = grad_fn(state.params)
    state = state.apply_gradients(grads=grads)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return state, loss, accuracy


@jax.jit
def eval_step(state, batch):
    logits = state.apply_fn({"params": state.params}, batch["image"])
    return jnp.mean(jnp.argmax(logits, -1) == batch["label"])


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
    state = create_train_state(CNN(), jax.random.PRNGKey(seed), learning_rate=0.05,
                               momentum=0.9)
    for step, batch in zip(range(1, steps + 1), batches(data, batch_size, seed), strict=False):
        state, loss, accuracy = train_step(state, batch)
        if log_every and step % log_every == 0:
            print(f"step {step}: loss {float(loss):.4f}, batch accuracy {float(accuracy):.3f}")
    return state, data


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    state, data = train(args.steps, log_every=50)
    print(f"accuracy on all digits: {float(eval_step(state, data)):.3f}")


if __name__ == "__main__":
    main()
