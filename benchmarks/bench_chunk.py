"""`jg.chunk_rows`: the loss head over chunks of rows against the whole head, in one process.

Rows: a loss head (layer norm, output projection `x @ w`, optax's integer-label cross-entropy,
mean over rows) of 2048 rows, d 256, vocabulary 32768, as a (2048, d) input and as a
(batch 8, seq 256, d) input with the projection tied to the embedding table, a token-wise
MLP (hidden 4d) inside the network (its output read by a cumsum over rows), and causal
self-attention over 2048 positions (over blocks of queries: its scores, 64 MiB); the compiled
donated step's temp (`jg.compiled_memory`) chunked in 8 and 16 against unchunked (the logits and
their cotangent, 256 MiB each, set the unchunked peak of the heads), and the step time
(interleaved medians).

    python -m benchmarks.bench_chunk [--quick]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import jgraph as jg
from benchmarks import interleaved_medians

MIB = 2**20


def _layer_norm(h, scale):
    mean = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def head_loss(params, x, labels):
    logits = _layer_norm(x, params["scale"]) @ params["w"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def tied_lm_head_loss(params, x, labels):
    logits = _layer_norm(x, params["scale"]) @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def mlp_inside_loss(params, x, labels):  # a token-wise MLP read on by a row-mixing op
    h = x + jnp.tanh(_layer_norm(x, params["scale"]) @ params["up"]) @ params["down"]
    return jnp.mean(jnp.cumsum(h, axis=0) ** 2)


def attention_loss(params, x, labels):  # causal self-attention over blocks of queries
    b, t, d = x.shape
    heads = 4

    def split(w):
        return (x @ w).reshape(b, t, heads, d // heads)

    s = jnp.einsum("bqhd,bkhd->bhqk", split(params["q"]), split(params["k"])) * (d // heads)**-0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), split(params["v"]))
    return jnp.mean((x + o.reshape(b, t, d) @ params["o"]) ** 2)


def setups(quick: bool):
    rows, d, vocab = (512, 128, 8192) if quick else (2048, 256, 32768)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    scale = jnp.ones(d)
    flat = ({"w": jax.random.normal(keys[0], (d, vocab)) * d**-0.5, "scale": scale},
            jax.random.normal(keys[1], (rows, d)),
            jax.random.randint(keys[2], (rows,), 0, vocab))
    batch = 8
    tied = ({"embed": jax.random.normal(keys[3], (vocab, d)) * d**-0.5, "scale": scale},
            flat[1].reshape(batch, rows // batch, d), flat[2].reshape(batch, rows // batch))
    logits = rows * vocab * 4
    hidden = 4 * d
    mlp = ({"up": jax.random.normal(keys[0], (d, hidden)) * d**-0.5, "scale": scale,
            "down": jax.random.normal(keys[3], (hidden, d)) * hidden**-0.5}, flat[1], flat[2])
    t, width = (512, 64) if quick else (2048, 128)
    attention = ({n: jax.random.normal(keys[i], (width, width)) * width**-0.5
                  for i, n in enumerate("qkvo")}, jax.random.normal(keys[1], (1, t, width)),
                 flat[2])
    return [(f"token-wise MLP inside ({rows} rows, d {d}, hidden {hidden})", mlp_inside_loss,
             mlp, rows * hidden * 4),
            (f"causal attention (1 x {t} positions, d {width}, 4 heads)", attention_loss,
             attention, 4 * t * t * 4),
            (f"head {rows} rows, d {d}, vocab {vocab}", head_loss, flat, logits),
            (f"tied LM head ({batch}, {rows // batch}) rows, d {d}, vocab {vocab}",
             tied_lm_head_loss, tied, logits)]


def rows(quick: bool = False) -> list[dict]:
    out = []
    for name, loss, args, logits in setups(quick):
        gb = jg.backward(jg.trace(loss, *args, param_argnums=0))
        whole = jg.compiled_memory(gb, *args).temp_bytes / MIB
        step = jg.compile(gb)
        for chunks in (8, 16):
            gc = jg.chunk_rows(gb, chunks=chunks)
            temp = jg.compiled_memory(gc, *args).temp_bytes / MIB
            chunked = jg.compile(gc)
            times = interleaved_medians({"whole": lambda s=step: s(*args),
                                         "chunked": lambda c=chunked: c(*args)},
                                        repeats=2 if quick else 5)
            out.append({"benchmark": f"chunk_rows temp MiB, {name}, chunks={chunks}",
                        "jgraph": temp, "reference": whole, "ratio": temp / whole,
                        "note": f"logits/hidden/scores {logits / MIB:.0f} MiB; time x"
                                f"{times['chunked'] / times['whole']:.2f} of unchunked"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    args = parser.parse_args()
    for row in rows(args.quick):
        print(f"{row['benchmark']}: {row['jgraph']:.1f} MiB chunked, {row['reference']:.1f} "
              f"MiB whole ({row['ratio']:.2f}x); {row['note']}")


if __name__ == "__main__":
    main()
