"""Flax NNX's MNIST tutorial loop, its whole step planned by jgraph under a budget.

The twin of `examples/flax_nnx.py`: two lines differ from the Flax NNX tutorial's loop,
`@jg.jit(budget="95%", donate_argnums=(0, 1, 2))` where it has `@nnx.jit` on `train_step`, and
`jg.value_and_grad` where it has `nnx.value_and_grad`. `jg.jit` splits the model, the
`nnx.Optimizer` and the `nnx.MultiMetric` into their states as `nnx.jit` does, traces
`train_step` whole into one jgraph graph (the loss's forward and backward, adamw's update in
`optimizer.update`, the metrics' sums), plans it under 95 % of its unplanned temp (at batch 32 a
checkpoint per layer, 6 % less), runs it as one `jax.jit` writing the new states into the donated
buffers, and updates the three objects in place, as `nnx.jit` does.

    python examples/flax_nnx_jit.py [--steps 300]
"""

import argparse

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import jgraph as jg


class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(4 * 4 * 32, 64, rngs=rngs)
        self.linear2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), window_shape=(2, 2), strides=(2, 2))
        x = nnx.relu(self.conv2(x))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.linear1(x))
        return self.linear2(x)


def loss_fn(model: CNN, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]).mean()
    return loss, logits


@jg.jit(budget="95%", donate_argnums=(0, 1, 2))  # the tutorial: @nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    """Train for a single step."""
    grad_fn = jg.value_and_grad(loss_fn, has_aux=True)  # the tutorial: nnx.value_and_grad
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])  # In-place updates.
    optimizer.update(model, grads)  # In-place updates.


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
    loss, logits = loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


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
            yield {k: jnp.asarray(v[idx]) for k, v in data.items()}


def train(steps=300, batch_size=32, seed=0, log_every=0):
    data = load_data()
    model = CNN(rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(learning_rate=0.005, b1=0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    for step, batch in zip(range(1, steps + 1), batches(data, batch_size, seed), strict=False):
        train_step(model, optimizer, metrics, batch)
        if log_every and step % log_every == 0:
            computed = metrics.compute()
            print(f"step {step}: loss {float(computed['loss']):.4f}, "
                  f"accuracy {float(computed['accuracy']):.3f}")
            metrics.reset()
    return model, data


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    model, data = train(args.steps, log_every=50)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    eval_step(model, metrics, {k: jnp.asarray(v) for k, v in data.items()})
    print(f"accuracy on all digits: {float(metrics.compute()['accuracy']):.3f}")


if __name__ == "__main__":
    main()
