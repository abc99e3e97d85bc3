"""jg.memory against XLA (the issue's bar: the estimate within +-25 % of the compiled donated
step's temp bytes), on a handful of cheap models covering each rule of the model (fusion, library
reductions, convolutions, loops, random bits, remat's protected recompute, the demo's training
graphs); `python -m benchmarks.bench_memory` covers every corpus and real model. And the pictures:
`MemoryReport.plot`."""

import builtins

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from models import BY_NAME

import jgraph as jg
from benchmarks.bench_memory import lm_args, transformer_lm
from benchmarks.bench_remat import chain, chain_args

CORPUS = ["mlp", "transformer_block", "cnn_pool_window", "scan_layers", "dropout",
          "checkpointed", "xent_optax"]


def joint(fn, args, **kw):
    gb = jg.backward(jg.trace(fn, *args, **kw))
    return jg.remat(gb) if gb.regions else gb


def ratio(graph, args) -> float:
    return jg.memory(graph).peak_bytes / jg.compiled_memory(graph, *args).temp_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's allocator is modelled")
@pytest.mark.parametrize("name", CORPUS)
def test_corpus_estimate_within_25_percent_of_xla(name):
    spec = BY_NAME[name]
    args = spec.args(seed=0)
    gb = joint(spec.fn, args, param_argnums=spec.param_argnums, has_aux=spec.has_aux)
    assert 0.75 <= ratio(gb, args) <= 1.25


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's allocator is modelled")
def test_remat_estimate_within_25_percent_of_xla():
    args = chain_args(layers=6, width=64, batch=32)
    for fn in (chain(), chain(2)):  # no remat, and protected 2-layer segments
        assert 0.75 <= ratio(joint(fn, args, param_argnums=0), args) <= 1.25


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's allocator is modelled")
@pytest.mark.parametrize("remat", [False, True])
def test_transformer_lm_estimate_within_25_percent_of_xla(remat):
    args = lm_args(layers=2, d=64, t=64, batch=4)
    assert 0.75 <= ratio(joint(transformer_lm(remat), args, param_argnums=0), args) <= 1.25


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's allocator is modelled")
@pytest.mark.xfail(strict=True, reason=(
    "known miss, +29 %: with each state written into its own buffer XLA places this step in "
    "596 KB (812 KB crossed); the simulator runs each weight gradient (a dot its reader "
    "transposes, a new dot in XLA) before the YNNPACK fusions reading its operands, so it dies "
    "after the layer below's update and lives in the heap, not in a copied param's allocation"))
def test_a_training_step_with_accumulation_and_adam_within_25_percent_of_xla():
    from jgraph.training import demo

    ds, n_in = demo.load_digits_dataset()
    params = demo.init_params(jax.random.PRNGKey(0), n_in)
    x, y = ds.batch(0, 32)
    opt = jg.Optimizer(demo.model, optax.adam(1e-3), loss="cross_entropy", period=2)
    state = opt.init(params, x, y)
    args = (state.params, x, y, state.grad_acc, np.int32(0), state.opt_state)
    assert 0.75 <= ratio(opt.graphs["opt"], args) <= 1.25


def test_the_estimate_does_not_depend_on_object_identities():
    """Whether a producer read by two members of a kernel fused was decided by the first member
    popped, ties broken by `id(eqn)`: copies of one graph (a remat adding only region tags) got
    68 or 8 bytes by chance (found by hypothesis)."""
    def program(data, p):
        v = jnp.sqrt(1 + data * data)
        h = v + jnp.dot(p, p)
        return jnp.sum(v) + jnp.sum(h) + jnp.dot(v, h), (data, v)

    args = (jnp.ones((1,)), jnp.ones((2,)))
    gb = jg.backward(jg.trace(program, *args, param_argnums=1, has_aux=True))
    peaks = {jg.memory(jg.remat(gb, policy=jg.policies.everything_saveable)).peak_bytes
             for _ in range(8)}
    assert peaks == {jg.memory(gb).peak_bytes}


