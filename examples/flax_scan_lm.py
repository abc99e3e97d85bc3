"""A GPT-style language model in flax linen, its blocks stacked with `nn.scan`, trained in a loop.

The way a flax user writes a deep LM: token and position embeddings, `--layers` pre-LayerNorm
transformer blocks (causal self-attention, a GELU MLP) stacked with `nn.scan` (one block's
params with a leading layer axis, run as one `lax.scan`), a final LayerNorm and an output head
tied to the token embedding (`embed.attend`, as GPT-2 has it); the loss is the mean next-token
cross-entropy. The state is a flax `TrainState` with optax's adam, and the loop is a plain Python
loop calling a `@jax.jit` `train_step(state, batch)`. One line differs from the JAX version:
`jg.value_and_grad` where it has `jax.value_and_grad`, so jgraph traces the loss (the scan
included) and differentiates it with its own rules. `examples/flax_scan_lm_jit.py` is the same
loop with its whole step planned by `jg.jit`.

The data are synthetic, so nothing is downloaded: each sequence follows a fixed random successor
table over the vocabulary (a token's next token is its successor, except where a seeded coin
draws a random one), which the model learns: at the defaults the loss falls from 6.8 (log(vocab)
is 6.2) to 3.2 in 100 steps.

    python examples/flax_scan_lm.py [--steps 200] [--vocab 512] [--layers 4] [--batch 8]
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


@jax.jit
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
