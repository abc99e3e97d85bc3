"""The layers of a forward written out (not scanned), each run over chunks of examples
(`jg.chunk_rows(..., examples=True)`, `jgraph.chunk.layers`): JAX's loss and gradients, one
chunk of one loop's working set."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_chunk_examples import _assert_as_jax, _layer

import jgraph as jg


def _lm(layers=2, d=32, t=16, batch=8, vocab=64, mix_after=None):
    """(loss, params, tokens): an LM whose layers are a Python loop, as flax and haiku users
    write one; `mix_after`: a layer after which the activations are centred over the batch."""
    keys = iter(jax.random.split(jax.random.PRNGKey(11), 6 * layers + 2))

    def w(*shape):
        return jax.random.normal(next(keys), shape) * shape[-2] ** -0.5

    params = {"embed": w(vocab, d), "layers": [
        {"ln1": jnp.ones(d), "wqkv": w(d, 3 * d), "wo": w(d, d), "ln2": jnp.ones(d),
         "w1": w(d, 4 * d), "w2": w(4 * d, d)} for _ in range(layers)]}
    tokens = jax.random.randint(next(keys), (batch, t), 0, vocab)

    def loss(params, tokens):
        x = params["embed"][tokens]
        for i, p in enumerate(params["layers"]):
            x = _layer(p, x)
            if i == mix_after:
                x = x - x.mean(0)  # across the examples
        logits = x @ params["embed"].T
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    return loss, params, tokens


def _joint(loss, params, tokens):
    return jg.backward(jg.trace(loss, params, tokens, param_argnums=0))


def _layers(graph):
    return [r for r in graph.info["chunk_rows"]["regions"] if r.get("in") == "layers"]


@pytest.mark.parametrize("batch, chunks, size, remainder", [(8, 4, 2, 0), (10, 4, 3, 1)])
def test_layers_written_out_over_chunks_of_examples_compute_jaxs_gradients(batch, chunks, size,
                                                                           remainder):
    loss, params, tokens = _lm(batch=batch)
    chunked = jg.chunk_rows(_joint(loss, params, tokens), chunks, examples=True)
    found = _layers(chunked)
    assert found and all(r["kind"] == "examples" and r["rows"] == (batch, 16) for r in found)
    assert {(r["chunk_rows"], r["remainder"]) for r in found} == {(size, remainder)}
    assert found[0]["row_inputs"] == [f"i32[{batch},16]"]  # the first reads the tokens
    jg.check(chunked)
    _assert_as_jax(chunked, loss, params, tokens)


@pytest.mark.parametrize("loops", [1, 2, 3])
def test_the_layers_run_in_as_many_loops_as_asked(loops):
    loss, params, tokens = _lm()
    chunked = jg.chunk_rows(_joint(loss, params, tokens), 4, examples=True, layer_loops=loops)
    found = _layers(chunked)
    assert len(found) == loops
    starts = [r["eqns"][0] for r in found]
    assert starts == sorted(starts)
    _assert_as_jax(chunked, loss, params, tokens)


def test_an_eqn_mixing_examples_ends_a_stretch_of_layers():
    """The activations centred over the batch between two layers: each side runs over chunks
    on its own, the centring whole between them."""
    loss, params, tokens = _lm(layers=2, mix_after=0)
    chunked = jg.chunk_rows(_joint(loss, params, tokens), 4, examples=True, layer_loops=1)
    first, second = _layers(chunked)
    assert first["eqns"][1] < second["eqns"][0]
    _assert_as_jax(chunked, loss, params, tokens)


@pytest.mark.extended  # 12 s: the default suite keeps its margin under 10 minutes
def test_layers_the_user_checkpointed_run_over_chunks_inside_their_regions():
    """Each layer under `jax.checkpoint`: a region of its own, so each stretch ends where its
    region does; the chunked graph, with the user's regions applied, has JAX's gradients."""
    _, params, tokens = _lm()

    def checkpointed(params, tokens):
        x = params["embed"][tokens]
        for p in params["layers"]:
            x = jax.checkpoint(_layer)(p, x)
        return -jnp.mean(jax.nn.log_softmax(x @ params["embed"].T)[..., 0])

    chunked = jg.chunk_rows(_joint(checkpointed, params, tokens), 4, examples=True)
    assert len(_layers(chunked)) >= 2
    _assert_as_jax(jg.remat(chunked), checkpointed, params, tokens)


def test_a_weight_as_long_as_the_batch_stays_whole():
    """d = batch: the weights' leading axes have the batch's size; which values carry the
    examples is followed from the tokens, so the weights are read whole by every chunk."""
    loss, params, tokens = _lm(d=16, batch=16, t=8)
    chunked = jg.chunk_rows(_joint(loss, params, tokens), 4, examples=True)
    assert _layers(chunked)
    _assert_as_jax(chunked, loss, params, tokens)


def test_a_model_written_per_example_under_vmap_is_left_saying_why():
    """An MLP written for one example and vmapped (as equinox users write one): `w @ v` under
    vmap puts the examples on the contraction's last axis, where the row rules do not follow
    them (a known limit), so nothing is chunked, with the reason and JAX's gradients."""
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    params = [jax.random.normal(k, (24, 24)) * 0.2 for k in keys[:3]]
    x = jax.random.normal(keys[3], (12, 24))

    def loss(params, x):
        def one(v):
            for w in params:
                v = jnp.tanh(w @ v)
            return jnp.sum(v**2)
        return jnp.mean(jax.vmap(one)(x))

    chunked = jg.chunk_rows(_joint(loss, params, x), 3, examples=True)
    assert not _layers(chunked)
    assert chunked.info["chunk_rows"]["examples_left"] == [
        "layers: no stretch of layers with a contraction outside loops"]
    _assert_as_jax(chunked, loss, params, x)


