"""A scanned layer run over chunks of examples (`jg.chunk_rows(..., examples=True)`,
`jgraph.chunk.examples`): the same loss and gradients as JAX's, one chunk's working set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgraph as jg


def _layer(p, x, heads=2):
    """A pre-norm transformer layer with a causal mask, as flax and haiku users write one."""
    b, t, d = x.shape

    def norm(g, v):
        v = v - v.mean(-1, keepdims=True)
        return g * v * jax.lax.rsqrt((v * v).mean(-1, keepdims=True) + 1e-5)

    q, k, v = (a.reshape(b, t, heads, d // heads)
               for a in jnp.split(norm(p["ln1"], x) @ p["wqkv"], 3, -1))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // heads) ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, d)
    x = x + a @ p["wo"]
    return x + jax.nn.gelu(norm(p["ln2"], x) @ p["w1"]) @ p["w2"]


def _lm(layers=2, d=32, t=16, batch=8, vocab=64, per_layer=None):
    """(loss, params, tokens): a scanned LM; `per_layer`: what its body also returns per layer
    ("rows": each example's mean activation, "weights": the layer's weight norm)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(7), 12))

    def w(*shape):
        return jax.random.normal(next(keys), shape) * shape[-2] ** -0.5

    params = {"embed": w(vocab, d), "layers": {
        "ln1": jnp.ones((layers, d)), "wqkv": w(layers, d, 3 * d), "wo": w(layers, d, d),
        "ln2": jnp.ones((layers, d)), "w1": w(layers, d, 4 * d), "w2": w(layers, 4 * d, d)}}
    tokens = jax.random.randint(next(keys), (batch, t), 0, vocab)

    def body(x, p):
        x = _layer(p, x)
        if per_layer == "rows":
            return x, x.mean((1, 2))
        if per_layer == "weights":
            return x, jnp.sum(p["w1"] ** 2)
        return x, None

    def loss(params, tokens):
        x, extra = jax.lax.scan(body, params["embed"][tokens], params["layers"])
        logits = x @ params["embed"].T
        out = -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
        return out if extra is None else out + 0.1 * jnp.sum(extra**2)

    return loss, params, tokens


def _joint(loss, params, tokens, **backward):
    return jg.backward(jg.trace(loss, params, tokens, param_argnums=0), **backward)


def _assert_as_jax(graph, loss, params, tokens):
    got = jg.compile(graph)(params, tokens)
    want = jax.value_and_grad(loss)(params, tokens)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def _scans_left(graph):
    """Why each scan's body was not run over chunks of examples."""
    return [w for w in graph.info["chunk_rows"]["examples_left"] if w.startswith("scan")]


def _examples(graph):
    return [r for r in graph.info["chunk_rows"]["regions"] if r["kind"] == "examples"]


@pytest.mark.parametrize("batch, chunks, size, remainder", [(8, 4, 2, 0), (10, 4, 3, 1)])
def test_a_scanned_layer_over_chunks_of_examples_computes_jaxs_gradients(batch, chunks, size,
                                                                         remainder):
    loss, params, tokens = _lm(batch=batch)
    chunked = jg.chunk_rows(_joint(loss, params, tokens), chunks, examples=True)
    (region,) = _examples(chunked)
    assert (region["chunk_rows"], region["remainder"], region["in"]) == (size, remainder, "scan")
    assert region["rows"] == (batch, 16)
    jg.check(chunked)
    _assert_as_jax(chunked, loss, params, tokens)


def test_the_layers_own_loop_policy_is_kept_and_the_gradients_too():
    loss, params, tokens = _lm()
    gb = _joint(loss, params, tokens, loop_policy=jax.checkpoint_policies.nothing_saveable)
    chunked = jg.chunk_rows(gb, 4, examples=True)
    assert _examples(chunked) and chunked.info["loop_policy"] is not None
    _assert_as_jax(chunked, loss, params, tokens)


