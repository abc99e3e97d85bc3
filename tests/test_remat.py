"""jg.remat: gradients bitwise equal to the un-rematerialized graph, recompute structure (what is
recomputed, how often, where), policies, and the lowering's protection of recompute from XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

import jgraph as jg
from jgraph.errors import TransformError
from jgraph.ir import sub_graphs
from jgraph.memory import donated_step
from tests.models import MODELS

F32 = jnp.float32
cp = jax.checkpoint_policies


def joint(fn, *args, param_argnums=0, has_aux=False):
    return jg.backward(jg.trace(fn, *args, param_argnums=param_argnums, has_aux=has_aux))


def recomputed(graph, op=None):
    """Recompute eqns, those inside loop bodies included."""
    found = [e for e in graph.eqns if "recompute" in e.tags and (op is None or e.op == op)]
    for e in graph.eqns:
        for sub in sub_graphs(e):
            found += recomputed(sub, op)
    return found


def assert_bitwise(got, want):
    """Gradients bit for bit (the bar); the value (loss, aux) to 1e-6: XLA may fuse a forward
    reduction differently once its input is no longer kept for the backward."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    (value, grads), (want_value, want_grads) = got, want
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(want_value), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def assert_remat_exact(gb, gr, args, fn=None, param_argnums=0, has_aux=False):
    """gr passes check(), is bitwise equal to gb when compiled, and close to jax.value_and_grad."""
    jg.check(gr)
    got = jg.compile(gr)(*args)
    assert_bitwise(got, jg.compile(gb)(*args))
    if fn is not None:
        want = jax.value_and_grad(fn, argnums=param_argnums, has_aux=has_aux)(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -- the corpus: every remat variant is bitwise equal ----------------------------------------------
# XLA:CPU compiles of these four take seconds each: they run with every policy in the slow suite.
HEAVY = {"transformer_block", "cnn_pool_window", "cnn_pool_reshape", "causal_attention"}
ALL_POLICIES = [jg.policies.nothing_saveable, jg.policies.dots_saveable,
                jg.policies.dots_with_no_batch_dims_saveable, jg.policies.everything_saveable,
                jg.policies.save_only_these_names("features")]


def corpus_joint(spec):
    args = spec.args(seed=0)
    return joint(spec.fn, *args, param_argnums=spec.param_argnums, has_aux=spec.has_aux), args


@pytest.mark.parametrize("spec", [s for s in MODELS if s.name not in HEAVY], ids=lambda s: s.name)
def test_corpus_remat_bitwise(spec):
    gb, args = corpus_joint(spec)
    want = jg.compile(gb)(*args)
    variants = [jg.remat(gb, policy=jg.policies.nothing_saveable)]
    assert recomputed(variants[0])  # every corpus model has something to recompute
    if gb.regions:
        variants.append(jg.remat(gb))
    for gr in variants:
        jg.check(gr)
        assert_bitwise(jg.compile(gr)(*args), want)


@pytest.mark.slow
@pytest.mark.parametrize("spec", MODELS, ids=lambda s: s.name)
def test_corpus_every_policy_bitwise(spec):
    gb, args = corpus_joint(spec)
    want = jg.compile(gb)(*args)
    for gr in [jg.remat(gb)] + [jg.remat(gb, policy=p) for p in ALL_POLICIES]:
        jg.check(gr)
        assert_bitwise(jg.compile(gr)(*args), want)


# -- the cases of the issue ------------------------------------------------------------------------
W = jnp.linspace(-1.0, 1.0, 12, dtype=F32).reshape(3, 4)
X = jnp.linspace(0.5, -0.7, 6, dtype=F32).reshape(2, 3)


def test_region_backward_reads_its_second_output():
    def two_out(w, x):
        z = x @ w
        return jax.nn.relu(z), jnp.tanh(z)  # tanh's VJP reads its output: the 2nd region output

    def f(w, x):
        a, b = jax.checkpoint(two_out)(w, x)
        return jnp.sum(a * b)

    gb = joint(f, W, X)
    gr = jg.remat(gb)
    assert_remat_exact(gb, gr, (W, X), f)
    assert not recomputed(gr, "tanh")  # every region output is kept, not only the first
    assert len(recomputed(gr, "dot_general")) == 1  # relu's VJP reads z: recomputed once


def test_region_with_a_saved_sub_block_inside():
    """A sub-block that saves everything inside a nothing-saveable region (ccv's -1 sub-model)."""

    def inner(x):
        return jnp.sin(jnp.sin(x))

    def outer(w, x):
        return jnp.tanh(jax.checkpoint(inner, policy=cp.everything_saveable)(x @ w))

    def f(w, x):
        return jnp.sum(jax.checkpoint(outer)(w, x) ** 2)

    gb = joint(f, W, X)
    gr = jg.remat(gb)
    assert_remat_exact(gb, gr, (W, X), f)
    # The backward reads z = x @ w and sin(z) (the VJPs of the two sins); the outer recompute
    # provides both, once; sin(sin(z)) is the input of tanh, whose VJP reads only its output.
    assert len(recomputed(gr, "sin")) == 1 and len(recomputed(gr, "dot_general")) == 1
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # JAX's public view of what it saves
        jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(outer), W, X)
    jax_saved = printed.getvalue().strip().splitlines()
    assert jax_saved and all("from the argument" in line for line in jax_saved)


