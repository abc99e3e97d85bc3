"""Training transforms and the Optimizer on an MLP over real data (sklearn's bundled digits).

References: jax.value_and_grad of the whole logical batch, optax.MultiSteps, a plain optax loop.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn.datasets import load_digits

import jgraph as jg

F32 = jnp.float32
_DIGITS = load_digits()
X = (_DIGITS.data[:256] / 16).astype(np.float32)
Y = _DIGITS.target[:256].astype(np.int32)


def mlp(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def init_params(seed=0, hidden=16):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"w1": jax.random.normal(k1, (64, hidden), F32) * 0.3, "b1": jnp.zeros(hidden, F32),
            "w2": jax.random.normal(k2, (hidden, 10), F32) * 0.3, "b2": jnp.zeros(10, F32)}


def ce_loss(p, x, y):
    logits = mlp(p, x)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(y, 10, dtype=logits.dtype)
                             * jax.nn.log_softmax(logits), axis=1))


ADAM, SGD = optax.adam(1e-2), optax.sgd(0.1)  # shared: equal Optimizers share executables
VG_CE = jax.jit(jax.value_and_grad(ce_loss))  # jitted references: one compile, not one per op


def assert_tree_close(a, b, rtol=1e-6, atol=0.0):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def copy(tree):
    return jax.tree.map(lambda a: jnp.array(np.asarray(a)), tree)


def test_transforms_give_checked_graphs_with_roles():
    p = init_params()
    gb = jg.backward(jg.trace(lambda p, x: jnp.mean(mlp(p, x)), p, X[:8], param_argnums=0))
    ga = jg.check(jg.accumulate(gb, period=4, loss="mean"))
    go = jg.check(jg.optimizer_step(ga, optax.adam(1e-3)))
    g0 = jg.check(jg.reset(go))
    assert ga.input_roles.count("accumulator") == 4 and ga.input_roles.count("counter") == 1
    assert ga.output_roles.count("new_accumulator") == 4 and "grad" not in ga.output_roles
    assert go.output_roles.count("new_param") == 4 and "new_opt_state" in go.output_roles
    assert set(g0.output_roles) == {"new_accumulator", "new_opt_state", "new_counter"}
    assert "@opt_state" in str(go) and "@new_param" in str(go)
    # gb is untouched (pure transforms)
    assert "accumulator" not in gb.input_roles and "opt_state" not in gb.input_roles


@pytest.mark.parametrize("loss, scale", [("mean", 0.25), ("sum", 1.0)])
def test_accumulate_scales_the_loss_seed_not_the_gradients(loss, scale):
    p = init_params()
    gb = jg.backward(jg.trace(lambda p, x: jnp.mean(mlp(p, x)), p, X[:8], param_argnums=0))
    ga = jg.accumulate(gb, period=4, loss=loss)
    assert float(ga.info["loss_seed"].value) == scale  # the backward starts from the scale
    assert float(gb.info["loss_seed"].value) == 1.0  # gb is untouched
    added = ga.eqns[len(gb.eqns):]  # after the backward: loss scale, accumulation, counter
    grads = set(gb.outputs_with_role("grad"))
    assert not any(e.op == "mul" and grads & set(e.inputs) for e in added)
    acc = jax.tree.map(jnp.zeros_like, p)
    _, new_acc, _ = jg.compile(ga)(p, X[:8], acc, np.int32(0))
    want = jax.grad(lambda p: scale * jnp.mean(mlp(p, X[:8])))(p)
    assert_tree_close(new_acc, want, rtol=1e-6, atol=1e-8)


def test_optimizer_graphs_give_labels_their_role():
    opt = jg.Optimizer(mlp, SGD, loss="cross_entropy", period=2)
    opt.init(init_params(), X[:8], Y[:8])
    for name in ("forward", "grad", "opt"):
        roles = opt.graphs[name].input_roles
        assert roles.count("label") == 1 and "@label" in str(opt.graphs[name]), name


def test_transform_errors_name_the_problem():
    p = init_params()
    g = jg.trace(lambda p, x: jnp.mean(mlp(p, x)), p, X[:8], param_argnums=0)
    with pytest.raises(jg.TransformError, match="apply jg.backward"):
        jg.optimizer_step(g, SGD)
    gb = jg.backward(g)
    with pytest.raises(jg.TransformError, match="period"):
        jg.accumulate(gb, period=0)
    with pytest.raises(jg.TransformError, match="unknown loss type"):
        jg.accumulate(gb, period=2, loss="hinge")
    with pytest.raises(jg.TransformError, match="no state inputs"):
        jg.reset(gb)


def test_accumulate_scales_and_zeroes_each_period():
    p = init_params()
    gb = jg.backward(jg.trace(ce_loss, p, X[:8], Y[:8], param_argnums=0))
    f = jg.compile(jg.accumulate(gb, period=2, loss="mean"))
    acc = jax.tree.map(lambda a: jnp.full_like(a, 7.0), p)  # garbage: counter 0 ignores it
    loss, new_acc, counter = f(p, X[:8], Y[:8], acc, jnp.int32(0))
    want_loss, want_grads = VG_CE(p, X[:8], Y[:8])
    np.testing.assert_allclose(loss, want_loss / 2, rtol=1e-6)
    assert_tree_close(new_acc, jax.tree.map(lambda g: g / 2, want_grads), rtol=1e-6, atol=1e-8)
    assert int(counter) == 1
    _, acc2, counter = f(p, X[:8], Y[:8], new_acc, counter)
    assert_tree_close(acc2, want_grads, rtol=1e-6, atol=1e-8)
    assert int(counter) == 0


@pytest.mark.parametrize("k", [2, 4])
def test_k_micro_batches_equal_one_big_batch(k):
    big, tx = 32, optax.sgd(0.5)
    one = jg.Optimizer(mlp, tx, loss="cross_entropy", period=1)
    acc = jg.Optimizer(mlp, tx, loss="cross_entropy", period=k)
    s1 = one.init(copy(init_params()), X[:big], Y[:big])
    sk = acc.init(copy(init_params()), X[:big // k], Y[:big // k])
    _, grads = VG_CE(init_params(), X[:big], Y[:big])
    s1, _ = one.step(s1, X[:big], Y[:big])
    for i in range(k):
        sl = slice(i * big // k, (i + 1) * big // k)
        sk, _ = acc.step(sk, X[sl], Y[sl])
    assert_tree_close(acc.grad_acc(sk), grads, rtol=1e-6, atol=1e-7)
    assert_tree_close(sk.params, s1.params, rtol=1e-6, atol=1e-7)


def test_same_params_as_optax_multisteps():
    k, micro, tx = 4, 8, ADAM
    opt = jg.Optimizer(mlp, tx, loss="cross_entropy", period=k)
    state = opt.init(copy(init_params()), X[:micro], Y[:micro])
    ms = optax.MultiSteps(tx, every_k_schedule=k)
    params = init_params()
    ms_state = ms.init(params)

    @jax.jit
    def ms_step(params, ms_state, x, y):
        updates, ms_state = ms.update(VG_CE(params, x, y)[1], ms_state, params)
        return optax.apply_updates(params, updates), ms_state

    for i in range(3 * k):
        sl = slice(i * micro, (i + 1) * micro)
        state, _ = opt.step(state, X[sl], Y[sl])
        params, ms_state = ms_step(params, ms_state, X[sl], Y[sl])
    assert_tree_close(state.params, params, rtol=1e-5, atol=1e-6)


def _count_backend_compiles():
    events = []

    def listener(name, *args, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    return events, listener


@pytest.mark.parametrize("period,want", [(4, 3), (1, 2)])
def test_100_static_steps_compile_exactly(period, want):
    xs, ys = [jnp.asarray(X[i * 8:(i + 1) * 8]) for i in range(8)], [
        jnp.asarray(Y[i * 8:(i + 1) * 8]) for i in range(8)]
    params = copy(init_params(hidden=8 + period))  # shapes no other test compiled
    events, listener = _count_backend_compiles()
    try:
        opt = jg.Optimizer(mlp, optax.sgd(1e-3, momentum=0.9), loss="cross_entropy",
                           period=period)
        state = opt.init(params, xs[0], ys[0])
        for i in range(100):
            state, _ = opt.step(state, xs[i % 8], ys[i % 8])
        jax.block_until_ready(state.params)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(events) == want, events


def test_step_period_equals_micro_steps():
    k, micro = 4, 8
    one = jg.Optimizer(mlp, ADAM, loss="cross_entropy", period=k)
    fused = jg.Optimizer(mlp, ADAM, loss="cross_entropy", period=k)
    s1 = one.init(copy(init_params()), X[:micro], Y[:micro])
    s2 = fused.init(copy(init_params()), X[:micro], Y[:micro])
    r1, r2 = jg.Result(), jg.Result()
    for period in range(2):
        xs = X[period * k * micro:(period + 1) * k * micro].reshape(k, micro, 64)
        ys = Y[period * k * micro:(period + 1) * k * micro].reshape(k, micro)
        for i in range(k):
            s1, out = one.step(s1, xs[i], ys[i])
            r1.add(out)
        s2, out = fused.step_period(s2, xs, ys)
        r2.add(out)
    assert_tree_close(s2.params, s1.params, rtol=1e-5, atol=1e-6)
    assert_tree_close(s2.grad_acc, s1.grad_acc, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(r2.losses(), r1.losses(), rtol=1e-6)
    assert r1.ndata == r2.ndata == 2 * k * micro and r1.accuracy() == r2.accuracy()
    with pytest.raises(jg.JGraphError, match="stacked 4 deep"):
        fused.step_period(s2, xs[:2], ys[:2])


def deep_mlp(p, x):
    for w in p[:-1]:
        x = jnp.tanh(x @ w)
    return x @ p[-1]


def _period_temp(period, micro=16, width=64, depth=3):
    opt = jg.Optimizer(deep_mlp, optax.adam(1e-3), loss="cross_entropy", period=period)
    keys = jax.random.split(jax.random.PRNGKey(0), depth + 1)
    dims = [64] + [width] * depth + [10]
    params = [jax.random.normal(k, (a, b), F32) * F32(1 / np.sqrt(a)) for k, a, b in
              zip(keys, dims[:-1], dims[1:], strict=True)]
    x, y = X[:micro], Y[:micro]
    state = opt.init(params, x, y)
    xs, ys = np.stack([x] * period), np.stack([y] * period)
    fn = opt.period_function(xs, ys)
    compiled = fn.lower(state.params, state.grad_acc, state.opt_state, xs, ys).compile()
    stats = compiled.memory_analysis()
    state_bytes = sum(a.nbytes for a in jax.tree.leaves((state.params, state.grad_acc,
                                                         state.opt_state)))
    assert stats.alias_size_in_bytes == state_bytes  # every state buffer is donated and reused
    state_shapes = {f"f32[{','.join(map(str, np.shape(a)))}]" for a in jax.tree.leaves(params)}
    copies = [line for line in compiled.as_text().splitlines()
              if " copy(" in line and line.split("=")[1].split("{")[0].strip() in state_shapes]
    # From period 2 on, XLA copies no state buffer into place. (At period 1, XLA's CPU copy
    # insertion copies the params the backward pass reads before updating them in place.)
    assert period == 1 or not copies, copies[:3]
    footprint = stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    return stats.temp_size_in_bytes, footprint


def test_step_period_temp_is_independent_of_the_period():
    (t1, f1), (t2, f2), (t16, f16) = _period_temp(1), _period_temp(2), _period_temp(16)
    # The bar, with params, accumulators and optimizer state donated at every period, on temp
    # and on temp plus fresh (not aliased) outputs. (The micro-batch is small next to the
    # weights, as in training: the scan's slice of the input stack is one micro-batch of temp.)
    assert t16 <= 1.05 * t1 and f16 <= 1.05 * f1, (t1, t16, f1, f16)
    assert t16 <= 1.05 * t2 and f16 <= 1.05 * f2, (t2, t16, f2, f16)


def test_static_rejects_new_shapes_dynamic_rebuilds():
    st = jg.Optimizer(mlp, SGD, loss="cross_entropy")
    s = st.init(copy(init_params()), X[:8], Y[:8])
    with pytest.raises(jg.JGraphError, match="static=False"):
        st.step(s, X[:4], Y[:4])
    dyn = jg.Optimizer(mlp, SGD, loss="cross_entropy", static=False)
    s = dyn.init(copy(init_params()), X[:8], Y[:8])
    s, out8 = dyn.step(s, X[:8], Y[:8])
    s, out4 = dyn.step(s, X[:4], Y[:4])
    assert out8.ndata == 8 and out4.ndata == 4
    want = init_params()
    for sl in (slice(0, 8), slice(0, 4)):
        want = jax.tree.map(lambda p, g: p - 0.1 * g, want, VG_CE(want, X[sl], Y[sl])[1])
    assert_tree_close(s.params, want, rtol=1e-5, atol=1e-6)


def test_labels_one_hot_or_integer_and_mse():
    p = init_params()
    a = jg.Optimizer(mlp, SGD, loss="cross_entropy")
    b = jg.Optimizer(mlp, SGD, loss="cross_entropy")
    onehot = jax.nn.one_hot(Y[:8], 10, dtype=F32)
    sa, oa = a.step(a.init(copy(p), X[:8], Y[:8]), X[:8], Y[:8])
    sb, ob = b.step(b.init(copy(p), X[:8], onehot), X[:8], onehot)
    assert_tree_close(sa.params, sb.params, rtol=1e-6, atol=1e-7)
    assert int(oa.ncorrect) == int(ob.ncorrect) == int(np.sum(np.argmax(mlp(p, X[:8]), 1) == Y[:8]))
    mse = jg.Optimizer(mlp, SGD, loss="mse")
    sm, om = mse.step(mse.init(copy(p), X[:8], onehot), X[:8], onehot)
    want_loss, grads = jax.value_and_grad(lambda p: jnp.mean((mlp(p, X[:8]) - onehot) ** 2))(p)
    np.testing.assert_allclose(om.loss, want_loss, rtol=1e-6)
    assert_tree_close(sm.params, jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), rtol=1e-6,
                      atol=1e-7)


def test_reset_optimizer_restores_tx_init():
    opt = jg.Optimizer(mlp, ADAM, loss="cross_entropy", period=2)
    s = opt.init(copy(init_params()), X[:8], Y[:8])
    for _ in range(3):
        s, _ = opt.step(s, X[:8], Y[:8])
    assert int(s.counter) == 1
    kept = opt.reset(s, optimizer=False)
    assert int(kept.counter) == 0 and int(kept.opt_state[0].count) == 1
    assert all(float(jnp.abs(a).max()) == 0 for a in jax.tree.leaves(kept.grad_acc))
    fresh = opt.reset(kept, optimizer=True)
    assert_tree_close(fresh.opt_state, ADAM.init(fresh.params))


def test_remat_pass_through_gives_the_same_training():
    def deep(p, x):
        h = jax.checkpoint(lambda x: jnp.tanh(jnp.tanh(x @ p["w1"] + p["b1"])))(x)
        return h @ p["w2"] + p["b2"]

    plain = jg.Optimizer(deep, ADAM, loss="cross_entropy", period=2)
    remat = jg.Optimizer(deep, ADAM, loss="cross_entropy", period=2, remat=True)
    s1 = plain.init(copy(init_params()), X[:8], Y[:8])
    s2 = remat.init(copy(init_params()), X[:8], Y[:8])
    assert any("recompute" in e.tags for e in remat.graphs["grad"].eqns)
    assert not any("recompute" in e.tags for e in plain.graphs["grad"].eqns)
    for i in range(4):
        s1, _ = plain.step(s1, X[8 * i:8 * i + 8], Y[8 * i:8 * i + 8])
        s2, _ = remat.step(s2, X[8 * i:8 * i + 8], Y[8 * i:8 * i + 8])
    assert_tree_close(s2.params, s1.params, rtol=1e-6, atol=1e-7)
    pol = jg.Optimizer(mlp, SGD, loss="cross_entropy",
                       remat=jg.policies.nothing_saveable)
    pol.init(copy(init_params()), X[:8], Y[:8])  # builds the graphs, compiles only `reset`
    assert any("recompute" in e.tags for e in pol.graphs["grad"].eqns)


GOLDEN_SGD_STEP = """\
{ lambda a:f32[1]@param b:f32[2]@data c:f32[1]@accumulator d:i32[]@counter .
  let e:f32[2] = add b a
      f:f32[] = reduce_sum[axes=(0,)] e
      g:f32[2] = broadcast_in_dim[dims=()] 1.0:f32[]  # backward
      h:f32[] = reduce_sum[axes=(0,)] g               # backward
      i:f32[1] = reshape h                            # backward
      j:bool[] = eq d 0:i32[]
      k:f32[1] = broadcast_in_dim[dims=()] 0.0:f32[]
      l:f32[1] = select_n j c k
      m:f32[1] = add l i
      n:i32[] = add d 1:i32[]
      o:i32[] = rem n 3:i32[]
      p:f32[1] = mul -0.5:f32[] m
      q:f32[1] = add a p
  in ( f@loss m@new_accumulator o@new_counter q@new_param ) }"""


def test_printed_training_graph():
    """The ggml fixture's opt graph: accumulate over 3 micro-steps (zeroed at counter 0), SGD."""
    f = lambda p, x: jnp.sum(x + p["w"])  # noqa: E731
    gb = jg.backward(jg.trace(f, {"w": jnp.zeros((1,), F32)}, jnp.zeros((2,), F32),
                              param_argnums=0))
    go = jg.optimizer_step(jg.accumulate(gb, period=3, loss="sum"), optax.sgd(0.5))
    assert str(go) == GOLDEN_SGD_STEP
    assert str(jg.reset(go)).endswith("in ( 0:i32[]@new_counter b@new_accumulator ) }")


