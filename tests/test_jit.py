"""`jg.jit`: the user's whole training step as one jgraph graph, planned whole, against
`jax.jit` of the same step written with `jax.value_and_grad`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg
from jgraph.dropin import ArgumentError

F32 = jnp.float32


def _mlp(layers=8, width=128, batch=256):
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width), F32)
          for _ in range(layers)]
    return ws, jnp.asarray(rng.standard_normal((batch, width)), F32)


def loss(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


def steps(tx, grad_fn):
    def train_step(params, opt_state, x):
        value, grads = grad_fn(loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return train_step


def _equal(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _close(got, want):
    """Normwise within 1e-5 of each other, leaf by leaf: gradients summed over chunks differ in
    their last bits, and adam, dividing by their root mean square, moves by more than that."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-5 * max(np.linalg.norm(b), 1e-30), (a, b)


def test_a_finished_step_kept_whole_reports_its_compiled_figure():
    """At a budget the unplanned step meets once adam is fused into the backward, the plan is
    "no remat" of the finished step: the report's figure of the finished step is its compile's,
    the figure the budget was checked against, not the model's prediction beside it."""
    rng = np.random.default_rng(1)
    ws = jnp.asarray(rng.standard_normal((8, 64, 64)) / 8, F32)
    x = jnp.asarray(rng.standard_normal((128, 64)), F32)
    tx = optax.adam(1e-3)

    def train_step(params, opt_state, x):
        def loss(ws, x):
            h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
            return jnp.mean(h**2)
        value, grads = jg.value_and_grad(loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    step = jg.jit(train_step, budget="99%", donate_argnums=(0, 1))
    report = step.graph(ws, tx.init(ws), x).info["remat"]
    assert report["plan"] == "no remat" and report["fused"] == ["[0]"], report
    assert report["finished_temp"] != report["no_remat_temp"]  # fusing changed the step
    assert report["finished_temp"] == report["xla_temp"]
    # the step as jg.jit runs it (its arguments in the user's order, not the measured step's):
    # the same buffers, up to a scalar's alignment
    compiled = step.lower(ws, tx.init(ws), x).compile().memory_analysis().temp_size_in_bytes
    assert abs(compiled - report["xla_temp"]) <= 256


@pytest.mark.filterwarnings("ignore::jgraph.BudgetWarning")  # adam's state: 50 % is not met
@pytest.mark.parametrize("budget", [None, "50%"])
def test_twenty_adam_steps_train_to_jax_parameters(budget):
    ws, x = _mlp()
    tx = optax.adam(1e-2)
    step = jg.jit(steps(tx, jg.value_and_grad), budget=budget, donate_argnums=(0, 1))
    reference = jax.jit(steps(tx, jax.value_and_grad), donate_argnums=(0, 1))
    mine = (jax.tree.map(jnp.copy, ws), tx.init(ws))
    theirs = (jax.tree.map(jnp.copy, ws), tx.init(ws))
    for _ in range(20):
        *mine, value = step(*mine, x)
        *theirs, want = reference(*theirs, x)
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want))
    _equal(mine, theirs)  # recomputation changes no sum: bitwise


def test_the_budget_plans_the_whole_step():
    ws, x = _mlp()
    tx = optax.adam(1e-2)
    state = tx.init(ws)
    plain = jg.jit(steps(tx, jg.value_and_grad), donate_argnums=(0, 1))
    with pytest.warns(jg.BudgetWarning):  # adam's state alone is more than a quarter
        planned = jg.jit(steps(tx, jg.value_and_grad), budget="25%", donate_argnums=(0, 1))
        graph = planned.graph(ws, state, x)
    assert any("recompute" in e.tags for e in graph.eqns)
    report = planned.info(ws, state, x)["remat"]
    assert report["plan"] != "no remat"

    def temp(step):
        return step.lower(ws, state, x).compile().memory_analysis().temp_size_in_bytes

    assert temp(planned) == report["xla_temp"] < temp(plain)