def test_an_in_place_update_of_a_fused_operand_is_estimated():
    """The backward of dynamic_slice updates a broadcast of zeros, which XLA fuses into the
    update: jg.memory raised KeyError looking for that operand's buffer (found by hypothesis)."""
    def program(p, i):
        h = lax.fori_loop(0, 1, lambda _, c: jnp.sin(c), jnp.tanh(p))
        return jnp.sum(lax.dynamic_slice(h, (i,), (1,)))

    args = (jnp.ones((1,)), jnp.int32(0))
    gb = jg.backward(jg.trace(program, *args, param_argnums=0))
    assert jg.memory(gb).peak_bytes > 0 and jg.compiled_memory(gb, *args).temp_bytes > 0


def test_a_taint_anchored_on_an_embedding_gradient_is_estimated():
    """A recompute group waits for the scatter-add of a `take`'s gradient, so XLA cannot fold
    that scatter into the sum after it: jg.memory folded it and raised KeyError looking for the
    anchor's buffer (found by hypothesis)."""
    def program(p, i):
        h = jnp.tanh(jnp.tanh(p))
        return jnp.sum(jnp.tanh(h)) + jnp.sum(jnp.take(h, i, axis=0))

    args = (jnp.ones((1,)), jnp.int32(0))
    planned = jg.remat(jg.backward(jg.trace(program, *args, param_argnums=0)), budget="50%")
    assert planned.info["remat"]["plan"] != "no remat"
    assert jg.memory(planned).peak_bytes > 0 and jg.compiled_memory(planned, *args).temp_bytes > 0
    np.testing.assert_allclose(jg.evaluate(planned, *args)[1], jax.grad(program)(*args), rtol=1e-6)


def test_memory_is_cheap_on_a_long_chain():
    """The planner calls jg.memory on every candidate plan: it is linear-ish in the graph, not
    a compile (no wall-clock bar: one call on 1700 eqns runs without compiling anything)."""
    args = chain_args(layers=120, width=16, batch=4)
    gb = jg.backward(jg.trace(chain(), *args, param_argnums=0))
    compiles = []
    jax.monitoring.register_event_listener(lambda name, **kw: compiles.append(name)
                                           if "compil" in name else None)
    rep = jg.memory(gb)
    assert len(gb.eqns) > 1500 and rep.peak_bytes > 0 and not compiles


# -- pictures ----------------------------------------------------------------------------------
def test_plot_overlays_plans_and_marks_xla(tmp_path):
    args = chain_args(layers=4, width=32, batch=8)
    plain, segments = (joint(fn, args, param_argnums=0) for fn in (chain(), chain(2)))
    reports = [jg.memory(g) for g in (plain, segments)]
    path = tmp_path / "memory.png"
    assert reports[0].plot(path, reports[1], labels=["no remat", "2-layer segments"],
                           compiled=[jg.compiled_memory(g, *args) for g in (plain, segments)],
                           title="chain") == path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = tmp_path / "memory.svg"
    reports[0].plot(svg, compiled=jg.compiled_memory(plain, *args).temp_bytes)
    text = svg.read_text()
    assert "no remat" not in text and "XLA temp" in text and "peak (eqn" in text


def test_plot_bad_input_is_a_clear_error(tmp_path):
    rep = jg.memory(jg.trace(lambda x: jnp.sum(x * x), jnp.ones(3)))
    with pytest.raises(jg.JGraphError, match="other MemoryReports"):
        rep.plot(tmp_path / "m.png", "not a report")
    with pytest.raises(jg.JGraphError, match="2 labels for 1 reports"):
        rep.plot(tmp_path / "m.png", labels=["a", "b"])
    with pytest.raises(jg.JGraphError, match="compiled"):
        rep.plot(tmp_path / "m.png", compiled="1 MiB")
    with pytest.raises(jg.JGraphError, match="does not exist"):
        rep.plot(tmp_path / "missing" / "m.png")


def test_plot_without_matplotlib_names_the_demo_extra(tmp_path, monkeypatch):
    real = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    rep = jg.memory(jg.trace(lambda x: jnp.sum(x * x), jnp.ones(3)))
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'jgraph\[demo\]'"):
        rep.plot(tmp_path / "m.png")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's allocator is modelled")
