"""A GPT-style LM in flax linen (`nn.scan`, `TrainState`), its whole step planned by jgraph.

The twin of `examples/flax_scan_lm.py`: two lines differ from the JAX version of that loop,
`@jg.jit(budget="99%", donate_argnums=0)` where it has `@jax.jit`, and `jg.value_and_grad` where
it has `jax.value_and_grad`. `jg.jit` traces `train_step` whole into one jgraph graph (the
forward of the scanned blocks and the tied head, their backward, adam's update in
`apply_gradients`), plans it under 99 % of its unplanned temp, and runs it as one `jax.jit`
writing the new state into the donated one. The plan recomputes nothing: it moves adam's update
of every param (20 leaves) into the backward, each layer's slice of the stacked params updated
in the backward scan's step that makes its gradient, so the stacked gradients are never made.
At the default sizes on CPU (vocab 512, 4 layers, width 64, batch 8 x 32 tokens) XLA's temp of
the step is 10.6 MB against `jax.jit`'s 11.0; no sum changes, so it trains to the JAX version's
params bitwise (`tests/test_dropin_examples.py`). `train_step.info(state, batch)["remat"]`
reports the plan.

A lower budget buys more: at "50%" the backward scan also keeps only its body's contractions and
recomputes the rest (5.4 MB). The recomputed muls and exps are then compiled by XLA:CPU into
other fusions than the forward's, which rounds differently (`jax.checkpoint` with
`dots_saveable` on the scanned block changes the same bits), so the params agree to about 1e-6
normwise instead of bitwise.

    python examples/flax_scan_lm_jit.py [--steps 200] [--vocab 512] [--layers 4] [--batch 8]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

import jgraph as jg


class Block(nn.Module):
    """One pre-LN transformer block, in `nn.scan`'s form: (carry, input) -> (carry, output)."""

    heads: int
    width: int

    @nn.compact
    def __call__(self, x, _):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y, mask=mask)
        y = nn.LayerNorm()(x)
        y = nn.Dense(4 * self.width)(y)
        x = x + nn.Dense(self.width)(nn.gelu(y))
        return x, None


class LM(nn.Module):
    vocab: int
    width: int
    heads: int
    layers: int
    length: int  # the longest sequence (the position embedding's rows)
    block: type = Block  # the scanned layer; `nn.remat(Block, ...)` recomputes it in the backward

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.width)
        positions = nn.Embed(self.length, self.width)
        x = embed(tokens) + positions(jnp.arange(tokens.shape[1]))
        blocks = nn.scan(self.block, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=self.layers)
        x, _ = blocks(self.heads, self.width, name="blocks")(x, None)  # named: any `block`
        return embed.attend(nn.LayerNorm()(x))  # the head tied to the embedding


def create_train_state(module, rng, learning_rate, length):
    params = module.init(rng, jnp.zeros([1, length], jnp.int32))["params"]
    tx = optax.adam(learning_rate)
    return train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)


def next_token_loss(apply_fn, params, batch):
    """The mean cross-entropy of the logits at each of `batch`'s tokens against the next token."""
    logits = apply_fn({"params": params}, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch[:, 1:]).mean()


@jg.jit(budget="99%", donate_argnums=0)  # the JAX version: @jax.jit
def train_step(state, batch):
    def loss_fn(params):
        return next_token_loss(state.apply_fn, params, batch)

    grad_fn = jg.value_and_grad(loss_fn)  # the JAX version: jax.value_and_grad
    loss, grads = grad_fn(state.params)
    state = state.apply_gradients(grads=grads)
    return state, loss


def batches(vocab, batch_size, length, seed, noise=0.1):
    """Batches of `length + 1` tokens (inputs and their next tokens), forever: each sequence
    follows one fixed random successor table from a random first token; with probability
    `noise` a token is drawn at random instead."""
    rng = np.random.default_rng(seed)
    successor = rng.permutation(vocab)
    while True:
        seq = np.empty((batch_size, length + 1), np.int32)
        seq[:, 0] = rng.integers(vocab, size=batch_size)
        for t in range(1, length + 1):
            random = rng.integers(vocab, size=batch_size)
            seq[:, t] = np.where(rng.random(batch_size) < noise, random, successor[seq[:, t - 1]])
        yield seq


def train(steps=200, vocab=512, width=64, heads=4, layers=4, length=32, batch_size=8, seed=0,
          learning_rate=3e-3, log_every=0):
    """Train for `steps` steps; returns the final `TrainState` and the last loss."""
    model = LM(vocab=vocab, width=width, heads=heads, layers=layers, length=length)
    state = create_train_state(model, jax.random.PRNGKey(seed), learning_rate, length)
    loss = None
    for step, batch in zip(range(1, steps + 1), batches(vocab, batch_size, length, seed),
                           strict=False):
        state, loss = train_step(state, batch)
        if log_every and step % log_every == 0:
            print(f"step {step}: loss {float(loss):.4f}")
    return state, loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    state, loss = train(args.steps, vocab=args.vocab, width=args.width, heads=args.heads,
                        layers=args.layers, length=args.length, batch_size=args.batch,
                        log_every=20)
    print(f"final loss {float(loss):.4f} (log(vocab) = {np.log(args.vocab):.4f})")


if __name__ == "__main__":
    main()
