"""`jg.chunk_rows` inside loops and checkpoint regions: a scanned model's layer (`lax.scan` over
stacked params, the flax `nn.scan` / MaxText form) has its token-wise MLP and its attention run
over chunks inside the scan's body, and a region inside a `jax.checkpoint` stays in it. Compared
with `jax.value_and_grad` (normwise 1e-6) and on the compiled temp.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg

RNG = np.random.default_rng(1)
L, T, H, DH, HIDDEN, V = 3, 24, 2, 4, 32, 16
D = H * DH


def normal(*shape, scale=1.0):
    return jnp.asarray(RNG.standard_normal(shape).astype(np.float32) * scale)


def layer_params(*lead):
    return {"qkv": normal(*lead, D, 3 * D, scale=D**-0.5), "o": normal(*lead, D, D, scale=0.3),
            "up": normal(*lead, D, HIDDEN, scale=D**-0.5),
            "down": normal(*lead, HIDDEN, D, scale=HIDDEN**-0.5)}


def norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def layer(x, p):
    b, t, _ = x.shape
    q, k, v = (a.reshape(b, t, H, DH) for a in jnp.split(norm(x) @ p["qkv"], 3, axis=-1))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(DH)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, D)
    x = x + o @ p["o"]
    return x + jax.nn.gelu(norm(x) @ p["up"]) @ p["down"]


def scanned_lm(p, tokens):
    x = p["embed"][tokens[:, :-1]]
    x, _ = jax.lax.scan(lambda h, lp: (layer(h, lp), None), x, p["layers"])
    logits = norm(x) @ p["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


PARAMS = {"embed": normal(V, D), "layers": layer_params(L)}
TOKENS = jnp.asarray(RNG.integers(0, V, (1, T + 1)), jnp.int32)


def relative_error(got, want) -> float:
    got, want = (np.concatenate([np.ravel(a) for a in jax.tree.leaves(t)]) for t in (got, want))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.extended
@pytest.mark.parametrize("chunks", [5], ids=["remainder"])
def test_a_scanned_layers_mlp_and_attention_run_in_chunks_inside_the_body(chunks):
    gb = jg.backward(jg.trace(scanned_lm, PARAMS, TOKENS, param_argnums=0))
    gc = jg.check(jg.chunk_rows(gb, chunks=chunks))
    inside = {r["kind"]: r for r in gc.info["chunk_rows"]["regions"] if r.get("in")}
    assert set(inside) == {"interior", "blocks"}, gc.info["chunk_rows"]
    assert {"tanh", "dot_general"} <= set(inside["interior"]["ops"])
    assert {"exp", "reduce_max", "iota"} <= set(inside["blocks"]["ops"])
    assert inside["blocks"]["axis"] == 1 and inside["blocks"]["chunks"] == chunks
    want = jax.jit(jax.value_and_grad(scanned_lm))(PARAMS, TOKENS)
    assert relative_error(jg.compile(gc)(PARAMS, TOKENS), want) < 1e-6


def test_a_scanned_layers_chunks_leave_the_compiled_temp():
    tokens = jnp.asarray(RNG.integers(0, V, (1, 257)), jnp.int32)
    gb = jg.backward(jg.trace(scanned_lm, PARAMS, tokens, param_argnums=0))
    gc = jg.chunk_rows(gb, chunks=8, interior=True)
    whole = jg.compiled_memory(gb, PARAMS, tokens).temp_bytes
    chunked = jg.compiled_memory(gc, PARAMS, tokens).temp_bytes
    scores = H * 256 * 256 * 4
    assert chunked + scores < whole, (chunked, whole)


def test_chunks_of_a_graph_derived_with_a_loop_policy_keep_the_policy():
    """`jg.backward(..., loop_policy=nothing_saveable)` puts the policy inside the scan's body
    (a planner's "loop bodies keep their inputs" mode): the layer stacks its carry alone.
    Chunking that graph derives it again from the chunked forward, with the same policy (it
    was derived without: the body stacked its values as traced again, so the chunked graphs
    of the policy and of no policy were one program), and the loops over chunks inside the
    layer's body are recomputed in its backward with the rest of it (they stood outside the
    policy's region: the layer stacked what they stack, the blocks of every layer)."""
    tokens = jnp.asarray(RNG.integers(0, V, (4, 65)), jnp.int32)
    forward = jg.trace(scanned_lm, PARAMS, tokens, param_argnums=0)
    gb = jg.backward(forward)
    kept = jg.backward(forward, loop_policy=jax.checkpoint_policies.nothing_saveable)
    assert kept.info["loop_policy"]
    plain, chunked = jg.chunk_rows(gb, chunks=4), jg.check(jg.chunk_rows(kept, chunks=4))
    assert {r.get("in") for r in chunked.info["chunk_rows"]["regions"]} == {None, "scan body"}
    assert chunked.info["loop_policy"] == kept.info["loop_policy"]
    layers = [e for e in chunked.eqns if e.op == "scan" and "backward" not in e.tags
              and e.params["length"] == L]
    assert [v.aval.shape for e in layers for v in e.outputs[e.params["num_carry"]:]] == [
        (L, *tokens[:, 1:].shape, D)]  # the layer input (its carry), nothing of the blocks
    temp = {name: jg.compiled_memory(g, PARAMS, tokens).temp_bytes
            for name, g in (("plain", plain), ("chunked", chunked), ("kept", kept))}
    assert temp["chunked"] < temp["plain"], temp
    want = jax.jit(jax.value_and_grad(scanned_lm))(PARAMS, tokens)
    assert relative_error(jg.compile(chunked)(PARAMS, tokens), want) < 1e-6


def checkpointed_mlps(p, x):
    for lp in p:
        x = jax.checkpoint(lambda h, lp: h + jnp.tanh(h @ lp["up"]) @ lp["down"])(x, lp)
    return jnp.mean(jnp.cumsum(x, 0) ** 2)


def test_a_region_inside_a_checkpoint_stays_in_it():
    p = [{"up": normal(D, HIDDEN, scale=0.3), "down": normal(HIDDEN, D, scale=0.2)}
         for _ in range(2)]
    x = normal(16, D)
    gb = jg.backward(jg.trace(checkpointed_mlps, p, x, param_argnums=0))
    gc = jg.check(jg.chunk_rows(gb, chunks=4))
    assert [r["kind"] for r in gc.info["chunk_rows"]["regions"]] == ["interior"] * 2
    loops = [e for e in gc.eqns if e.op == "scan" and "backward" not in e.tags]
    assert len(loops) == 2 and all(e.regions for e in loops)  # in the layers' regions
    assert loops[0].regions != loops[1].regions
    want = jax.jit(jax.value_and_grad(checkpointed_mlps))(p, x)
    assert relative_error(jg.compile(gc)(p, x), want) < 1e-6


@pytest.mark.slow  # (15 s: three plans; the default run plans blocks under a budget in
def test_a_budget_only_chunks_inside_the_body_reach_is_met():  # test_chunk_blocks.py)
    p = {"embed": PARAMS["embed"], "layers": jax.tree.map(lambda a: a[:2], PARAMS["layers"])}
    tokens = jnp.asarray(RNG.integers(0, V, (1, 65)), jnp.int32)
    gb = jg.backward(jg.trace(scanned_lm, p, tokens, param_argnums=0))
    whole = jg.compiled_memory(gb, p, tokens).temp_bytes
    budget = int(0.3 * whole)  # (no plan fits without chunks, nor with the head alone)
    gr = jg.remat(gb, budget=budget, planner="fast")
    report = gr.info["remat"]
    assert report["xla_temp"] <= budget
    assert any(r.get("in") == "scan body" for r in report["chunked"]), report["chunked"]
    want = jax.jit(jax.value_and_grad(scanned_lm))(p, tokens)
    assert relative_error(jg.compile(gr)(p, tokens), want) < 1e-6
