"""Models built on linear algebra, trained by `jg.Optimizer` and by a hand-written optax loop.

- A Gaussian-process regression whose loss is the negative log marginal likelihood
  `y^T K^-1 y / 2 + log det K / 2`: cholesky, two triangular solves and the log-determinant from
  the factor's diagonal. Its hyperparameters (log length scale, log signal and noise variance) are
  trained.
- A small RealNVP-style flow: an invertible linear layer (its log |det| by `slogdet` of the
  learned matrix) and two affine coupling layers, trained by maximum likelihood.

Both must reach the same params as `optax` applied to `jax.value_and_grad`, step for step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.scipy.linalg import solve_triangular

import jgraph as jg

F32 = np.float32


def _train_both(fn, params, inputs, tx, steps, loss="sum"):
    """Params after `steps` steps of jg.Optimizer and of an optax loop on jax.value_and_grad."""
    opt = jg.Optimizer(fn, tx, loss=loss)
    state = opt.init(params, inputs)
    losses = []
    for _ in range(steps):
        state, out = opt.step(state, inputs)
        losses.append(float(out.loss))

    reduce = jnp.sum if loss == "sum" else jnp.mean

    @jax.jit
    def optax_step(p, s):
        value, grads = jax.value_and_grad(lambda p: reduce(fn(p, inputs)))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    p, s, ref_losses = params, tx.init(params), []
    for _ in range(steps):
        p, s, value = optax_step(p, s)
        ref_losses.append(float(value))
    return state.params, p, losses, ref_losses


def _assert_params_close(ours, theirs, rtol):
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=rtol)


# -- Gaussian process ------------------------------------------------------------------------------
def gp_negative_log_marginal_likelihood(p, data):
    x, y = data
    sq_dist = jnp.sum((x[:, None, :] - x[None, :, :]) ** 2, axis=-1)
    k = jnp.exp(p["log_signal"]) * jnp.exp(-0.5 * sq_dist / jnp.exp(2 * p["log_length"]))
    k = k + (jnp.exp(p["log_noise"]) + 1e-4) * jnp.eye(x.shape[0], dtype=x.dtype)
    chol = jnp.linalg.cholesky(k)
    alpha = solve_triangular(chol, y, lower=True)  # L^-1 y; y^T K^-1 y = |alpha|^2
    log_det = 2 * jnp.sum(jnp.log(jnp.diagonal(chol)))
    return 0.5 * jnp.dot(alpha, alpha) + 0.5 * log_det + 0.5 * x.shape[0] * math.log(2 * math.pi)


def _gp_data(n=24):
    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 3, (n, 1))
    y = np.sin(2 * x[:, 0]) + 0.1 * rng.standard_normal(n)
    return x.astype(F32), y.astype(F32)


def test_gaussian_process_marginal_likelihood_trains_as_optax():
    data = _gp_data()
    params = {"log_length": F32(0.5), "log_signal": F32(0.0), "log_noise": F32(-1.0)}
    fn = gp_negative_log_marginal_likelihood
    g = jg.trace(fn, params, data, param_argnums=0)
    assert {"cholesky", "triangular_solve"} <= {e.op for e in g.eqns}
    ours, theirs, losses, ref = _train_both(fn, params, data, optax.adam(0.05), steps=40)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    _assert_params_close(ours, theirs, rtol=1e-5)
    assert losses[-1] < losses[0] - 5  # it learned: the likelihood rose
    assert float(jnp.exp(ours["log_noise"])) < float(jnp.exp(params["log_noise"]))


# -- RealNVP-style flow ----------------------------------------------------------------------------
def _mlp(p, h):
    return jnp.tanh(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def flow_negative_log_likelihood(p, x):
    """Per-sample -log p(x): z = couplings(x W + b), log p = log N(z; 0, I) + log |det J|."""
    z = x @ p["w"] + p["b"]
    log_det = jnp.linalg.slogdet(p["w"])[1] * jnp.ones(x.shape[0], x.dtype)
    half = x.shape[1] // 2
    for k, coupling in enumerate(p["couplings"]):
        fixed, moved = (z[:, :half], z[:, half:]) if k % 2 == 0 else (z[:, half:], z[:, :half])
        st = _mlp(coupling, fixed)
        log_scale, shift = jnp.tanh(st[:, :half]), st[:, half:]
        moved = moved * jnp.exp(log_scale) + shift
        z = jnp.concatenate([fixed, moved] if k % 2 == 0 else [moved, fixed], axis=1)
        log_det = log_det + jnp.sum(log_scale, axis=1)
    log_normal = -0.5 * jnp.sum(z * z, axis=1) - 0.5 * x.shape[1] * math.log(2 * math.pi)
    return -(log_normal + log_det)


def _flow_params(dim=4, hidden=16, seed=0):
    rng = np.random.default_rng(seed)
    half = dim // 2

    def coupling():
        return {"w1": (0.3 * rng.standard_normal((half, hidden))).astype(F32),
                "b1": np.zeros(hidden, F32),
                "w2": (0.1 * rng.standard_normal((hidden, 2 * half))).astype(F32),
                "b2": np.zeros(2 * half, F32)}

    return {"w": (np.eye(dim) + 0.2 * rng.standard_normal((dim, dim))).astype(F32),
            "b": np.zeros(dim, F32), "couplings": [coupling(), coupling()]}


def _flow_data(n=128, dim=4):
    rng = np.random.default_rng(1)
    centers = rng.uniform(-2, 2, (3, dim))
    mix = rng.standard_normal((dim, dim)) * 0.5
    x = centers[rng.integers(0, 3, n)] + rng.standard_normal((n, dim)) @ mix
    return x.astype(F32)


def test_realnvp_flow_with_learned_slogdet_trains_as_optax():
    x, params = _flow_data(), _flow_params()
    fn = flow_negative_log_likelihood
    g = jg.trace(lambda p, x: jnp.mean(fn(p, x)), params, x, param_argnums=0)
    assert "lu" in {e.op for e in g.eqns}  # slogdet of the learned matrix
    ours, theirs, losses, ref = _train_both(fn, params, x, optax.adam(1e-2), steps=30,
                                            loss="mean")
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    _assert_params_close(ours, theirs, rtol=2e-5)
    assert losses[-1] < losses[0] - 0.5