def test_the_graph_holds_the_step_and_names_its_roles():
    ws, x = _mlp(layers=2)
    tx = optax.sgd(0.1)
    step = jg.jit(steps(tx, jg.value_and_grad), donate_argnums=(0, 1))
    state = tx.init(ws)
    graph = step.graph(ws, state, x)
    n_params, n_state = len(ws), len(jax.tree.leaves(state))
    assert graph.input_roles == ("param",) * n_params + ("opt_state",) * n_state + ("data",)
    assert {"backward"} <= set().union(*(e.tags for e in graph.eqns))
    assert len(graph.outputs) == n_params + n_state + 1
    assert step.info(ws, state, x)["grad_calls"] == ["jg.value_and_grad"]
    jg.check(graph)


def test_a_signature_is_traced_once():
    ws, x = _mlp(layers=2)
    tx = optax.sgd(0.1)
    traces = []

    def train_step(params, opt_state, x):
        traces.append(1)
        return steps(tx, jg.value_and_grad)(params, opt_state, x)

    step = jg.jit(train_step)
    state = tx.init(ws)
    step(ws, state, x)
    step(ws, state, x)
    assert len(traces) == 1
    step(ws, state, x[:128])  # another batch size: another trace
    assert len(traces) == 2


def test_static_arguments_are_passed_through():
    ws, x = _mlp(layers=2)
    tx = optax.sgd(0.1)

    def train_step(params, opt_state, x, scale):
        value, grads = jg.value_and_grad(lambda p, x: scale * loss(p, x))(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def reference(params, opt_state, x, scale):
        value, grads = jax.value_and_grad(lambda p, x: scale * loss(p, x))(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    step = jg.jit(train_step, static_argnums=3)
    for scale in (1.0, 2.0):
        _equal(step(ws, tx.init(ws), x, scale),
               jax.jit(reference, static_argnums=3)(ws, tx.init(ws), x, scale))


def test_a_budget_without_a_gradient_of_jgraphs_names_the_fix():
    ws, x = _mlp(layers=2)
    tx = optax.sgd(0.1)
    step = jg.jit(steps(tx, jax.value_and_grad), budget="50%")
    with pytest.raises(ArgumentError, match="jg.value_and_grad"):
        step(ws, tx.init(ws), x)
    # without a budget it is only jax.jit
    want = jax.jit(steps(tx, jax.value_and_grad))(ws, tx.init(ws), x)
    _equal(jg.jit(steps(tx, jax.value_and_grad))(ws, tx.init(ws), x), want)


def test_a_budget_inside_the_step_and_on_jit_is_refused():
    ws, x = _mlp(layers=2)
    tx = optax.sgd(0.1)
    step = jg.jit(steps(tx, lambda f: jg.value_and_grad(f, budget="50%")), budget="50%")
    with pytest.raises(ArgumentError, match="budget"):
        step(ws, tx.init(ws), x)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ArgumentError, match="expected a function"):
        jg.jit(3)
    ws, x = _mlp(layers=2)
    step = jg.jit(lambda p, x, flag: loss(p, x), static_argnums=2)
    with pytest.raises(ArgumentError, match="not hashable"):
        step(ws, x, [1])
    with pytest.raises(ArgumentError, match="by position"):
        jg.jit(loss, static_argnames="x")
    with pytest.raises(ArgumentError, match="by position"):
        jg.jit(loss)(ws, x=x)


def test_a_flax_train_state_step():
    """The step as flax users write it: a linen model, `TrainState.apply_gradients`."""
    nn = pytest.importorskip("flax.linen")
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(3):
                x = nn.tanh(nn.Dense(64)(x))
            return nn.Dense(1)(x)

    model = MLP()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((128, 32)), F32)
    y = jnp.asarray(rng.standard_normal((128, 1)), F32)
    params = model.init(jax.random.PRNGKey(0), x)["params"]

    def make(grad_fn):
        def train_step(state, x, y):
            def loss_fn(params):
                return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)
            value, grads = grad_fn(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), value
        return train_step

    def fresh():
        return train_state.TrainState.create(apply_fn=model.apply,
                                             params=jax.tree.map(jnp.copy, params),
                                             tx=optax.adamw(1e-3))

    step = jg.jit(make(jg.value_and_grad), donate_argnums=0)
    reference = jax.jit(make(jax.value_and_grad), donate_argnums=0)
    mine, theirs = fresh(), fresh()
    for _ in range(5):
        mine, value = step(mine, x, y)
        theirs, want = reference(theirs, x, y)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(want))
    _equal(mine.params, theirs.params)
    assert int(mine.step) == 5
    graph = step.graph(fresh(), x, y)
    assert graph.input_roles.count("param") == len(jax.tree.leaves(params))


