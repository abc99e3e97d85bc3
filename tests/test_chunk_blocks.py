"""`jg.chunk_rows` on attention: the scores and softmax of one block of queries at a time.

Attention written as users write it (by hand with `jnp.tril` or a mask array, `jax.nn.
dot_product_attention`, flax's `MultiHeadDotProductAttention` with `make_causal_mask`, a padding
mask from the data, a sliding window, grouped heads) is found as a block region and compared with
`jax.value_and_grad` and with the unchunked graph (normwise 1e-6: the keys' and values' cotangents
are summed over blocks), with block counts that divide the sequence and counts that do not. The
block rules are checked op by op; attention whose rows are not independent per block of queries
(a softmax over the queries) is not cut along them; a batch with as many examples as chunks runs
over blocks of examples; the compiled temp loses the scores; the planner uses the blocks to meet
a budget recomputation alone does not reach.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from properties import assert_close

import jgraph as jg
from jgraph.chunk.axes import block_params
from jgraph.chunk.rows import NotRowwise

RNG = np.random.default_rng(0)
B, T, H, DH = 1, 20, 2, 4  # scores (t x t per head) larger than the output (t x dh per head)
D = H * DH


def normal(*shape, scale=1.0):
    return jnp.asarray(RNG.standard_normal(shape).astype(np.float32) * scale)


PARAMS = {n: normal(D, D, scale=D**-0.5) for n in ("q", "k", "v", "o")}
X = normal(B, T, D)
CAUSAL = np.tril(np.ones((T, T), bool))


def heads(x, w):
    b, t, _ = x.shape
    return (x @ w).reshape(b, t, H, DH)


def causal_tril(p, x):  # einsum, jnp.tril mask (iotas), softmax, residual
    s = jnp.einsum("bqhd,bkhd->bhqk", heads(x, p["q"]), heads(x, p["k"])) / np.sqrt(DH)
    s = jnp.where(jnp.tril(jnp.ones((x.shape[1],) * 2, bool)), s, -1e9)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), heads(x, p["v"]))
    return jnp.mean((x + o.reshape(x.shape) @ p["o"]) ** 2)


def mask_array(p, x):  # a causal mask given as a numpy array; one head, no reshape
    s = (x @ p["q"]) @ jnp.swapaxes(x @ p["k"], 1, 2)
    s = jnp.where(CAUSAL, s, -jnp.inf)
    return jnp.mean(jnp.tanh(x + jax.nn.softmax(s) @ (x @ p["v"])))


def jax_dpa(p, x):  # jax.nn.dot_product_attention, causal
    o = jax.nn.dot_product_attention(heads(x, p["q"]), heads(x, p["k"]), heads(x, p["v"]),
                                     is_causal=True)
    return jnp.mean((x + o.reshape(x.shape) @ p["o"]) ** 2)


def sliding_window(p, x):  # a local window from iota differences, bidirectional
    s = jnp.einsum("bqhd,bkhd->bhqk", heads(x, p["q"]), heads(x, p["k"]))
    i = jnp.arange(x.shape[1])
    s = jnp.where(jnp.abs(i[:, None] - i[None, :]) <= 3, s, -1e9)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), heads(x, p["v"]))
    return jnp.sum(jnp.sin(o))


def grouped_keys(p, x):  # grouped-query attention: one key/value head shared by H query heads
    b, t, _ = x.shape
    k, v = x @ p["k"][:, :DH], x @ p["v"][:, :DH]
    s = jnp.einsum("bqhd,bkd->bhqk", heads(x, p["q"]), k)
    o = jnp.einsum("bhqk,bkd->bqhd", jax.nn.softmax(s, -1), v)
    return jnp.mean((x + o.reshape(x.shape)) ** 2)


class FlaxBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        return x + nn.MultiHeadDotProductAttention(num_heads=H)(x, mask=mask)


FLAX = FlaxBlock()
FLAX_PARAMS = FLAX.init(jax.random.key(0), X)["params"]


def flax_attention(p, x):
    return jnp.mean(FLAX.apply({"params": p}, x) ** 2)


CASES = [(causal_tril, PARAMS), (mask_array, PARAMS), (jax_dpa, PARAMS),
         (sliding_window, PARAMS), (grouped_keys, PARAMS), (flax_attention, FLAX_PARAMS)]


def relative_error(got, want) -> float:
    got, want = (np.concatenate([np.ravel(a) for a in jax.tree.leaves(t)]) for t in (got, want))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


RUNS = [(fn, params, chunks) for fn, params in CASES  # 3 blocks of 7, 7, 6; 4 of 5
        for chunks in ([3, 4] if fn is causal_tril else [3])]
# blocks that divide the positions: opt-in here (`-m slow`); by default
# `test_a_padded_batch_with_a_loss_head_chunks_both` runs 4 blocks of 5 against JAX
OPT_IN = {(causal_tril, 4)}  # opt-in (`-m slow`)
EXTENDED = {(causal_tril, 3)}  # `.ci/run`'s extended stage


@pytest.mark.parametrize("fn, params, chunks", [
    pytest.param(*r, marks=pytest.mark.slow) if (r[0], r[2]) in OPT_IN else
    pytest.param(*r, marks=pytest.mark.extended) if (r[0], r[2]) in EXTENDED else r for r in RUNS],
    ids=[f"{fn.__name__}-{chunks}" for fn, _, chunks in RUNS])
def test_attention_runs_over_blocks_of_queries(fn, params, chunks):
    gb = jg.backward(jg.trace(fn, params, X, param_argnums=0))
    gc = jg.check(jg.chunk_rows(gb, chunks=chunks))
    (region,) = [r for r in gc.info["chunk_rows"]["regions"] if r["kind"] == "blocks"]
    size = -(-T // chunks)
    assert region["chunk_rows"] == size and region["remainder"] == T % size
    assert region["chunks"] == chunks and region["rows"][region["axis"]] == T
    assert region["read_whole"], region  # the keys (and values) read whole by every block
    want = jax.jit(jax.value_and_grad(fn))(params, X)
    assert relative_error(jg.compile(gc)(params, X), want) < 1e-6
    if fn is causal_tril and chunks == 3:  # interpreted, eqn by eqn (a smaller last block)
        assert relative_error(jg.evaluate(gc, params, X), jg.evaluate(gb, params, X)) < 1e-6


def padded_lm(p, x, keep, y):  # a padding mask from the data and a loss head over a vocabulary
    s = jnp.einsum("bqhd,bkhd->bhqk", heads(x, p["q"]), heads(x, p["k"])) / np.sqrt(DH)
    s = jnp.where(keep[:, None, None, :] & jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    h = x + jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), heads(x, p["v"])).reshape(x.shape)
    ce = optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], y)
    return jnp.sum(ce * keep) / jnp.sum(keep)


def test_a_padded_batch_with_a_loss_head_chunks_both():
    p = {**PARAMS, "out": normal(D, 32)}
    x = normal(3, T, D)
    keep = jnp.asarray(np.arange(T)[None, :] < np.array([[T], [T - 5], [7]]))
    y = jnp.asarray(RNG.integers(0, 32, (3, T)), jnp.int32)
    gb = jg.backward(jg.trace(padded_lm, p, x, keep, y, param_argnums=0))
    gc = jg.check(jg.chunk_rows(gb, chunks=4))
    kinds = sorted(r["kind"] for r in gc.info["chunk_rows"]["regions"])
    assert kinds == ["blocks", "head"], gc.info["chunk_rows"]
    want = jax.jit(jax.value_and_grad(padded_lm))(p, x, keep, y)
    assert relative_error(jg.compile(gc)(p, x, keep, y), want) < 1e-6


def test_a_batch_at_least_as_long_as_the_chunks_runs_over_blocks_of_examples():
    """With as many examples as chunks, a block is a few whole examples: its contractions are
    as wide as the whole's (blocks of queries contract a few rows at a time, slowly) and its
    keys and values are cut into blocks too, not read whole; the scores still leave the temp."""
    t, b = 64, 8
    p = {**PARAMS, "out": normal(D, 32)}
    x = normal(b, t, D)
    keep = jnp.asarray(np.arange(t)[None, :] < RNG.integers(t // 2, t + 1, (b, 1)))
    y = jnp.asarray(RNG.integers(0, 32, (b, t)), jnp.int32)

    def lm(p, x, keep, y):  # a padding mask from the data, a loss head over a vocabulary
        s = jnp.einsum("bqhd,bkhd->bhqk", heads(x, p["q"]), heads(x, p["k"])) / np.sqrt(DH)
        s = jnp.where(keep[:, None, None, :] & jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), heads(x, p["v"]))
        h = x + o.reshape(x.shape) @ p["o"]
        ce = optax.softmax_cross_entropy_with_integer_labels(h @ p["out"], y)
        return jnp.sum(ce * keep) / jnp.sum(keep)

    gb = jg.backward(jg.trace(lm, p, x, keep, y, param_argnums=0))
    gc = jg.check(jg.chunk_rows(gb, chunks=4))
    (region,) = [r for r in gc.info["chunk_rows"]["regions"] if r["kind"] == "blocks"]
    assert region["axis"] == 0 and region["chunks"] == 4 and region["chunk_rows"] == 2, region
    assert region["read_whole"] == [], region
    want = jax.jit(jax.value_and_grad(lm))(p, x, keep, y)
    assert relative_error(jg.compile(gc)(p, x, keep, y), want) < 1e-6
    queries = jg.check(jg.chunk_rows(gb, chunks=16))  # more chunks than examples: queries
    (region,) = [r for r in queries.info["chunk_rows"]["regions"] if r["kind"] == "blocks"]
    assert region["axis"] == 1 and region["read_whole"], region
    whole = jg.compiled_memory(gb, p, x, keep, y).temp_bytes
    blocks = jg.compiled_memory(gc, p, x, keep, y).temp_bytes
    scores = b * H * t * t * 4
    assert blocks + scores < whole, (blocks, whole, scores)


def softmax_over_queries(p, x):  # each key's weights normalised over the queries: blocks mix
    s = jnp.einsum("bqhd,bkhd->bhqk", heads(x, p["q"]), heads(x, p["k"]))
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -2), heads(x, p["v"]))
    return jnp.mean((x + o.reshape(x.shape)) ** 2)


def short_sequence(p, x):  # scores no larger than the output: nothing to gain
    return causal_tril(p, x[:, :DH])


@pytest.mark.parametrize("fn", [softmax_over_queries, short_sequence])
def test_attention_whose_blocks_are_not_independent_or_small_is_left_alone(fn):
    gb = jg.backward(jg.trace(fn, PARAMS, X, param_argnums=0))
    gc = jg.check(jg.chunk_rows(gb, chunks=4))
    found = [r for r in gc.info["chunk_rows"]["regions"] if r["kind"] == "blocks"]
    if fn is softmax_over_queries:  # the heads are independent still: blocks of heads
        assert [r["axis"] for r in found] in ([], [2]), found
    else:
        assert not found
    want = jax.jit(jax.value_and_grad(fn))(PARAMS, X)
    assert relative_error(jg.compile(gc)(PARAMS, X), want) < 1e-6


def test_the_compiled_temp_loses_the_scores():
    t = 512
    x = normal(1, t, D)
    gb = jg.backward(jg.trace(causal_tril, PARAMS, x, param_argnums=0))
    gc = jg.chunk_rows(gb, chunks=8)
    whole = jg.compiled_memory(gb, PARAMS, x).temp_bytes
    blocks = jg.compiled_memory(gc, PARAMS, x).temp_bytes
    scores = H * t * t * 4
    assert blocks + 2 * scores < whole, (blocks, whole, scores)  # scores and their cotangent


def test_a_budget_recomputation_does_not_reach_is_met_with_blocks():
    t = 256
    x = normal(1, t, D)
    gb = jg.backward(jg.trace(causal_tril, PARAMS, x, param_argnums=0))
    budget = int(0.4 * jg.compiled_memory(gb, PARAMS, x).temp_bytes)
    with pytest.raises(jg.TransformError, match="no plan fits"):
        jg.remat(gb, budget=budget, chunks=None)
    gr = jg.remat(gb, budget=budget)
    report = gr.info["remat"]
    assert report["xla_temp"] <= budget
    assert any(r["kind"] == "blocks" for r in report["chunked"]), report
    want = jax.jit(jax.value_and_grad(causal_tril))(PARAMS, x)
    assert relative_error(jg.compile(gr)(PARAMS, x), want) < 1e-6


def _op_eqn(fn, op, *args):
    (eqn,) = [e for e in jg.trace(fn, *args).eqns if e.op == op][-1:]
    return eqn


BLOCK_CASES = [  # (name, fn, args, op, output block axis, input axes or None when it mixes)
    ("transpose", lambda a: a.transpose(2, 0, 1), (normal(2, 3, 4),), "transpose", 0, (2,)),
    ("dot-lhs-free", lambda a, b: jnp.einsum("bqd,bkd->bqk", a, b), (normal(2, 5, 3),) * 2,
     "dot_general", 1, (1, None)),
    ("dot-rhs-free", lambda a, b: jnp.einsum("bqd,bkd->bqk", a, b), (normal(2, 5, 3),) * 2,
     "dot_general", 2, (None, 1)),
    ("dot-batch", lambda a, b: jnp.einsum("bqd,bkd->bqk", a, b), (normal(2, 5, 3),) * 2,
     "dot_general", 0, (0, 0)),
    ("reshape-split-heads", lambda a: a.reshape(2, 5, 3, 2), (normal(2, 5, 6),), "reshape", 1,
     (1,)),
    ("reshape-merging", lambda a: a.reshape(10, 6), (normal(2, 5, 6),), "reshape", 0, None),
    ("reduce-keeps", lambda a: a.max(-1), (normal(2, 5, 6),), "reduce_max", 1, (1,)),
    ("broadcast-size-1", lambda a: a + jnp.ones((1, 5, 6)), (normal(1, 1, 6),),
     "broadcast_in_dim", 1, (None,)),
    ("elementwise-broadcast", lambda a, b: a / b.sum(-1, keepdims=True), (normal(2, 5, 6),) * 2,
     "div", 1, (1, 1)),
    ("cumsum-along", lambda a: jnp.cumsum(a, 1), (normal(2, 5),), "cumsum", 1, None),
    ("cumsum-across", lambda a: jnp.cumsum(a, 1), (normal(2, 5),), "cumsum", 0, (0,)),
    ("slice-part", lambda a: a[:, 1:], (normal(2, 5),), "slice", 1, None),
    ("iota-along", lambda a: a + jnp.arange(5), (normal(2, 5),), "iota", 0, ()),
]


@pytest.mark.parametrize("fn, args, op, axis, in_axes", [c[1:] for c in BLOCK_CASES],
                         ids=[c[0] for c in BLOCK_CASES])
def test_block_rules(fn, args, op, axis, in_axes):
    eqn = _op_eqn(fn, op, *args)
    if in_axes is None:
        with pytest.raises(NotRowwise):
            block_params(eqn, axis, 2)
        return
    params, got, adds = block_params(eqn, axis, 2)
    assert got == in_axes
    assert adds == (op == "iota")
    blocks = [a if ax is None else jg.Var(a.aval.update(shape=tuple(
        2 if d == ax else n for d, n in enumerate(a.aval.shape)))) for a, ax in zip(
        eqn.inputs, got, strict=True)]
    (out,) = jg.builder.Builder().bind(op, *blocks, **params)  # fits its op's shape rule
    want = list(eqn.outputs[0].aval.shape)
    want[axis] = 2
    assert out.aval.shape == tuple(want)


@settings(max_examples=4, derandomize=True, deadline=None)
@given(b=st.integers(1, 2), t=st.integers(5, 13), h=st.integers(1, 3), dh=st.integers(1, 3),
       chunks=st.integers(2, 5), mask=st.sampled_from(["none", "causal", "window", "array"]),
       scale=st.floats(0.1, 2.0))
def test_random_attention_shapes_and_masks_as_they_run_whole(b, t, h, dh, chunks, mask, scale):
    """Shapes, masks, block counts and scales drawn; the chunked graph computes what the whole
    one does; with more positions than head width the blocks are found."""
    d = h * dh
    p = {n: normal(d, d, scale=scale * d**-0.5) for n in ("q", "k", "v")}
    x = normal(b, t, d)
    fixed = np.triu(np.ones((t, t), bool), -2)

    def loss(p, x):
        split = [(x @ p[n]).reshape(b, t, h, dh) for n in ("q", "k", "v")]
        s = jnp.einsum("bqhd,bkhd->bhqk", split[0], split[1])
        i = jnp.arange(t)
        allowed = {"none": None, "causal": i[:, None] >= i[None, :],
                   "window": jnp.abs(i[:, None] - i[None, :]) < 3, "array": fixed}[mask]
        if allowed is not None:
            s = jnp.where(allowed, s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), split[2])
        return jnp.mean(jnp.cos(x + o.reshape(b, t, d)))

    gb = jg.backward(jg.trace(loss, p, x, param_argnums=0))
    gc = jg.check(jg.chunk_rows(gb, chunks=chunks))
    found = [r for r in gc.info["chunk_rows"]["regions"] if r["kind"] == "blocks"]
    if t > dh and b == 1:  # (with more examples the batch may be chunked as a head instead)
        assert found, gc.info["chunk_rows"]
    assert_close(jg.compile(gc)(p, x), jg.compile(gb)(p, x), 2e-5)
