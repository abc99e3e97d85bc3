"""ggml's test-opt, rebuilt: the fixture's exact numbers (see shared/reference/ggml.md §3).

Fixture: 6 datapoints 0..5, a scalar-like weight w = 3, outputs = inputs + w, AdamW with
learning rate 1, b1 = b2 = 0, eps = 0, so every optimizer step moves w by exactly -sign(grad).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg

F32 = jnp.float32


def model(p, x):
    return x + p["w"]


def sign_adamw():
    return optax.adamw(1.0, b1=0.0, b2=0.0, eps=0.0, weight_decay=0.0)


SIGN_ADAMW = sign_adamw()  # one object: equal Optimizers share their executables


def fixture(loss="sum", period=1, physical=1, tx=None, static=True):
    opt = jg.Optimizer(model, tx or SIGN_ADAMW, loss=loss, period=period, static=static)
    state = opt.init({"w": jnp.array([3.0], F32)}, jnp.zeros((physical,), F32))
    return opt, state


def unsupervised():
    return jg.Dataset(np.arange(6, dtype=np.float32), shard_size=1)


def w_of(state):
    return float(state.params["w"][0])


@pytest.mark.parametrize("static", [True, False])
def test_grad_accumulates_without_stepping(static):  # T2
    opt, state = fixture(period=999999, static=static)
    history = []
    for x in range(6):
        state, _ = opt.step(state, jnp.array([x], F32))
        history.append(float(opt.grad_acc(state)["w"][0]))
    assert history == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert w_of(state) == 3.0


@pytest.mark.parametrize("mode", ["low", "high", "high_shuffled"])
def test_forward_backward(mode):  # T3
    opt, state = fixture()
    ds = unsupervised()
    result = jg.Result()
    loss, unc = result.loss()
    assert (result.ndata, loss) == (0, 0.0) and math.isnan(unc)
    assert all(math.isnan(v) for v in result.accuracy())
    if mode == "high_shuffled":
        ds.shuffle(jax.random.PRNGKey(1))
    if mode == "low":
        for x in range(6):
            result.add(opt.evaluate(state, jnp.array([x], F32)))
    else:
        state = jg.epoch(opt, state, ds, None, result, idata_split=0)
    assert w_of(state) == 3.0
    loss, unc = result.loss()
    assert result.ndata == 6 and abs(loss - 33.0) < 1e-10 and abs(unc - math.sqrt(3.5)) < 1e-10
    assert all(math.isnan(v) for v in result.accuracy())

    w0 = np.array(state.params["w"])
    for _ in range(10):
        state, _ = opt.step(state, jnp.array([5.0], F32))
    state = opt.reset(state._replace(params={"w": jnp.asarray(w0)}), optimizer=False)
    result.reset()
    if mode == "high_shuffled":
        ds.shuffle(jax.random.PRNGKey(2))
    if mode == "low":
        for x in range(6):
            state, out = opt.step(state, jnp.array([x], F32))
            result.add(out)
    else:
        state = jg.epoch(opt, state, ds, result, None, idata_split=6)
    assert w_of(state) == -3.0
    loss, unc = result.loss()
    assert result.ndata == 6 and abs(loss - 18.0) < 1e-10
    if mode != "high_shuffled":
        assert unc == 0.0
    assert all(math.isnan(v) for v in result.accuracy())


def test_epoch_vs_fit_bitwise():  # T4
    tx = optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    opt, state = fixture(tx=tx)
    ds = unsupervised().shuffle(jax.random.PRNGKey(3))
    state = jg.epoch(opt, state, ds, jg.Result(), None, idata_split=6)
    params, _ = jg.fit(model, {"w": jnp.array([3.0], F32)}, unsupervised(), loss="sum", tx=tx,
                       epochs=1, batch_size=1, val_split=0.0, progress=False)
    assert np.asarray(params["w"]).tobytes() == np.asarray(state.params["w"]).tobytes()
    assert abs(w_of(state) - 2.9940004) < 1e-6


@pytest.mark.parametrize("high_level", [False, True])
def test_idata_split(high_level):  # T5
    opt, state = fixture()
    ds = unsupervised()
    train, val = jg.Result(), jg.Result()
    for e in range(1, 5):
        if high_level:
            state = jg.epoch(opt, state, ds, train, val, idata_split=4)
        else:
            for x in range(4):
                state, out = opt.step(state, jnp.array([x], F32))
                train.add(out)
            for x in (4, 5):
                val.add(opt.evaluate(state, jnp.array([x], F32)))
        assert abs(w_of(state) - (3 - 4 * e)) < 1e-10
        loss, unc = train.loss()
        assert train.ndata == 4 and abs(loss - (28 - 16 * e)) < 1e-10 and abs(unc) < 1e-10
        loss, unc = val.loss()
        assert val.ndata == 2 and abs(loss - (15 - 8 * e)) < 1e-10
        assert abs(unc - math.sqrt(0.5)) < 1e-10
        assert all(math.isnan(v) for v in train.accuracy() + val.accuracy())
        train.reset()
        val.reset()


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("loss", ["sum", "mean"])
@pytest.mark.parametrize("physical", [2, 1])
def test_gradient_accumulation(physical, loss, static):  # T6
    period = 6 // physical
    opt, state = fixture(loss=loss, period=period, physical=physical, static=static)
    div = 6.0 if loss == "mean" else 1.0
    result = jg.Result()
    for e in range(1, 5):
        history = [0.0] * 6
        for x in range(0, 6, physical):
            state, out = opt.step(state, jnp.arange(x, x + physical, dtype=F32))
            result.add(out)
            history[x + physical - 1] = float(opt.grad_acc(state)["w"][0])
        want = [1, 2, 3, 4, 5, 6] if physical == 1 else [0, 2, 0, 4, 0, 6]
        np.testing.assert_allclose(history, np.array(want) / div, atol=1e-6, rtol=0)
        assert abs(w_of(state) - (3 - e)) < 1e-6
        assert result.ndata == 6 // physical
        assert abs(result.loss()[0] - (39 - 6 * e) / div) < 1e-6
        assert all(math.isnan(v) for v in result.accuracy())
        result.reset()


def test_regression_mse_fit():  # T7
    rng = np.random.default_rng(12345)
    x = (-100 + 200 * np.arange(201) / 200).astype(np.float32)[:, None]
    y = (1.2 * x + 3.4 + rng.normal(0, 0.1, x.shape)).astype(np.float32)
    params = {"a": jnp.array([1.0], F32), "b": jnp.array([3.0], F32)}
    ds = jg.Dataset(x, y, shard_size=201)
    params, history = jg.fit(lambda p, x: x * p["a"] + p["b"], params, ds, loss="mse",
                             tx=optax.adamw(0.1, weight_decay=0.0), epochs=100, batch_size=201,
                             progress=False)
    a_ls, b_ls = np.polyfit(x[:, 0].astype(np.float64), y[:, 0].astype(np.float64), 1)
    assert abs(float(params["a"][0]) - a_ls) < 1e-2 and abs(float(params["b"][0]) - b_ls) < 1e-2
    assert abs(float(params["a"][0]) - 1.2) < 1e-2 and abs(float(params["b"][0]) - 3.4) < 1e-2
    assert history.train_loss[-1] < history.train_loss[0]