@pytest.mark.filterwarnings("ignore::jgraph.BudgetWarning")
def test_adam_moves_into_the_backward_scan_under_a_budget():
    """The user's optax update, written after the gradient call, is the graph's tail: under a
    budget the planner fuses it into the backward scan, so the stacked gradient is never made."""
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.standard_normal((32, 128, 128)) / np.sqrt(128), F32)
    x = jnp.asarray(rng.standard_normal((256, 128)), F32)

    def scanned(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.mean(h**2)

    tx = optax.adam(1e-3)

    def make(grad_fn):
        def train_step(params, opt_state, x):
            value, grads = grad_fn(scanned)(params, x)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value
        return train_step

    plain = jg.jit(make(jg.value_and_grad), donate_argnums=(0, 1))
    planned = jg.jit(make(jg.value_and_grad), budget="50%", donate_argnums=(0, 1))
    state = tx.init(ws)
    graph = planned.graph(ws, state, x)
    assert graph.info["remat"]["fused"] == ["[0]"]
    # the planner's own form of a step: the joint graph, then the step's tail, its loop modes
    assert set(graph.output_roles) == {"loss", "new_param", "new_opt_state", "metric"}
    assert "carry" in graph.info["remat"]["plan"]

    def temp(step):
        return step.lower(ws, state, x).compile().memory_analysis().temp_size_in_bytes

    theirs = jax.jit(make(jax.value_and_grad), donate_argnums=(0, 1)).lower(ws, state, x)
    assert temp(planned) < temp(plain) < theirs.compile().memory_analysis().temp_size_in_bytes
    want = jax.jit(make(jax.value_and_grad))(ws, state, x)
    got = planned(jnp.copy(ws), tx.init(ws), x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore::jgraph.BudgetWarning")
def test_a_step_computing_the_gradient_calls_inputs_is_planned_too():
    """A gradient call of values the step computed (a batch normalized first) is not the
    planner's own form of a step (the joint graph first): the step is planned as it is."""
    ws, x = _mlp(layers=4)
    tx = optax.sgd(0.1)

    def make(grad_fn):
        def train_step(params, opt_state, x):
            x = (x - x.mean(0)) / (x.std(0) + 1e-6)
            value, grads = grad_fn(loss)(params, x)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value
        return train_step

    step = jg.jit(make(jg.value_and_grad), budget="50%", donate_argnums=(0, 1))
    state = tx.init(ws)
    graph = step.graph(ws, state, x)
    assert "loss" not in graph.output_roles  # the step as traced
    assert graph.info["remat"]["plan"] != "no remat"
    got = step(jax.tree.map(jnp.copy, ws), tx.init(ws), x)
    want = jax.jit(make(jax.value_and_grad))(ws, state, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        # (XLA fuses the normalization into other kernels in the two programs: an ulp apart)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore::jgraph.BudgetWarning")
@pytest.mark.parametrize("budget", [None, "50%"])
def test_aux_and_grad_only_calls(budget):
    ws, x = _mlp(layers=4)
    tx = optax.sgd(0.1)

    def make(grad_fn, value_and_grad_fn):
        def with_aux(ws, x):
            return loss(ws, x), {"first": jnp.tanh(x @ ws[0]).mean()}

        def train_step(params, opt_state, x):
            grads, aux = grad_fn(with_aux, has_aux=True)(params, x)
            (value, _), _ = value_and_grad_fn(with_aux, has_aux=True)(params, x)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value, aux
        return train_step

    step = jg.jit(make(jg.grad, jg.value_and_grad), budget=budget, donate_argnums=(0, 1))
    want = jax.jit(make(jax.grad, jax.value_and_grad))(ws, tx.init(ws), x)
    got = step(jax.tree.map(jnp.copy, ws), tx.init(ws), x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert step.info(ws, tx.init(ws), x)["grad_calls"] == ["jg.grad", "jg.value_and_grad"]


@pytest.mark.filterwarnings("ignore::jgraph.BudgetWarning")
def test_without_donation_the_info_says_why_updates_stay():
    ws, x = _mlp(layers=2)
    tx = optax.adam(1e-2)
    step = jg.jit(steps(tx, jg.value_and_grad), budget="50%")
    info = step.info(ws, tx.init(ws), x)
    assert "donate" in info["updates"]
    assert not (info["remat"] or {}).get("fused")
    donated = jg.jit(steps(tx, jg.value_and_grad), budget="50%", donate_argnums=(0, 1))
    assert donated.info(ws, tx.init(ws), x)["updates"] is None


def test_per_example_gradients_under_vmap_in_the_step():
    """A gradient call under `jax.vmap` inside the step runs under the vmap (not planned)."""
    ws, x = _mlp(layers=2)

    def make(grad_fn):
        def step(params, x):
            per = jax.vmap(lambda xi: grad_fn(loss)(params, xi[None]), out_axes=0)(x)
            return jax.tree.map(lambda g: jnp.sqrt(jnp.sum(g**2)), per)
        return step

    want = jax.jit(make(jax.grad))(ws, x[:8])
    got = jg.jit(make(jg.grad))(ws, x[:8])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_numbers_are_traced_and_a_modules_other_leaves_are_static():
    """As `jax.jit`: a Python number argument is traced (a new learning rate, no new trace); as
    `equinox.filter_jit`: in a tree holding a function, only the arrays are."""
    ws, x = _mlp(layers=2)
    traces = []

    def make(grad_fn):
        def step(params, x, lr, model):
            traces.append(1)
            grads = grad_fn(loss)(params, x)
            return [p - lr * model["scale"] * g for p, g in zip(params, grads, strict=True)]
        return step

    model = {"act": jnp.tanh, "scale": jnp.float32(1.0)}
    jitted = jg.jit(make(jg.grad))
    reference = jax.jit(lambda p, x, lr, s: make(jax.grad)(p, x, lr, {"act": jnp.tanh,
                                                                      "scale": s}))
    for lr in (0.1, 0.2):
        _equal(jitted(ws, x, lr, model), reference(ws, x, lr, model["scale"]))
    assert len(traces) == 2  # one trace each: the new learning rate is a traced value


class _NnxMLP:
    """A small flax NNX model, its loss, and the tutorial's step written with a given `jit` and
    `value_and_grad` (`nnx.jit` / `nnx.value_and_grad`, or jgraph's)."""

    @staticmethod
    def objects(nnx):
        class MLP(nnx.Module):
            def __init__(self, rngs):
                self.layers = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(3)])
                self.head = nnx.Linear(32, 4, rngs=rngs)

            def __call__(self, x):
                for layer in self.layers:
                    x = jnp.tanh(layer(x))
                return self.head(x)

        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                                  loss=nnx.metrics.Average("loss"))
        return model, optimizer, metrics

    @staticmethod
    def step(jit, value_and_grad):
        def loss_fn(model, x, y):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

        @jit
        def train_step(model, optimizer, metrics, x, y):
            (value, logits), grads = value_and_grad(loss_fn, has_aux=True)(model, x, y)
            metrics.update(loss=value, logits=logits, labels=y)
            optimizer.update(model, grads)
        return train_step


def _batch(n=64):
    rng = np.random.default_rng(2)
    return (jnp.asarray(rng.standard_normal((n, 32)), F32),
            jnp.asarray(rng.integers(0, 4, n), jnp.int32))


@pytest.mark.filterwarnings("ignore::jgraph.BudgetWarning")
@pytest.mark.parametrize("budget", [None, "95%"])
def test_an_nnx_step_updates_its_objects_in_place_as_nnx_jit_does(budget):
    """The NNX tutorial's step: the model, the `nnx.Optimizer` and the `nnx.MultiMetric` are
    split into states (donated), and updated in place after each call, bitwise as `nnx.jit`
    with `nnx.value_and_grad` updates them."""
    nnx = pytest.importorskip("flax.nnx")
    x, y = _batch()
    traces = []
    step = _NnxMLP.step(lambda f: jg.jit(lambda *a: traces.append(1) or f(*a), budget=budget,
                                         donate_argnums=(0, 1, 2)), jg.value_and_grad)
    reference = _NnxMLP.step(lambda f: nnx.jit(f, donate_argnums=(0, 1, 2)),
                             nnx.value_and_grad)
    mine, theirs = _NnxMLP.objects(nnx), _NnxMLP.objects(nnx)
    kernel = mine[0].head.kernel
    for _ in range(3):
        assert step(*mine, x, y) is None
        reference(*theirs, x, y)
    assert len(traces) == 1 and mine[0].head.kernel is kernel  # the caller's objects, in place
    chunked = budget is not None and (step.info(*mine, x, y)["remat"] or {}).get("chunked")
    same = _close if chunked else _equal  # (chunks change the sums' order)
    for a, b in zip(mine, theirs, strict=True):
        same(nnx.state(a), nnx.state(b))
    assert int(mine[1].step[...]) == 3
    same(mine[2].compute(), theirs[2].compute())

    graph = step.graph(*mine, x, y)
    n_params = len(jax.tree.leaves(nnx.state(mine[0], nnx.Param)))
    assert graph.input_roles.count("param") == graph.output_roles.count("new_param") == n_params
    n_state = len(jax.tree.leaves(nnx.state(mine[1:])))
    assert graph.input_roles.count("opt_state") == n_state
    assert graph.output_roles.count("new_opt_state") == n_state


def test_a_donated_state_is_updated_in_its_own_buffers_in_any_order_it_is_returned():
    """`jax.jit` writes each result into the first unused donated argument of its shape,
    results in order: a step returning its optimizer state before its params writes adam's
    first moment into the params' buffers (and XLA copies what it crosses so). `jg.jit` writes
    each new state into its own argument's buffers and returns the results as the step does."""
    ws, x = _mlp(layers=2, width=32, batch=16)
    tx = optax.adam(1e-3)

    def make(grad_fn):
        def train_step(params, opt_state, x):
            value, grads = grad_fn(loss)(params, x)
            updates, opt_state = tx.update(grads, opt_state, params)
            return opt_state, value, optax.apply_updates(params, updates)
        return train_step

    def pointers(params, opt_state):
        return [a.unsafe_buffer_pointer() for a in jax.tree.leaves((params, opt_state[0].mu))]

    results = {}
    for name, step in (("jax", jax.jit(make(jax.value_and_grad), donate_argnums=(0, 1))),
                       ("jgraph", jg.jit(make(jg.value_and_grad), donate_argnums=(0, 1)))):
        params, opt_state = [w + 0 for w in ws], tx.init(ws)  # buffers of their own, donated
        before = pointers(params, opt_state)
        opt_state, value, params = step(params, opt_state, x)
        results[name] = (opt_state, value, params, pointers(params, opt_state) == before)
    assert results["jgraph"][3]
    assert not results["jax"][3]  # (JAX's own order crosses them: what this test is about)
    _equal(results["jgraph"][:3], results["jax"][:3])


def test_a_non_donated_nnx_argument_is_written_back():
    """As `nnx.jit`: an NNX object the step mutates is updated in place donated or not, in a
    container beside arrays too; an object reached from two arguments is one object."""
    nnx = pytest.importorskip("flax.nnx")
    x, _ = _batch()

    class Counter(nnx.Module):
        def __init__(self):
            self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))
            self.total = nnx.BatchStat(jnp.zeros((), F32))

    def make(jit, grad):
        @jit
        def step(model, stats, ema):
            grads = grad(lambda m: jnp.mean(m(x) ** 2))(model)
            stats["counter"].calls[...] += 1
            stats["counter"].total[...] += stats["scale"] * jnp.sum(grads.head.kernel[...])
            ema[...] = 0.9 * ema[...] + 0.1 * model.head.bias[...]
            stats["optimizer"].update(model, grads)
            return stats["shared"].head.bias[...]  # the model itself, reached from `stats`
        return step

    def fresh():
        model = _NnxMLP.objects(nnx)[0]
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        return (model, {"counter": Counter(), "scale": jnp.float32(2.0), "shared": model,
                        "optimizer": optimizer}, nnx.Variable(jnp.zeros(4, F32)))

    step, reference = make(jg.jit, jg.grad), make(nnx.jit, nnx.grad)
    mine, theirs = fresh(), fresh()
    for _ in range(3):
        got, want = step(*mine), reference(*theirs)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(mine[1]["counter"].calls[...]) == 3
    _equal(nnx.state(mine[:2]), nnx.state(theirs[:2]))
    _equal(mine[2][...], theirs[2][...])
    assert float(jnp.max(jnp.abs(mine[2][...]))) > 0  # the ema moved
    assert mine[1]["shared"] is mine[0]


