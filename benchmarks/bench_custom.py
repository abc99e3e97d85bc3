"""Custom-derivative lowering: what keeping the user's rule costs a compiled step (nothing).

`custom_jvp_call` / `custom_vjp_call` lower as `jax.custom_jvp` / `jax.custom_vjp` functions that
return the inlined values (`jgraph.custom_lowering`), so that a compiled step differentiated again
keeps the user's rule. Undifferentiated, XLA should see the same program as with the former
identity lowering: the rows compare the step time of `jg.compile(jg.backward(...))` with today's
lowering against the identity lowering, same process, interleaved runs, median (bar: ratio
<= 1.02), and say whether the optimized HLO is the same (instructions, names and metadata aside).
Models: an MLP of relu / softplus (library custom_jvps) and a user custom_vjp layer; a
transformer block (softmax, gelu).

    python -m benchmarks.bench_custom [--quick]
"""

from __future__ import annotations

import contextlib
import re
import sys

import jax
import jax.numpy as jnp

import jgraph as jg
from benchmarks import interleaved_medians
from benchmarks.bench_backward import _block_args, _mlp_args, transformer_block
from jgraph import ops


@jax.custom_vjp
def scaled_tanh(x):  # a user custom_vjp layer: tanh with a bwd of its own
    return jnp.tanh(x)


scaled_tanh.defvjp(lambda x: (jnp.tanh(x), jnp.tanh(x)), lambda y, g: ((1 - y * y) * g,))


def custom_mlp(params, x):
    h = x
    for k, (w, b) in enumerate(params[:-1]):
        z = h @ w + b
        h = (jax.nn.relu, jax.nn.softplus, scaled_tanh)[k % 3](z)
    w, b = params[-1]
    return jnp.mean((h @ w + b) ** 2)


def _identity(*values, n_primals=0, n_res=0, n_consts=0, **params):
    if "jvp" in params or "fwd" in params:  # custom_jvp_call, custom_vjp_call_lazy
        return list(values[n_consts + n_primals:])
    return list(values[n_primals + n_res:len(values) - n_consts])


@contextlib.contextmanager
def identity_lowering():
    """The lowering before the rule-keeping one: every custom op is the identity."""
    names = ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_lazy")
    saved = {n: ops.lowerings[n] for n in names}, dict(ops.expanded_lowerings)
    ops.lowerings.update(dict.fromkeys(names, _identity))
    ops.expanded_lowerings.update(dict.fromkeys(saved[1], _identity))
    try:
        yield
    finally:
        ops.lowerings.update(saved[0])
        ops.expanded_lowerings.update(saved[1])


def _instructions(jitted, args) -> list[str]:
    """The optimized HLO's instructions, without names and source metadata."""
    text = jitted.lower(*args).compile().as_text()
    lines = re.findall(r"^\s*(?:ROOT )?\S+ = .*$", text, re.M)
    return [re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", line))
            for line in lines]


def _row(name, fn, args, note, quick):
    joint = jg.backward(jg.trace(fn, *args, param_argnums=0))
    ours = jg.compile(joint)
    with identity_lowering():
        before = jg.compile(joint)
        before_hlo = _instructions(before, args)
    same = _instructions(ours, args) == before_hlo
    t = interleaved_medians({"new": lambda: ours(*args), "identity": lambda: before(*args)},
                            repeats=20 if quick else 200, warmup=3)
    return {"benchmark": f"custom-derivative lowering: {name}",
            "jgraph": f"{t['new'] * 1e3:.3f} ms", "reference": f"{t['identity'] * 1e3:.3f} ms",
            "ratio": t["new"] / t["identity"],
            "note": f"{note}; vs the identity lowering; optimized HLO identical (names, "
                    f"metadata aside): {same}; bar <= 1.02"}


def rows(quick: bool = False) -> list[dict]:
    width, layers, batch = (128, 6, 64) if quick else (512, 9, 256)
    b, t, d, heads = (2, 32, 64, 4) if quick else (8, 128, 256, 4)
    return [_row("MLP", custom_mlp, _mlp_args(width, layers, batch),
                 f"{layers} relu/softplus/custom_vjp layers of width {width}, batch {batch}",
                 quick),
            _row("transformer block", transformer_block, _block_args(b, t, d, heads),
                 f"softmax and gelu, B={b} T={t} D={d} H={heads}", quick)]


if __name__ == "__main__":
    for r in rows(quick="--quick" in sys.argv):
        print(f"{r['benchmark']}: {r['jgraph']} vs {r['reference']}, ratio {r['ratio']:.3f} "
              f"({r['note']})")
