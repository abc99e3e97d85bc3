"""`jg.fuse_updates`: each update applied where its gradient is made.

The reference is the unfused step itself (`jg.optimizer_step` / `jg.accumulate`, already checked
against optax and JAX elsewhere): the fused step must return the same values bit for bit under
`jg.evaluate` and within 1e-6 normwise compiled. Structure: updates of a scanned model's stacked
params move into the backward scan (no stacked gradient), those of an unrolled model follow their
gradient; an update that needs every gradient first stays unfused with the eqn that prevents it in
`info["fuse_updates"]`. Memory: the donated step's compiled temp of a 64-layer scanned MLP loses
the stacked gradient.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from properties import examples

import jgraph as jg
from jgraph.fuse import without_grads

try:  # the optimizers optax's own alias tests run (a private module: skipped if optax moves it)
    from optax._src.alias_test import _OPTIMIZERS_UNDER_TEST as OPTAX_LIST
except ImportError:
    OPTAX_LIST = None

L = 3
X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)


def scanned_params():
    return {"w": jnp.stack([jnp.eye(4) * 0.5 + 0.01 * k for k in range(L)]),
            "b": jnp.full((L, 4), 0.1), "head": jnp.full((4, 2), 0.3)}


def scanned(p, x):
    def layer(h, wb):
        return jnp.tanh(h @ wb[0] + wb[1]), None

    h, _ = jax.lax.scan(layer, x, (p["w"], p["b"]))
    return jnp.mean((h @ p["head"]) ** 2)


def unrolled_params():
    return [{"w": jnp.eye(4) * 0.5 + 0.01 * k, "b": jnp.full((4,), 0.1 * k)} for k in range(L)]


def unrolled(p, x):
    h = x
    for layer in p:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return jnp.mean(h ** 2)


def step_graph(loss, params, tx, period=1):
    gb = jg.backward(jg.trace(loss, params, X, param_argnums=0))
    return jg.optimizer_step(gb if period == 1 else jg.accumulate(gb, period), tx)


def leaves(tree):
    """Flat arrays, PRNG keys as their key data (comparable with numpy)."""
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x) for x in jax.tree.leaves(tree)]


def assert_bitwise(got, want):
    got, want = leaves(got), leaves(want)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def assert_normwise(got, want, tol=1e-6):
    for a, b in zip(leaves(got), leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1e-30), (a, b)


def where(graph):
    return {path: r["where"] for path, r in graph.info["fuse_updates"].items()}


def fused_scans(graph):
    return [e for e in graph.eqns if e.op == "scan" and "backward" in e.tags]


# -- values: bitwise under evaluate, normwise compiled ---------------------------------------
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=2, decay_steps=10)
TXS = {
    "adam": optax.adam(1e-2),
    "adamw": optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": optax.sgd(0.1, momentum=0.9),
    "schedule": optax.adam(SCHEDULE),
}


@pytest.mark.parametrize("name", sorted(TXS))
def test_scanned_updates_move_into_the_backward_scan(name):
    tx, p = TXS[name], scanned_params()
    go = step_graph(scanned, p, tx)
    gu = jg.fuse_updates(go)
    jg.check(gu)
    assert "dynamic_update_slice" in str(gu)
    assert where(gu) == {"[0]['b']": "scan", "[0]['head']": "after", "[0]['w']": "scan"}
    assert all(r["fused"] and r["reason"] is None for r in gu.info["fuse_updates"].values())
    if name in ("adam", "schedule"):  # bias corrections, the learning rate: shared scalars
        (scan,) = fused_scans(gu)
        consts = scan.inputs[:scan.params["num_consts"]]
        assert len(consts) >= 2 and all(a.aval.shape == () for a in consts)
    state = tx.init(p)
    state = tx.update(p, state, p)[1]  # a step count above zero: the schedule moves
    want = jg.evaluate(go, p, X, state)
    assert_bitwise(jg.evaluate(gu, p, X, state), want)
    if name == "adam":  # compiled (one is enough: the same ops) and estimated
        assert_normwise(jg.compile(gu)(p, X, state), jg.compile(go)(p, X, state))
        assert jg.memory(gu).peak_bytes > 0


def per_row_normalized():
    """A transformation reducing each row of each layer's gradient (per-slice reductions)."""
    def scale(u):
        if u.ndim == 3:
            norm = jnp.sqrt(jnp.sum(u * u, axis=-1, keepdims=True)) + 1e-6
            return u / norm + 0.5 * jnp.transpose(u, (0, 2, 1))
        return u / (jnp.max(jnp.abs(u), axis=-1, keepdims=True) + 1e-6)

    return optax.stateless(lambda updates, params: jax.tree.map(scale, updates))


