"""Fusion cuts (`jgraph.lower.fusion_cuts`): on CPU the lowering materialises a backward chain of
cheap ops where the XLA fusions that would each recompute it cost more than a buffer (a residual
stream's cotangent; a value a transposed dot operand copy reads), and nowhere else (a gelu
MLP's backward, whose readers are dots); exactly, and `jg.memory` counts them as buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgraph as jg
from benchmarks.bench_cuts import mlp
from benchmarks.bench_planner import transformer, transformer_args
from jgraph.lower import CUT_MIN_BYTES, fusion_cuts, reading_fusions


def layer_norm(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


def residual_net(params, x):
    """Pre-norm residual blocks: the cotangent of `x` is summed over every block."""
    for w1, w2 in params:
        x = x + jax.nn.gelu(layer_norm(x) @ w1) @ w2
    return jnp.mean(layer_norm(x) ** 2)


def residual_args(blocks=3, batch=8, seq=32, d=64):
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * blocks + 1)
    params = [(jax.random.normal(keys[2 * i], (d, 2 * d)) * d**-0.5,
               jax.random.normal(keys[2 * i + 1], (2 * d, d)) * (2 * d)**-0.5)
              for i in range(blocks)]
    return params, jax.random.normal(keys[-1], (batch, seq, d))


@pytest.fixture(scope="module")
def joint():
    args = residual_args()
    return jg.backward(jg.trace(residual_net, *args, param_argnums=0)), args


def test_cuts_are_backward_values_several_fusions_read(joint):
    gb, _ = joint
    cuts = fusion_cuts(gb)
    assert cuts  # the residual stream's cotangent
    producers = {e.outputs[0]: e for e in gb.eqns if len(e.outputs) == 1}
    fusions, _ = reading_fusions(gb, set())
    for v in cuts:
        assert "backward" in producers[v].tags
        assert len(fusions[v]) >= 2
        assert v.aval.size * v.aval.dtype.itemsize >= CUT_MIN_BYTES


def mlp_args(width=512, layers=8, batch=256):
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 1)
    params = [(jax.random.normal(k, (width, width)) * width**-0.5, jnp.zeros(width))
              for k in keys[:-1]]
    return params, jax.random.normal(keys[-1], (batch, width))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="cuts are lowered on CPU only")
@pytest.mark.parametrize("activation", [jax.nn.gelu, jnp.tanh, jax.nn.relu])
def test_no_cut_where_every_reader_reads_a_buffer(activation):
    """An MLP's backward chain per layer (gelu's derivative: a dozen ops) is read by two dots and
    a YNNPACK bias reduction, which read the buffer XLA writes anyway: a cut saves nothing (the
    rule used to make 14 conditionals here, 1.04-1.16x JAX's step)."""
    fn, args = mlp(activation), mlp_args()
    gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
    assert not fusion_cuts(gb)
    compiled = jg.compile(gb)
    assert " conditional(" not in compiled.lower(*args).compile().as_text()
    loss, grads = compiled(*args)
    want_loss, want = jax.value_and_grad(fn)(*args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="cuts are lowered on CPU only")
def test_transformer_cuts_per_layer_and_numerics():
    """Per layer of the LM: the residual stream's cotangent after each of the two blocks (several
    loop fusions read it), and the two values weight-gradient dots over batch and sequence read
    through a transposed copy (the gelu MLP's and the qkv projection's cotangents); plus the
    head's. As many conditionals in the step; grads as JAX's."""
    counts = {}
    for layers in (1, 2):  # one layer more adds that layer's cuts
        args = transformer_args(layers=layers, d=64, seq=32, batch=8, vocab=128)
        gb = jg.backward(jg.trace(transformer(), *args, param_argnums=0))
        cuts = fusion_cuts(gb)
        producers = {e.outputs[0]: e.op for e in gb.eqns if len(e.outputs) == 1}
        counts[layers] = len(cuts)
        assert sum(v.aval.shape == (8, 32, 64) for v in cuts) == 2 * layers
        assert sum(v.aval.shape == (8, 32, 256) for v in cuts) == layers  # gelu's 4d
        assert sum(producers[v] == "concatenate" for v in cuts) == layers  # q, k, v's
        compiled = jg.compile(gb)
        assert compiled.lower(*args).compile().as_text().count(" conditional(") == len(cuts)
    assert counts[2] - counts[1] == 4
    loss, grads = compiled(*args)
    want_loss, want = jax.jit(jax.value_and_grad(transformer()))(*args)  # op by op: 3x slower
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_no_cuts_in_a_forward_graph_or_below_the_size(joint):
    _, args = joint
    assert not fusion_cuts(jg.trace(residual_net, *args, param_argnums=0))
    small = residual_args(batch=1, seq=4)  # 1 KiB values: duplicating them is cheaper
    assert not fusion_cuts(jg.backward(jg.trace(residual_net, *small, param_argnums=0)))


def test_the_switch_turns_cuts_off_for_comparisons(joint, monkeypatch):
    """`jgraph.lower.FUSION_CUTS = False` (bench_cuts' baseline): no cut, no conditional."""
    import jgraph.lower

    gb, args = joint
    monkeypatch.setattr(jgraph.lower, "FUSION_CUTS", False)
    assert not fusion_cuts(gb)
    assert " conditional(" not in jg.compile(gb).lower(*args).compile().as_text()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="cuts are lowered on CPU only")