def test_what_nnx_jit_allows_and_jg_jit_does_not_is_a_clear_error():
    """A step that changes an NNX object's structure (a Variable added), or that returns an NNX
    object: `nnx.jit` runs both, `jg.jit` names what it does not support."""
    nnx = pytest.importorskip("flax.nnx")

    def grows(model):
        model.extra = nnx.BatchStat(jnp.zeros(()))

    def returns(model):
        return model

    for fun, message in ((grows, "changed the structure"), (returns, "returns an NNX object")):
        nnx.jit(fun)(_NnxMLP.objects(nnx)[0])
        with pytest.raises(ArgumentError, match=message):
            jg.jit(fun)(_NnxMLP.objects(nnx)[0])


def test_shardings_that_do_not_match_the_arguments_are_a_clear_error():
    """(Shardings on many devices: tests/test_sharding.py.) On one device: a prefix of the
    arguments and of the result is taken as jax.jit takes it; a tuple of the wrong length or
    that is no prefix of an argument names the argument."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    ws, x = _mlp(layers=2, width=16, batch=8)
    one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec())
    tx = optax.sgd(0.1)
    kw = dict(in_shardings=([one, one], None, one), out_shardings=(one, None, one))
    got = jg.jit(steps(tx, jg.value_and_grad), **kw)(ws, tx.init(ws), x)
    _equal(got, jax.jit(steps(tx, jax.value_and_grad), **kw)(ws, tx.init(ws), x))
    with pytest.raises(ArgumentError, match="in_shardings has 2 entries for 3"):
        jg.jit(steps(tx, jg.value_and_grad), in_shardings=(one, one))(ws, tx.init(ws), x)
    with pytest.raises(ArgumentError, match=r"in_shardings\[0\] is not a prefix"):
        jg.jit(steps(tx, jg.value_and_grad), in_shardings=([one] * 3, None, one))(
            ws, tx.init(ws), x)