def test_per_slice_reductions_move_into_the_scan():
    p = {k: v for k, v in scanned_params().items() if k != "head"}
    p["w"] = p["w"] + jnp.linspace(-0.2, 0.2, p["w"].size).reshape(p["w"].shape)

    def loss(p, x):
        return scanned({**p, "head": jnp.full((4, 2), 0.3)}, x)

    tx = optax.chain(per_row_normalized(), optax.adam(1e-2))
    go = step_graph(loss, p, tx)
    gu = jg.fuse_updates(go)
    jg.check(gu)
    assert where(gu) == {"[0]['b']": "scan", "[0]['w']": "scan"}
    state = tx.init(p)
    assert_bitwise(jg.evaluate(gu, p, X, state), jg.evaluate(go, p, X, state))
    assert_normwise(jg.compile(gu)(p, X, state), jg.compile(go)(p, X, state))


def test_the_stacked_gradient_is_gone_without_grad_outputs():
    tx, p = optax.adam(1e-2), scanned_params()
    go = step_graph(scanned, p, tx)
    gu = jg.fuse_updates(go, keep_grads=False)
    jg.check(gu)
    assert "grad" not in gu.output_roles
    (scan,) = fused_scans(gu)
    stacked = {(L, 4, 4), (L, 4)}
    # the backward scan returns no stacked gradient, only the updated stacks (params, moments)
    ys = scan.outputs[scan.params["num_carry"]:]
    assert not [v for v in ys if v.aval.shape in stacked]
    state = tx.init(p)
    assert_bitwise(jg.evaluate(gu, p, X, state), jg.evaluate(without_grads(go), p, X, state))


def test_unrolled_updates_follow_their_gradients():
    tx, p = optax.sgd(0.1, momentum=0.9), unrolled_params()
    go = step_graph(unrolled, p, tx)
    gu = jg.fuse_updates(go, keep_grads=False)
    jg.check(gu)
    assert set(where(gu).values()) == {"after"}
    # each new param is made before the backward goes on to the layer below
    first_new = min(i for i, e in enumerate(gu.eqns)
                    if any(v in set(gu.outputs_with_role("new_param")) for v in e.outputs))
    last_backward = max(i for i, e in enumerate(gu.eqns) if "backward" in e.tags)
    assert first_new < last_backward
    state = tx.init(p)
    want = jg.evaluate(go, p, X, state)
    got = jg.evaluate(jg.fuse_updates(go), p, X, state)
    assert_bitwise(got, want)
    assert_normwise(jg.compile(gu)(p, X, state), jg.compile(without_grads(go))(p, X, state))


def test_global_norm_clipping_stays_unfused_and_says_why():
    tx, p = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), scanned_params()
    go = step_graph(scanned, p, tx)
    gu = jg.fuse_updates(go)
    jg.check(gu)
    for path, report in gu.info["fuse_updates"].items():
        assert not report["fused"], path
        # the norm's reduction, or (the head's gradient is not stacked) the add meeting it
        assert "reduce_sum" in report["reason"] or "several params" in report["reason"]
        assert "`" in report["reason"]
    state = tx.init(p)
    assert_bitwise(jg.evaluate(gu, p, X, state), jg.evaluate(go, p, X, state))


def test_global_norm_in_an_unrolled_model_names_where_the_gradients_meet():
    tx, p = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), unrolled_params()
    gu = jg.fuse_updates(step_graph(unrolled, p, tx))
    for report in gu.info["fuse_updates"].values():
        assert report["where"] == "end" and not report["fused"]
        assert report["reason"].startswith("needs the gradients of several params first: `")


@pytest.mark.parametrize("counter", [0, 1])
def test_accumulation_moves_into_the_backward_scan(counter):
    tx, p = optax.adam(1e-2), scanned_params()
    go = step_graph(scanned, p, tx, period=2)
    gu = jg.fuse_updates(go)
    jg.check(gu)
    assert where(gu) == {"[0]['b']": "scan", "[0]['head']": "after", "[0]['w']": "scan"}
    (scan,) = fused_scans(gu)
    written = {id(v) for v in scan.inputs}
    assert all(id(a) in written for a in go.inputs_with_role("accumulator")
               if a.aval.shape[:1] == (L,))
    acc = jax.tree.map(lambda a: jnp.full_like(a, 0.25), p)
    args = (p, X, acc, jnp.int32(counter), tx.init(p))
    assert_bitwise(jg.evaluate(gu, *args), jg.evaluate(go, *args))
    if counter:
        assert_normwise(jg.compile(gu)(*args), jg.compile(go)(*args))


def test_accumulation_alone_is_fused_too():
    p = scanned_params()
    ga = jg.accumulate(jg.backward(jg.trace(scanned, p, X, param_argnums=0)), 4)
    gu = jg.fuse_updates(ga)
    jg.check(gu)
    assert where(gu)["[0]['w']"] == "scan"
    args = (p, X, jax.tree.map(jnp.ones_like, p), jnp.int32(2))
    assert_bitwise(jg.evaluate(gu, *args), jg.evaluate(ga, *args))


def test_fusing_twice_changes_nothing():
    tx, p = optax.adam(1e-2), scanned_params()
    gu = jg.fuse_updates(step_graph(scanned, p, tx))
    again = jg.fuse_updates(gu)
    assert where(again)["[0]['w']"] == "scan"
    state = tx.init(p)
    assert_bitwise(jg.evaluate(again, p, X, state), jg.evaluate(gu, p, X, state))


