"""VJP rule of `fft` (all of `jnp.fft`): each transform is linear, its rule is its transpose.

The transposes, under JAX's pairing `Re sum(a * b)` (no conjugation), over the last
`len(fft_lengths)` axes, with N the product of `fft_lengths` and K = fft_lengths[-1] // 2 + 1:
- FFT and IFFT: the DFT matrix is symmetric, so each is its own transpose.
- RFFT (real -> K complex): x_n collects Re sum_k ct_k e^(-2 pi i k n / N), which is
  N * IRFFT(conj(ct) * h), h = 1/2 on the bins IRFFT counts twice (all but DC and Nyquist).
- IRFFT (K complex -> real): it reads only the real part of the DC and Nyquist bins and counts
  the others twice, so ct = conj(RFFT(ct_x)) / (h N) (real on DC and Nyquist).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jgraph.backward import defvjp

FftType = lax.FftType


def _half_weights(n_bins: int, length: int):
    """1 on the DC bin (and the Nyquist bin of an even length), 1/2 on the others."""
    h = np.full(n_bins, 0.5)
    h[0] = 1.0
    if length % 2 == 0:
        h[-1] = 1.0
    return h


def _fft_vjp(cts, ins, outs, *, fft_type, fft_lengths):
    (ct,), (x,) = cts, ins
    fft_type = FftType(fft_type)
    if fft_type in (FftType.FFT, FftType.IFFT):
        return [lax.fft(ct, fft_type, fft_lengths)]
    size, length = math.prod(fft_lengths), fft_lengths[-1]
    if fft_type == FftType.RFFT:
        h = _half_weights(ct.shape[-1], length).astype(x.dtype)
        return [lax.fft(jnp.conj(ct) * h, FftType.IRFFT, fft_lengths) * size]
    h = (1 / (_half_weights(x.shape[-1], length) * size)).astype(ct.dtype)
    return [jnp.conj(lax.fft(ct, FftType.RFFT, fft_lengths)) * h]


defvjp("fft", _fft_vjp)