def test_static_steps_donate_state_buffers():
    opt = jg.Optimizer(mlp, ADAM, loss="cross_entropy", period=2)
    s0 = opt.init(copy(init_params()), X[:8], Y[:8])
    s1, _ = opt.step(s0, X[:8], Y[:8])  # grad graph: only the accumulators are donated
    assert all(a.is_deleted() for a in jax.tree.leaves(s0.grad_acc))
    assert not any(a.is_deleted() for a in jax.tree.leaves(s0.params))
    s2, _ = opt.step(s1, X[:8], Y[:8])  # opt graph: params, accumulators, optimizer state
    assert all(a.is_deleted() for a in jax.tree.leaves((s1.params, s1.grad_acc, s1.opt_state)))
    assert not any(a.is_deleted() for a in jax.tree.leaves(s2[:3]))  # (the counter is host)


def _buffers(state) -> dict:
    """Where each array of the state lives (scalars, such as adam's count, left out: no other
    state shares their shape, and XLA:CPU may write a scalar result anywhere)."""
    return {part: [a.unsafe_buffer_pointer() for a in jax.tree.leaves(getattr(state, part))
                   if a.size > 1]
            for part in ("params", "grad_acc", "opt_state")}


@pytest.mark.parametrize("period", [1, 2])
def test_each_state_is_updated_in_its_own_buffer(period):
    """JAX writes a result into the first unused donated argument of its shape, results in
    order: the step graphs return the accumulators (period > 1) before the params, so in the
    graphs' own order each period swapped the params' and accumulators' buffers and XLA copied
    both into and out of any loop updating them. Once warm, every state part stays in its
    buffers from period to period."""
    opt = jg.Optimizer(mlp, ADAM, loss="cross_entropy", period=period)
    state = opt.init(copy(init_params(hidden=64)), X[:8], Y[:8])
    for _ in range(period):  # (the first update may write the params the user gave elsewhere)
        state, _ = opt.step(state, X[:8], Y[:8])
    warm = _buffers(state)
    for _ in range(2 * period):
        state, _ = opt.step(state, X[:8], Y[:8])
        assert _buffers(state) == warm
