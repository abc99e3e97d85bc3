"""The expert's step `bench_max_batch` measures jgraph against (issue 43): the LMs' loss head
written by hand in checkpointed chunks of rows (`bench_planner.lm_head_loss`), as a JAX user
training with a large vocabulary writes it. It must be the same loss and gradients as the head
written whole, and hold less memory where the logits dominate."""

import jax
import numpy as np
import optax
import pytest

from benchmarks.bench_planner import scanned_lm, scanned_lm_args, transformer, transformer_args

pytestmark = pytest.mark.extended  # a benchmark's reference, checked after the default suite

SIZES = {"layers": 2, "d": 32, "seq": 16, "batch": 4, "vocab": 2048}


def _args(kind):
    if kind == "scanned":
        return scanned_lm_args(**SIZES)
    return transformer_args(**SIZES)


@pytest.mark.parametrize("kind", ["scanned", "unrolled"])
def test_the_hand_chunked_head_is_the_same_loss_and_gradients(kind):
    params, tokens = _args(kind)
    build = scanned_lm if kind == "scanned" else transformer
    whole = jax.jit(jax.value_and_grad(build(jax.checkpoint)))(params, tokens)
    chunked = jax.jit(jax.value_and_grad(build(jax.checkpoint, head_chunks=8)))(params, tokens)
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(chunked[1]), jax.tree.leaves(whole[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_hand_chunked_head_holds_a_chunk_of_logits():
    """The donated adam step's temp (XLA:CPU) with the head in 8 chunks is well under the one
    with the head whole: the batch's logits (4 x 16 x 2048 floats, 512 KiB) never all exist."""
    params, tokens = _args("scanned")
    opt = optax.adam(1e-3)

    def temp(loss):
        def step(params, state, tokens):
            value, grads = jax.value_and_grad(loss)(params, tokens)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt.init(params), tokens)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    whole = temp(scanned_lm(jax.checkpoint))
    chunked = temp(scanned_lm(jax.checkpoint, head_chunks=8))
    logits = SIZES["batch"] * SIZES["seq"] * SIZES["vocab"] * 4
    assert chunked <= whole - logits // 2, (chunked, whole)