def test_fused_and_chunked_steps_within_25_percent_of_xla():
    """The steps below recomputation's floor (issue 28): adam fused into a scan's backward (the
    step without its grads, as the Optimizer runs it), and a wide loss head over chunks of
    rows, alone and with its update appended."""
    from jgraph.fuse import without_grads

    tx = optax.adam(1e-3)
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    ws, x = jax.random.normal(k[0], (16, 64, 64)) * 0.125, jax.random.normal(k[1], (32, 64))

    def scanned(ws, x):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.mean(h * h)

    step = without_grads(jg.optimizer_step(jg.backward(jg.trace(scanned, ws, x,
                                                                param_argnums=0)), tx))
    fused = jg.fuse_updates(step)
    assert fused.info["fuse_updates"]["[0]"]["fused"]
    params = {"w": jax.random.normal(k[2], (32, 64)) * 0.1,
              "out": jax.random.normal(k[3], (64, 2048)) * 0.1}
    xs, ys = jax.random.normal(k[4], (256, 32)), jnp.arange(256) % 2048

    def head(params, x, y):
        logits = jnp.tanh(x @ params["w"]) @ params["out"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    gb = jg.backward(jg.trace(head, params, xs, ys, param_argnums=0))
    chunked = jg.chunk_rows(gb, chunks=8)
    assert chunked.info["chunk_rows"]["regions"]
    chunked_step = jg.fuse_updates(without_grads(jg.optimizer_step(chunked, tx)))
    cases = {"fused": (fused, (ws, x, tx.init(ws))), "chunked": (chunked, (params, xs, ys)),
             "chunked, update appended": (chunked_step, (params, xs, ys, tx.init(params)))}
    for name, (graph, args) in cases.items():
        assert 0.75 <= ratio(graph, args) <= 1.25, name  # 1.11, 1.03, 1.03 measured


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's allocator is modelled")
@pytest.mark.xfail(strict=True, reason=(
    "known miss, -28 %: the backward loop over blocks of queries holds, in XLA's compile, one "
    "more [T/chunks, T] block of scores and one more [T, d] buffer than the simulator's body "
    "(the miss scales so with T, d and the chunks); the simulator put the loop's cotangent, a "
    "broadcast of a constant that XLA sinks into the body, in a buffer, which hid it"))
def test_attention_over_blocks_within_25_percent_of_xla():
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    wq, wk = jax.random.normal(k[2], (2, 16, 16)) * 0.25
    seq = jax.random.normal(k[3], (1, 256, 16))

    def attention(wq, wk, x):  # causal, one head: over blocks of queries
        s = jnp.where(jnp.tril(jnp.ones((256, 256), bool)), (x @ wq) @ (x @ wk).mT, -1e9)
        return jnp.mean((x + jax.nn.softmax(s) @ x) ** 2)

    blocks = jg.chunk_rows(jg.backward(jg.trace(attention, wq, wk, seq, param_argnums=(0, 1))),
                           chunks=8)
    assert [r["kind"] for r in blocks.info["chunk_rows"]["regions"]] == ["blocks"]
    assert 0.75 <= ratio(blocks, (wq, wk, seq)) <= 1.25


def test_a_loops_constant_cotangent_takes_no_buffer():
    """The backward loop of layers over chunks of examples reads the cotangent of a mean, a
    broadcast of a constant: XLA sinks it into the loop's body (no buffer of the batch's size),
    and so does the simulator (it put it in one: +84 % on a one-layer MLP)."""
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    w, x = jax.random.normal(keys[0], (64, 64)) * 0.125, jax.random.normal(keys[1], (1024, 64))

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    gb = jg.backward(jg.trace(loss, w, x, param_argnums=0))
    chunked = jg.chunk_rows(gb, 32, examples=True)
    assert chunked.info["chunk_rows"]["regions"][0]["in"] == "layers"
    assert 0.95 <= ratio(chunked, (w, x)) <= 1.05