def test_region_with_dropout_replays_the_key():
    def dropped(w, x, key):
        h = jnp.tanh(x @ w)
        keep = jax.random.bernoulli(key, 0.5, h.shape)
        return jnp.where(keep, h / 0.5, 0.0)

    def f(w, x, key):
        return jnp.sum(jnp.sin(jax.checkpoint(dropped)(w, x, key)))

    key = jax.random.PRNGKey(3)
    gb = joint(f, W, X, key)
    gr = jg.remat(gb)
    assert_remat_exact(gb, gr, (W, X, key), f)
    ops = {e.op for e in recomputed(gr)}
    assert "threefry2x32" in ops or "random_bits" in ops  # the mask is recomputed from the key


def test_region_nothing_reads_emits_no_recompute():
    def f(w, x):
        h = jax.checkpoint(lambda y: 2.0 * y + 1.0)(x @ w)  # linear: its VJP reads no value
        return jnp.sum(h)

    gb = joint(f, W, X)
    gr = jg.remat(gb)
    assert not recomputed(gr)
    assert_remat_exact(gb, gr, (W, X), f)


def binomial(funs):
    if len(funs) == 1:
        return funs[0]
    f1, f2 = binomial(funs[:len(funs) // 2]), binomial(funs[len(funs) // 2:])
    return jax.checkpoint(lambda x: f1(f2(x)))


def count_in_jaxpr(jaxpr, name):
    """Executed eqns of primitive `name` in a jaxpr, sub-jaxprs included (JAX's oracle)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for p in eqn.params.values():
            for q in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(q, jex_core.ClosedJaxpr):
                    total += count_in_jaxpr(q.jaxpr, name)
                elif isinstance(q, jex_core.Jaxpr):
                    total += count_in_jaxpr(q, name)
    return total


@pytest.mark.parametrize("n,extra", [(4, 4), (8, 12), (16, 32)])
def test_nested_binomial_checkpointing_matches_jax_recompute_counts(n, extra):
    f = binomial([jnp.sin] * n)

    def loss(p):
        return f(p)

    x = jnp.asarray(0.3, F32)
    gb = joint(loss, x)
    gr = jg.remat(gb)
    assert_remat_exact(gb, gr, (x,), loss)
    n_sin = sum(e.op == "sin" for e in gr.eqns)
    oracle = count_in_jaxpr(jax.make_jaxpr(jax.grad(loss))(x).jaxpr, "sin")
    assert n_sin == oracle == n + extra
    assert len(gr.regions) == n - 1


def jax_test_binomial(funs):
    """The recursion of JAX's own RematTest (pairs are composed, not checkpointed)."""
    if len(funs) == 1:
        return funs[0]
    if len(funs) == 2:
        return lambda x: funs[0](funs[1](x))
    f1, f2 = jax_test_binomial(funs[:len(funs) // 2]), jax_test_binomial(funs[len(funs) // 2:])
    return jax.checkpoint(lambda x: f1(f2(x)))


@pytest.mark.parametrize("n,extra", [(4, 3), (8, 10), (16, 28)])
def test_jax_test_binomial_structure_matches_jax_sin_counts(n, extra):
    """With JAX's test recursion, sin chains recompute 3, 10, 28 sins, as JAX's jaxpr does (the
    n + 2/8/24 of JAX's add_one test cannot hold for sin: its VJP reads every inner input)."""
    f = jax_test_binomial([jnp.sin] * n)
    x = jnp.asarray(0.3, F32)
    gr = jg.remat(joint(f, x))
    oracle = count_in_jaxpr(jax.make_jaxpr(jax.grad(f))(x).jaxpr, "sin")
    assert sum(e.op == "sin" for e in gr.eqns) == oracle == n + extra


@pytest.mark.parametrize("n", [4, 8, 16])
def test_nested_checkpointing_of_ops_whose_vjp_reads_nothing_recomputes_nothing(n):
    """JAX's own oracle for add_one chains is 2, 8, 24 backward evaluations (it feeds inner
    regions' inputs nobody reads); jgraph's demand-driven recompute emits none."""
    f = binomial([lambda x: x + 1.0] * n)
    x = jnp.asarray(0.3, F32)
    gb = joint(lambda p: jnp.sin(f(p)), x)
    assert not recomputed(jg.remat(gb))


def test_nested_regions_bitwise_on_a_matmul_chain():
    ws = [W[:, :3] * (0.5 + i) for i in range(4)]
    x = X

    def f(ws, x):
        layers = [lambda h, w=w: jnp.tanh(h @ w) for w in ws]
        inner = [jax.checkpoint(lambda h, a=a, b=b: b(a(h))) for a, b in zip(layers[::2],
                                                                            layers[1::2],
                                                                            strict=True)]
        return jnp.sum(jax.checkpoint(lambda h: inner[1](inner[0](h)))(x) ** 2)

    gb = joint(f, ws, x)
    gr = jg.remat(gb)
    assert recomputed(gr)
    assert_remat_exact(gb, gr, (ws, x), f)


# -- policies --------------------------------------------------------------------------------------
def named_mlp(policy):
    def body(w, x):
        z = jg.checkpoint_name(x @ w, "z")
        return jg.checkpoint_name(jnp.sin(z), "s")

    def f(w, x):
        return jnp.sum(jnp.tanh(jg.checkpoint(body, policy=policy)(w, x)))

    return f


def test_every_jax_policy_name_is_in_jg_policies():
    for name in vars(jax.checkpoint_policies):
        assert hasattr(jg.policies, name), name


@pytest.mark.parametrize("policy,recomputed_dots,recomputed_sins", [
    (None, 1, 0),
    (jg.policies.nothing_saveable, 1, 0),
    (jg.policies.everything_saveable, 0, 0),
    (jg.policies.dots_saveable, 0, 0),
    (cp.dots_saveable, 0, 0),  # JAX's own policy object, recorded by the tracer
    (jg.policies.dots_with_no_batch_dims_saveable, 0, 0),
    (jg.policies.save_only_these_names("z"), 0, 0),
    (jg.policies.save_only_these_names("s"), 1, 0),
    (jg.policies.save_any_names_but_these("z"), 1, 0),
    (jg.policies.save_anything_except_these_names("s"), 0, 0),
    (jg.policies.save_anything_except_these_names("z"), 1, 0),
])
def test_policies_choose_what_is_recomputed(policy, recomputed_dots, recomputed_sins):
    f = named_mlp(policy)
    gb = joint(f, W, X)
    gr = jg.remat(gb)
    assert len(recomputed(gr, "dot_general")) == recomputed_dots
    assert len(recomputed(gr, "sin")) == recomputed_sins  # "s" is the region output: kept
    assert_remat_exact(gb, gr, (W, X), f)


def test_save_anything_except_these_names_really_excludes():
    """JAX 0.10.2's version ignores its names (it saves everything); jgraph's does not, neither
    under the name nor through the unnamed producer of the same array."""
    gr = jg.remat(joint(named_mlp(jg.policies.save_anything_except_these_names("z")), W, X))
    saved = jg.memory(gr).residuals
    assert not any("named 'z'" in r.provenance or "dot_general" in r.provenance for r in saved)
    assert jax.checkpoint_policies.save_anything_except_these_names("z")(None) is True


def test_jg_checkpoint_policies_work_in_plain_jax():
    f = named_mlp(jg.policies.save_anything_except_these_names("z"))
    np.testing.assert_allclose(jax.grad(f)(W, X), jax.grad(named_mlp(None))(W, X), rtol=1e-6)


def test_policy_over_the_whole_forward_and_recorded_regions_together():
    f = named_mlp(jg.policies.everything_saveable)
    gb = joint(f, W, X)
    gr = jg.remat(gb, policy=jg.policies.nothing_saveable)
    # the region saves everything, but the whole-forward region around it saves nothing
    assert recomputed(gr, "dot_general") and recomputed(gr, "sin")
    assert_remat_exact(gb, gr, (W, X), f)
    assert gr.info["remat"]["policy"] == "nothing_saveable"


def test_everything_saveable_over_the_whole_model_changes_nothing():
    gb = joint(lambda w, x: jnp.sum(jnp.tanh(jnp.sin(x @ w))), W, X)
    gr = jg.remat(gb, policy=jg.policies.everything_saveable)
    assert not recomputed(gr)
    assert [e.op for e in gr.eqns] == [e.op for e in gb.eqns]


# -- errors ----------------------------------------------------------------------------------------
def test_remat_of_a_forward_graph_is_an_error():
    with pytest.raises(TransformError, match="jg.backward"):
        jg.remat(jg.trace(named_mlp(None), W, X, param_argnums=0))


def test_remat_budget_and_policy_together_is_an_error():
    with pytest.raises(TransformError, match="budget"):
        jg.remat(joint(named_mlp(None), W, X), budget=1 << 20, policy=jg.policies.dots_saveable)


def test_remat_is_pure_and_idempotent():
    gb = joint(named_mlp(None), W, X)
    before = str(gb)
    gr = jg.remat(gb)
    assert str(gb) == before
    assert str(jg.remat(gr)) == str(gr)


def test_recompute_eqns_are_tagged_and_placed_before_their_first_reader():
    gb = joint(named_mlp(None), W, X)
    gr = jg.remat(gb)
    first_backward = next(i for i, e in enumerate(gr.eqns) if "backward" in e.tags)
    for i, eqn in enumerate(gr.eqns):
        if "recompute" in eqn.tags:
            assert eqn.tags == {"recompute", "no_cse"} and i > first_backward
            readers = [j for j, e in enumerate(gr.eqns) if set(eqn.outputs) & set(e.inputs)]
            assert readers and min(readers) > i
    no_cse_off = jg.remat(joint(lambda w, x: jnp.sum(jnp.tanh(
        jax.checkpoint(lambda y: jnp.sin(y @ w), prevent_cse=False)(x))), W, X))
    assert all(e.tags == {"recompute"} for e in recomputed(no_cse_off))


# -- a kept bf16 value: the forward reads what the backward reads ----------------------------------
def excess_precision_program():
    """JAX's RematTest.test_excess_precision_hell: a bf16 matmul (1 + eps) I, kept by a remat that
    saves everything, and read by its forward as f32 (its value) and by a custom_vjp's bwd (its
    gradient): (value, gradient) as the pair (loss and aux, grad) of jg.value_and_grad."""
    @jax.custom_vjp
    def dot(x):
        return jnp.dot(x, x)

    dot.defvjp(lambda x: (dot(x), None), lambda _, g: (g,))

    @jax.custom_vjp
    def widen(x):
        return F32(1.0) * x.astype(F32)

    widen.defvjp(lambda x: (widen(x), x), lambda x, _: (F32(1.0) * x.astype(F32),))
    f = jax.checkpoint(lambda x: widen(dot(x)), policy=lambda *_, **__: True)

    def loss(x):
        y = f(x)
        return jnp.sum(y), y

    x = (1 + jnp.finfo(jnp.bfloat16).eps) * jnp.eye(2, dtype=jnp.bfloat16)
    return loss, x


def test_a_kept_bf16_value_is_the_forward_s_value_too():
    """XLA computes the bf16 matmul in f32 and folds the rounding away into the forward's widening
    convert (1.015686 instead of bf16's 1.015625), while the backward reads the kept, rounded
    buffer. JAX's remat pins its residuals (`reduce_precision`), so its value and gradient agree
    exactly; so do jgraph's (the value differed by 6e-5), and both equal JAX's bit for bit."""
    loss, x = excess_precision_program()
    want = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    np.testing.assert_array_equal(want[0][1], want[1])  # JAX's own test: y == y_, exactly
    gr = jg.remat(joint(loss, x, has_aux=True))
    assert [e.op for e in gr.eqns].count("reduce_precision") == 1
    assert str(jg.remat(gr)) == str(gr)  # pinned once
    for got in [jg.compile(gr)(x), jax.jit(jg.value_and_grad(loss, has_aux=True))(x)]:
        (value, y), grad = got
        assert grad.dtype == jnp.bfloat16  # JAX's is f32: jgraph casts a bwd's cotangent
        for a, b in [(value, want[0][0]), (y, want[0][1]), (grad.astype(F32), want[1])]:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(jg.evaluate(gr, x)[0][1], want[0][1])


# -- the lowering keeps recompute alive in XLA -----------------------------------------------------
def small_chain(segment, layers=8, width=64, batch=32):
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 1)
    params = [jax.random.normal(k, (width, width), F32) * width**-0.5 for k in keys[:-1]]
    x = jax.random.normal(keys[-1], (batch, width), F32)

    def run(ws, h):
        for w in ws:
            h = jnp.tanh(h @ w)
        return h

    def loss(ws, h):
        for i in range(0, len(ws), segment):
            h = jax.checkpoint(run)(ws[i:i + segment], h)
        return jnp.mean(h * h)

    return loss, params, x


def test_recomputed_dots_survive_xla_in_the_compiled_hlo():
    loss, params, x = small_chain(segment=4)
    gb = joint(loss, params, x)
    gr = jg.remat(gb)
    n_recomputed = len(recomputed(gr, "dot_general"))
    assert n_recomputed == 2 * 3
    base = jg.compiled_memory(gb, params, x).dots
    assert jg.compiled_memory(gr, params, x).dots == base + n_recomputed
    # ... also when jgraph's function is called inside the user's own jit
    inner = jg.compile(gr)
    outer = jax.jit(lambda p, x: inner(p, x)[1]).lower(params, x).compile().as_text()
    assert outer.count(" dot(") == jax.jit(lambda p, x: jg.compile(gb)(p, x)[1]).lower(
        params, x).compile().as_text().count(" dot(") + n_recomputed
    # ... and under the user's vmap (over a batch of inputs)
    xs = jnp.stack([x, 2 * x])

    def batched(g):
        f = jg.compile(g)
        return jax.jit(jax.vmap(lambda x: f(params, x)[1])).lower(xs).compile().as_text()

    assert batched(gr).count(" dot(") == batched(gb).count(" dot(") + n_recomputed


def test_without_protection_xla_merges_the_recompute_back():
    """The control: a region with prevent_cse=False is recomputed in the graph, but XLA:CPU
    folds the copies into the forward (this is what the protection prevents)."""
    _, params, x = small_chain(segment=4)

    def run(ws, h):
        for w in ws:
            h = jnp.tanh(h @ w)
        return h

    def unprotected(ws, h):
        for i in range(0, len(ws), 4):
            h = jax.checkpoint(run, prevent_cse=False)(ws[i:i + 4], h)
        return jnp.mean(h * h)

    gb = joint(unprotected, params, x)
    gr = jg.remat(gb)
    assert recomputed(gr, "dot_general")
    if jax.default_backend() == "cpu":
        assert jg.compiled_memory(gr, params, x).dots == jg.compiled_memory(gb, params, x).dots


def test_protection_never_waits_on_a_constant():
    """The first backward values derive from the constant loss seed; XLA folds those, so the
    recompute placed right after them must wait on a value computed from the inputs."""
    from jgraph.lower import protection_plan

    def f(w, x):
        return jnp.sum(jax.checkpoint(lambda y: jnp.sin(jnp.sin(y)))(x @ w))

    gr = jg.remat(joint(f, W, X))
    plan, anchors = protection_plan(gr)
    producer = {v: e for e in gr.eqns for v in e.outputs}
    assert len(anchors) == 1 and producer[anchors[0]].op == "reduce_sum"  # the loss
    assert [e.op for e in plan] == ["sin"]
    step, split = donated_step(gr)
    hlo = step.lower(*split(jnp.copy(W), X)).compile().as_text()
    assert "direction=LT" in hlo and " select(" in hlo  # the protection survives XLA
    assert " abs(" in hlo and " negate(" in hlo  # c < -|c|: never folded to a constant


def test_protected_step_is_bitwise_equal_and_donates():
    loss, params, x = small_chain(segment=4)
    gb = joint(loss, params, x)
    gr = jg.remat(gb)
    outs = []
    for g in (gb, gr):
        step, split = donated_step(g)
        state, rest = split(jax.tree.map(jnp.copy, params), x)
        for _ in range(2):
            state, others = step(state, rest)
        outs.append((others, state))  # (value, updated params: bit for bit)
    assert_bitwise(outs[1], outs[0])


@pytest.mark.parametrize("answer", [None, "yes", 0, 1.0])
def test_a_policy_answering_neither_bool_nor_marker_is_an_error(answer):
    gb = jg.backward(jg.trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((3, 2)),
                              jnp.ones((4, 3)), param_argnums=0))
    with pytest.raises(jg.TransformError, match=r"answered .* a policy must answer True/False"):
        jg.remat(gb, policy=lambda prim, *a, **p: answer)


def test_a_policy_that_is_not_a_policy_is_an_error():
    gb = jg.backward(jg.trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((3, 2)),
                              jnp.ones((4, 3)), param_argnums=0))
    with pytest.raises(jg.TransformError, match="not callable"):
        jg.remat(gb, policy="dots_saveable")
    with pytest.raises(jg.TransformError, match=r"cannot be called as policy\(prim"):
        jg.remat(gb, policy=lambda: True)