# -- random graphs (jg.testing: scans, loops, conds, regions, ...) ------------------------------
RANDOM_TXS = {"adam": optax.adam(1e-2), "sgd_momentum": optax.sgd(0.1, momentum=0.9),
              "clipped_adamw": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))}


@examples(4)
@given(jg.testing.graphs(), st.sampled_from(sorted(RANDOM_TXS)), st.sampled_from([1, 2]))
def test_random_graphs_fused_equal_unfused(drawn, name, period):
    g, args = drawn
    tx = RANDOM_TXS[name]
    gb = jg.backward(g)
    go = jg.optimizer_step(gb if period == 1 else jg.accumulate(gb, period), tx)
    gu = jg.fuse_updates(go)
    jg.check(gu)
    n = g.param_argnums
    params = args[n] if isinstance(n, int) else tuple(args[i] for i in n)
    state = (tx.init(params),)
    if period > 1:
        state = (jax.tree.map(jnp.ones_like, params), jnp.int32(1), *state)
    assert_bitwise(jg.evaluate(gu, *args, *state), jg.evaluate(go, *args, *state))


# -- optax's own list of optimizers: each fused or reported with its reason ------------------
def optax_list():
    if OPTAX_LIST is None:
        return [pytest.param(None, marks=pytest.mark.skip("optax's alias_test is not there"))]
    return [pytest.param(row, id=f"{row['opt_name']}-{k}") for k, row in enumerate(OPTAX_LIST)]


# Optimizers whose values the default run compares (all of them under `-m slow`): the others'
# eqns are the same ops, and each `jg.evaluate` of a new one costs seconds of eager dispatch.
COMPARED = {"adam", "lion", "lamb", "sm3"}


def optax_step(row):
    name, kwargs = row["opt_name"], row["opt_kwargs"]
    with warnings.catch_warnings():  # optimistic_adam is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        tx, p = getattr(optax, name)(**kwargs), scanned_params()
    try:
        go = step_graph(scanned, p, tx)
    except Exception as e:  # noqa: BLE001 - polyak_sgd's update needs the loss value
        pytest.skip(f"jg.optimizer_step does not take {name}: {type(e).__name__}")
    return tx, p, go


@pytest.mark.parametrize("row", optax_list())
def test_optax_optimizers_are_fused_or_say_why(row):
    tx, p, go = optax_step(row)
    gu = jg.fuse_updates(go)
    jg.check(gu)
    for path, report in gu.info["fuse_updates"].items():
        if report["fused"]:
            assert report["where"] in ("scan", "after") and report["reason"] is None
        else:
            assert report["reason"] and "`" in report["reason"], (row, path, report)
        if path == "[0]['head']":  # not stacked: its update follows its gradient
            assert report["where"] in ("after", "end")
    if row["opt_name"] in COMPARED:
        state = tx.init(p)
        assert_bitwise(jg.evaluate(gu, p, X, state), jg.evaluate(go, p, X, state))


@pytest.mark.slow
@pytest.mark.parametrize("row", optax_list())
def test_optax_optimizers_equal_the_unfused_step(row):
    tx, p, go = optax_step(row)
    state = tx.init(p)
    assert_bitwise(jg.evaluate(jg.fuse_updates(go), p, X, state), jg.evaluate(go, p, X, state))


# -- bad input -------------------------------------------------------------------------------
def test_bad_input_names_the_problem():
    gb = jg.backward(jg.trace(scanned, scanned_params(), X, param_argnums=0))
    with pytest.raises(jg.TransformError, match="no optimizer update"):
        jg.fuse_updates(gb)
    with pytest.raises(jg.GraphError, match="takes a jgraph Graph"):
        jg.fuse_updates("a graph")
    go = jg.optimizer_step(gb, optax.sgd(0.1))
    with pytest.raises(jg.TransformError, match="keep_grads must be a bool"):
        jg.fuse_updates(go, keep_grads="no")


# -- memory: the compiled donated step no longer holds the stacked gradient --------------------
def test_compiled_temp_loses_the_stacked_gradient():
    layers, width, batch = 64, 256, 128
    ws = jax.random.normal(jax.random.key(0), (layers, width, width)) * width ** -0.5
    x = jnp.ones((batch, width))

    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.mean(h ** 2)

    tx = optax.adam(1e-3)
    # a training step returns no gradients
    go = without_grads(jg.optimizer_step(jg.backward(jg.trace(loss, ws, x, param_argnums=0)), tx))
    gu = jg.fuse_updates(go)
    state = tx.init(ws)
    unfused = jg.compiled_memory(go, ws, x, state).temp_bytes
    fused = jg.compiled_memory(gu, ws, x, state).temp_bytes
    stacked_gradient = ws.size * 4  # 16 MiB
    assert fused <= unfused - 0.75 * stacked_gradient, (unfused / 2**20, fused / 2**20)