def test_cuts_are_conditionals_in_the_compiled_step_and_exact(joint):
    gb, args = joint
    compiled = jg.compile(gb)
    text = compiled.lower(*args).compile().as_text()
    assert text.count(" conditional(") >= len(fusion_cuts(gb))
    loss, grads = compiled(*args)
    want_loss, want = jax.value_and_grad(residual_net)(*args)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
    # the cut is the identity bit for bit: the same as the reference interpreter's values
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(jg.evaluate(gb, *args)[1]),
                    strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-7)


def test_cuts_under_vmap_and_nonfinite_values(joint):
    params, x = residual_args(batch=1, seq=256)  # 64 KiB per example: cut
    one = jg.backward(jg.trace(residual_net, params, x, param_argnums=0))
    assert fusion_cuts(one)
    xs = jnp.stack([x, 2 * x, -x])
    losses, grads = jax.vmap(jg.compile(one), in_axes=(None, 0))(params, xs)
    for k in range(3):
        loss, want = jax.value_and_grad(residual_net)(params, xs[k])
        np.testing.assert_allclose(losses[k], loss, rtol=1e-6)
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g[k], w, rtol=2e-5, atol=2e-6)
    gb, (params, x) = joint
    bad = x.at[0, 0, 0].set(jnp.nan)  # a NaN first element takes the identity branch too
    loss, grads = jg.compile(gb)(params, bad)
    assert np.isnan(loss) and all(np.isnan(g).any() for g in jax.tree.leaves(grads))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="jg.memory models XLA:CPU")
def test_memory_counts_the_cut_buffers(joint):
    gb, args = joint
    estimate, xla = jg.memory(gb).peak_bytes, jg.compiled_memory(gb, *args).temp_bytes
    assert 0.75 <= estimate / xla <= 1.25


def test_memory_of_a_graph_with_an_eqn_of_no_outputs():
    """A print has no outputs: the cut check must not index them (was IndexError)."""
    def fn(w, x):
        jax.debug.print("w {w}", w=w[0, 0], ordered=True)
        return residual_net([(w, w.T)], x)

    args = (jnp.eye(64, 128), jnp.ones((8, 32, 64)))
    gb = jg.backward(jg.trace(fn, *args, param_argnums=0))
    assert any(not e.outputs for e in gb.eqns)
    assert jg.memory(gb).peak_bytes > 0


@pytest.mark.extended  # about 8-10 s: the default suite keeps its margin under 10 minutes
def test_cuts_in_bf16_and_inside_a_backward_scan_body():
    params, x = residual_args(batch=8, seq=64)
    low = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (params, x))
    gb = jg.backward(jg.trace(residual_net, *low, param_argnums=0))
    assert fusion_cuts(gb)
    got, want = jg.compile(gb)(*low)[1], jax.grad(residual_net)(*low)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=0.05, atol=2e-4)

    def scanned(ws, x):
        def body(h, w):
            return h + jax.nn.gelu(layer_norm(h) @ w[0]) @ w[1], None

        return jnp.mean(layer_norm(jax.lax.scan(body, x, ws)[0]) ** 2)

    ws = (jnp.stack([w1 for w1, _ in params]), jnp.stack([w2 for _, w2 in params]))
    gs = jg.backward(jg.trace(scanned, ws, x, param_argnums=0))
    assert any(fusion_cuts(e.params["body"]) for e in gs.eqns if e.op == "scan")
    got, want = jg.compile(gs)(ws, x)[1], jax.grad(scanned)(ws, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
