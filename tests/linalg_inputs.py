"""Structured random inputs for linear-algebra tests (numpy float64; tests cast them): each maker
takes a `numpy.random.Generator` and returns an array."""

from __future__ import annotations

import numpy as np


def general(*shape, shift=3.0):
    """Random matrices, square ones shifted to be well conditioned."""
    def make(rng):
        a = rng.standard_normal(shape)
        return a + shift * np.eye(shape[-1]) if shape[-1] == shape[-2] else a
    return make


def spd(*shape):
    def make(rng):
        a = rng.standard_normal(shape)
        return a @ np.swapaxes(a, -1, -2) + shape[-1] * np.eye(shape[-1])
    return make


def triangular(*shape, lower=True):
    def make(rng):
        a = rng.standard_normal(shape) + 4 * np.eye(shape[-1])
        return np.tril(a) if lower else np.triu(a)
    return make


def _orthogonal(rng, batch, n):
    return np.linalg.qr(rng.standard_normal((*batch, n, n)))[0]


def separated_symmetric(*shape):
    """Q diag(1, 2, ..., n) Q^T: eigenvalues one apart."""
    def make(rng):
        q = _orthogonal(rng, shape[:-2], shape[-1])
        return (q * np.arange(1.0, shape[-1] + 1)[..., None, :]) @ np.swapaxes(q, -1, -2)
    return make


def separated_singular(*shape):
    """U diag(s) V^T with singular values 1.5, 2.5, ... (one apart)."""
    def make(rng):
        *batch, m, n = shape
        k = min(m, n)
        u, v = _orthogonal(rng, batch, m)[..., :k], _orthogonal(rng, batch, n)[..., :k]
        return (u * (np.arange(k) + 1.5)) @ np.swapaxes(v, -1, -2)
    return make


def normal(*shape):
    return lambda rng: rng.standard_normal(shape)


def uniform(*shape, lo=-2.0, hi=2.0):
    return lambda rng: rng.uniform(lo, hi, shape)


def positive(*shape):
    return uniform(*shape, lo=0.5, hi=2.0)


def probabilities(*shape):
    """Rows (last axis) summing to 1, no entry near 0."""
    def make(rng):
        p = rng.uniform(0.2, 1.0, shape)
        return p / p.sum(-1, keepdims=True)
    return make


def labels(*shape, classes):
    """Integer class labels (not differentiated)."""
    return lambda rng: rng.integers(0, classes, shape).astype(np.int32)


def binary(*shape):
    return lambda rng: rng.integers(0, 2, shape).astype(np.float64)
