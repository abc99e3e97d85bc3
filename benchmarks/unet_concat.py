"""Issue 42's U-Net-shaped MLP whose decoder reads each skip through `jnp.concatenate`: the least
plan (`budget="1%"`) against a `jax.checkpoint` around each layer function, traced by jgraph.

    python -m benchmarks.unet_concat [levels] [width] [batch]
"""

from __future__ import annotations

import sys
import warnings

import jax
import jax.numpy as jnp

import jgraph as jg
from jgraph.planner.validate import xla_temp


def unet(levels, width, batch, policy=None):
    def enc(h, w):
        return jax.nn.gelu(h @ w)

    def mid(h, w):
        return jnp.tanh(h @ w)

    def dec(h, skip, w):
        return jax.nn.gelu(jnp.concatenate([h, skip], -1) @ w)

    if policy is not None:
        enc, mid, dec = (jax.checkpoint(f, policy=policy) for f in (enc, mid, dec))

    def loss(params, x):
        h, skips = x, []
        for w in params["enc"]:
            h = enc(h, w)
            skips.append(h)
        h = mid(h, params["mid"])
        for w, skip in zip(params["dec"], reversed(skips), strict=True):
            h = dec(h, skip, w)
        return jnp.mean(h**2)

    k = jax.random.split(jax.random.key(0), 2 * levels + 2)
    params = {"enc": [jax.random.normal(k[i], (width, width)) / width**0.5 for i in range(levels)],
              "mid": jax.random.normal(k[levels], (width, width)) / width**0.5,
              "dec": [jax.random.normal(k[levels + 1 + i], (2 * width, width)) / width**0.5
                      for i in range(levels)]}
    return loss, params, jax.random.normal(k[-1], (batch, width))


def figures(levels=8, width=512, batch=256):
    """(least plan's temp, {arrangement: temp}) in bytes."""
    fn, params, x = unet(levels, width, batch)
    gb = jg.backward(jg.trace(fn, params, x, param_argnums=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jg.BudgetWarning)
        least = jg.remat(gb, budget="1%").info["remat"]["xla_temp"]
    hands = {}
    for name in ("nothing_saveable", "dots_saveable"):
        fh, _, _ = unet(levels, width, batch, getattr(jax.checkpoint_policies, name))
        hands[name] = xla_temp(jg.remat(jg.backward(jg.trace(fh, params, x, param_argnums=0))))
    return least, hands


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]] + [8, 512, 256][len(sys.argv) - 1:]
    least, hands = figures(*args)
    mib = 2**20
    print(f"least plan: {least / mib:.2f} MiB")
    for name, temp in hands.items():
        print(f"per-layer jax.checkpoint({name}): {temp / mib:.2f} MiB "
              f"(least plan / it = {least / temp:.3f})")