def test_a_weight_as_long_as_the_batch_is_read_whole_in_every_chunk():
    """d = batch: the weights' leading axes have the batch's size; which values carry the
    examples is followed from the carries, so the weights stay whole."""
    loss, params, tokens = _lm(d=16, batch=16, t=8)
    chunked = jg.chunk_rows(_joint(loss, params, tokens), 4, examples=True)
    assert _examples(chunked)
    _assert_as_jax(chunked, loss, params, tokens)


def test_a_body_returning_a_value_per_example_per_layer_is_chunked_too():
    loss, params, tokens = _lm(per_layer="rows")
    chunked = jg.chunk_rows(_joint(loss, params, tokens), 4, examples=True)
    assert _examples(chunked)
    _assert_as_jax(chunked, loss, params, tokens)


def test_a_body_that_mixes_examples_or_returns_a_weights_value_is_left_saying_why():
    loss, params, tokens = _lm(per_layer="weights")
    chunked = jg.chunk_rows(_joint(loss, params, tokens), 4, examples=True)
    assert not _examples(chunked)
    (why,) = _scans_left(chunked)
    assert "does not carry the examples" in why
    _assert_as_jax(chunked, loss, params, tokens)

    def batch_norm_lm(params, tokens):
        def body(x, p):
            x = x - x.mean(0)  # across the examples
            return jnp.tanh(x @ p["w1"][:, :x.shape[-1]]), None
        x, _ = jax.lax.scan(body, params["embed"][tokens], params["layers"])
        return jnp.mean(x**2)

    chunked = jg.chunk_rows(_joint(batch_norm_lm, params, tokens), 4, examples=True)
    assert not _examples(chunked)
    assert "mixes examples" in _scans_left(chunked)[0]
    _assert_as_jax(chunked, batch_norm_lm, params, tokens)

    def printing_lm(params, tokens):  # a print of the weights: every chunk would print it
        def body(x, p):
            jax.debug.print("{}", p["w1"].sum())
            return jnp.tanh(x @ p["w1"][:, :x.shape[-1]]), None
        x, _ = jax.lax.scan(body, params["embed"][tokens], params["layers"])
        return jnp.mean(x**2)

    chunked = jg.chunk_rows(_joint(printing_lm, params, tokens), 4, examples=True)
    assert not _examples(chunked)
    assert "has effects" in _scans_left(chunked)[0]


def test_one_chunks_working_set_is_what_the_step_holds():
    """XLA:CPU's temp of the donated step: the layer over 8 chunks of examples holds less than
    the layer's MLP and attention each over chunks (`examples=False`), which holds less than the
    layer whole."""
    loss, params, tokens = _lm(layers=2, d=64, t=64, batch=16, vocab=128)
    gb = _joint(loss, params, tokens)
    whole = jg.compiled_memory(gb).temp_bytes
    regions = jg.compiled_memory(jg.chunk_rows(gb, 8)).temp_bytes
    examples = jg.compiled_memory(jg.chunk_rows(gb, 8, examples=True)).temp_bytes
    assert examples < 0.75 * regions < 0.75 * whole, (examples, regions, whole)


def test_a_budget_only_the_layer_over_examples_reaches_is_met_by_it():
    """Under a budget between what the layer over chunks of examples reaches and the least of
    its MLP and attention in chunks (with the layer scan keeping only its carries), the planner
    runs the layer over chunks of examples, within the budget, with JAX's gradients."""
    loss, params, tokens = _lm(layers=2, d=64, t=64, batch=16, vocab=128)
    gb = _joint(loss, params, tokens)
    kept_carries = _joint(loss, params, tokens,
                          loop_policy=jax.checkpoint_policies.nothing_saveable)
    regions = min(jg.compiled_memory(jg.chunk_rows(g, 8)).temp_bytes for g in (gb, kept_carries))
    examples = jg.compiled_memory(jg.chunk_rows(gb, 8, examples=True)).temp_bytes
    budget = (examples + regions) // 2
    planned = jg.remat(gb, budget=budget)
    report = planned.info["remat"]
    assert report["xla_temp"] <= budget
    assert any(r["kind"] == "examples" for r in report["chunked"]), report["chunked"]
    assert report["recompute_flops"] > 0  # each chunk's forward again in the backward
    _assert_as_jax(planned, loss, params, tokens)