def test_one_chunks_working_set_is_what_the_step_holds():
    """XLA:CPU's temp of the donated step: the layers over 8 chunks of examples hold less than
    their MLPs and attention each over chunks (`examples=False`), which hold less than the
    layers whole."""
    loss, params, tokens = _lm(layers=2, d=64, t=64, batch=16, vocab=128)
    gb = _joint(loss, params, tokens)
    whole = jg.compiled_memory(gb).temp_bytes
    regions = jg.compiled_memory(jg.chunk_rows(gb, 8)).temp_bytes
    layers = jg.compiled_memory(jg.chunk_rows(gb, 8, examples=True)).temp_bytes
    assert layers < 0.75 * regions < 0.75 * whole, (layers, regions, whole)


@pytest.mark.extended  # 16 s: the default suite keeps its margin under 10 minutes
def test_a_budget_only_the_layers_over_examples_reach_is_met_by_them():
    """Under a budget a little above what the layers over chunks of examples hold (a third of
    what their MLPs and attention in chunks hold, whose plans recompute per layer and stay
    above it), the planner runs the layers over chunks of examples, within the budget, with
    JAX's gradients."""
    loss, params, tokens = _lm(layers=2, d=64, t=64, batch=16, vocab=128)
    gb = _joint(loss, params, tokens)
    budget = int(1.1 * jg.compiled_memory(jg.chunk_rows(gb, 8, examples=True)).temp_bytes)
    planned = jg.remat(gb, budget=budget)
    report = planned.info["remat"]
    assert report["xla_temp"] <= budget
    assert any(r.get("in") == "layers" for r in report["chunked"]), report["chunked"]
    assert report["recompute_flops"] > 0  # each chunk's forward again in the backward
    _assert_as_jax(planned, loss, params, tokens)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_layer_loops_is_a_clear_error(bad):
    loss, params, tokens = _lm()
    with pytest.raises(jg.TransformError, match="layer_loops must be an int >= 1"):
        jg.chunk_rows(_joint(loss, params, tokens), 4, examples=True, layer_loops=bad)
    with pytest.raises(jg.TransformError, match="give examples=True too"):
        jg.chunk_rows(_joint(loss, params, tokens), 4, layer_loops=2)


@pytest.mark.f64
def test_a_gradient_entry_matches_float64_finite_differences():
    """An independent check: the chunked graph's gradient of one weight entry, in float64,
    against a central difference of the loss."""
    loss, params, tokens = _lm(batch=6)
    params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
    chunked = jg.chunk_rows(_joint(loss, params, tokens), 4, examples=True)
    assert _layers(chunked)
    _, grads = jg.compile(chunked)(params, tokens)

    def at(delta):
        w1 = params["layers"][0]["w1"].at[3, 5].add(delta)
        moved = {**params, "layers": [{**params["layers"][0], "w1": w1}, *params["layers"][1:]]}
        return float(loss(moved, tokens))

    eps = 1e-5
    np.testing.assert_allclose(grads["layers"][0]["w1"][3, 5], (at(eps) - at(-eps)) / (2 * eps),
                               rtol=1e-6, atol=1e-9)
