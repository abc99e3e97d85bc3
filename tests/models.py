"""The shared model corpus: small named loss functions that every transform is tested on.

Each `ModelSpec` holds a loss function, a maker of example arguments for a PRNG seed and a dtype
(float32 by default; float64 for gradient checks against finite differences), the arguments holding
parameters (`param_argnums`) and whether the function returns `(loss, aux)`. Shapes are tiny so the
whole corpus traces and runs in seconds. Names are stable: other test files select models by name.

    for spec in MODELS:
        args = spec.args(seed=0, dtype=jnp.float64)
        g = jg.trace(spec.fn, *args, param_argnums=spec.param_argnums, has_aux=spec.has_aux)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name


@dataclass(frozen=True)
class ModelSpec:
    name: str  # stable identifier, used as the pytest id
    fn: Callable  # the loss function: returns a scalar (or (scalar, aux) with has_aux)
    make_args: Callable[[np.random.Generator, Any], tuple]  # (rng, float dtype) -> args
    param_argnums: int | tuple[int, ...] = 0  # the arguments whose leaves are params
    has_aux: bool = False  # fn returns (loss, aux)
    note: str = ""  # what the model exercises

    def args(self, seed: int = 0, dtype=jnp.float32) -> tuple:
        return self.make_args(np.random.default_rng(seed), jnp.dtype(dtype))


# Example values come from numpy and are put on the device as they are: making them with
# jax.random would compile a kernel per shape, which dominates the time of the tests.
def _split(rng, n=2):
    return rng.spawn(n)


def _normal(rng, shape, dtype, scale=1.0, shift=0.0):
    value = shift + scale * rng.standard_normal(shape, dtype=np.float32)
    return jnp.asarray(value.astype(dtype))


def _randint(rng, shape, low, high):
    return jnp.asarray(rng.integers(low, high, shape, dtype=np.int32))


def _dense(key, n_in, n_out, dtype):
    kw, kb = _split(key)
    return {"w": _normal(kw, (n_in, n_out), dtype, n_in**-0.5),
            "b": _normal(kb, (n_out,), dtype, 0.1)}


def _apply_dense(p, x):
    return x @ p["w"] + p["b"]


# -- MLP and residual MLP ------------------------------------------------------------------------
def mlp(params, x):
    h = x
    for layer in params[:-1]:
        h = jnp.tanh(_apply_dense(layer, h))
    return jnp.mean(_apply_dense(params[-1], h) ** 2)


def _mlp_args(key, dtype, widths=(5, 8, 8, 3), batch=4):
    keys = _split(key, len(widths))
    shapes = zip(widths[:-1], widths[1:], strict=True)
    params = [_dense(k, a, b, dtype) for k, (a, b) in zip(keys, shapes, strict=False)]
    return params, _normal(keys[-1], (batch, widths[0]), dtype)


def residual_mlp(params, x):
    h = x
    for block in params:
        h = h + _apply_dense(block["out"], jax.nn.relu(_apply_dense(block["in"], h)))
    return jnp.mean(jnp.sum(h * h, axis=-1))


def _residual_args(key, dtype, width=6, hidden=10, blocks=3, batch=4):
    keys = _split(key, 2 * blocks + 1)
    params = [{"in": _dense(keys[2 * i], width, hidden, dtype),
               "out": _dense(keys[2 * i + 1], hidden, width, dtype)} for i in range(blocks)]
    return params, _normal(keys[-1], (batch, width), dtype)


# -- layer norm, attention, transformer block -----------------------------------------------------
def _layer_norm(p, x, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def _ln_params(key, width, dtype):
    ks, kb = _split(key)
    return {"scale": _normal(ks, (width,), dtype, 0.1, shift=1.0),
            "bias": _normal(kb, (width,), dtype, 0.1)}


def layer_norm(p, x):
    return jnp.sum(jnp.sin(_layer_norm(p, x)))


def _layer_norm_args(key, dtype):
    kp, kx = _split(key)
    return _ln_params(kp, 6, dtype), _normal(kx, (3, 6), dtype)


def _causal_attention(p, x, heads=2):
    t, d = x.shape[-2], x.shape[-1]
    qkv = x @ p["qkv"]  # [B, T, 3D]
    q, k, v = jnp.split(qkv, 3, axis=-1)
    split = lambda a: a.reshape(a.shape[:-1] + (heads, d // heads))
    q, k, v = split(q), split(k), split(v)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(d // heads, x.dtype))
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, jnp.finfo(x.dtype).min)
    attn = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(x.shape)
    return out @ p["proj"]


def _attention_params(key, d, dtype):
    kq, kp = _split(key)
    return {"qkv": _normal(kq, (d, 3 * d), dtype, d**-0.5),
            "proj": _normal(kp, (d, d), dtype, d**-0.5)}


def causal_attention(p, x):
    return jnp.mean(jnp.square(_causal_attention(p, x)))


def _attention_args(key, dtype, batch=2, t=4, d=8):
    kp, kx = _split(key)
    return _attention_params(kp, d, dtype), _normal(kx, (batch, t, d), dtype)


def _block(p, x):
    x = x + _causal_attention(p["attn"], _layer_norm(p["ln1"], x))
    h = jax.nn.gelu(_apply_dense(p["fc"], _layer_norm(p["ln2"], x)))
    return x + _apply_dense(p["out"], h)


def _block_params(key, d, dtype):
    k = _split(key, 5)
    return {"ln1": _ln_params(k[0], d, dtype), "attn": _attention_params(k[1], d, dtype),
            "ln2": _ln_params(k[2], d, dtype), "fc": _dense(k[3], d, 2 * d, dtype),
            "out": _dense(k[4], 2 * d, d, dtype)}


def transformer_block(p, x, y):
    out = _block(p, x)
    return jnp.mean(jnp.square(out - y)), {"out_norm": jnp.linalg.norm(out)}


def _transformer_args(key, dtype, batch=2, t=4, d=8):
    kp, kx, ky = _split(key, 3)
    return (_block_params(kp, d, dtype), _normal(kx, (batch, t, d), dtype),
            _normal(ky, (batch, t, d), dtype))


# -- CNNs ---------------------------------------------------------------------------------------
def _conv(w, x):  # NHWC, HWIO
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def cnn_pool_window(p, x, labels):
    h = jax.nn.relu(_conv(p["conv"], x) + p["b"])
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 1, 1, 1), "VALID")
    logits = h.reshape(h.shape[0], -1) @ p["head"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def cnn_pool_reshape(p, x, labels):
    h = jax.nn.relu(_conv(p["conv"], x) + p["b"])
    n, hh, ww, c = h.shape
    h = jnp.max(h.reshape(n, hh // 2, 2, ww // 2, 2, c), axis=(2, 4))
    logits = h.reshape(n, -1) @ p["head"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def _cnn_args(key, dtype, head_in):
    k = _split(key, 5)
    p = {"conv": _normal(k[0], (3, 3, 2, 4), dtype, 0.3), "b": _normal(k[1], (4,), dtype, 0.1),
         "head": _normal(k[2], (head_in, 3), dtype, 0.3)}
    return p, _normal(k[3], (2, 6, 6, 2), dtype), _randint(k[4], (2,), 0, 3)


# -- embeddings and losses -------------------------------------------------------------------------
def embedding(p, tokens, targets):
    h = jnp.take(p["embed"], tokens, axis=0)  # gather
    logits = jnp.tanh(h) @ p["embed"].T
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def _embedding_args(key, dtype, vocab=7, d=5):
    k = _split(key, 3)
    return ({"embed": _normal(k[0], (vocab, d), dtype)},
            _randint(k[1], (2, 3), 0, vocab),
            _randint(k[2], (2, 3), 0, vocab))


def xent_optax(p, x, labels):
    logits = _apply_dense(p, x)
    loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return loss, {"accuracy": accuracy, "logits": logits}


def xent_hand(p, x, labels):
    logp = jax.nn.log_softmax(_apply_dense(p, x))
    picked = jnp.take_along_axis(logp, labels[:, None], axis=-1)
    return -jnp.mean(picked)


def one_hot_xent(p, x, labels):
    logits = _apply_dense(p, x)
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    return jnp.mean(optax.softmax_cross_entropy(logits, onehot))


def _classifier_args(key, dtype, n_in=5, classes=4, batch=6):
    k = _split(key, 3)
    return (_dense(k[0], n_in, classes, dtype), _normal(k[1], (batch, n_in), dtype),
            _randint(k[2], (batch,), 0, classes))


def logsumexp_model(p, x):
    return jnp.mean(jax.nn.logsumexp(_apply_dense(p, x), axis=-1)) + jax.nn.logsumexp(p["w"])


def _small_dense_args(key, dtype, n_in=5, n_out=4, batch=3):
    kp, kx = _split(key)
    return _dense(kp, n_in, n_out, dtype), _normal(kx, (batch, n_in), dtype)


def activations(p, x):
    h = _apply_dense(p, x)
    return jnp.mean(jax.nn.gelu(h) + jax.nn.gelu(h, approximate=False) + jax.nn.silu(h)
                    + jax.nn.softplus(h) + jax.nn.sigmoid(h) * jax.nn.relu(h))


# -- randomness, regions, nesting -----------------------------------------------------------------
def dropout(p, x, key):
    h = jnp.tanh(_apply_dense(p, x))
    keep = jax.random.bernoulli(key, 0.75, h.shape)
    h = jnp.where(keep, h / 0.75, jnp.zeros_like(h))
    return jnp.mean(h**2)


def _dropout_args(key, dtype):
    p, x = _small_dense_args(key, dtype)
    return p, x, jnp.asarray(np.array([0, 17], np.uint32))  # == jax.random.PRNGKey(17)


def _tanh_layer(p, h):
    return jnp.tanh(_apply_dense(p, h))


def checkpointed(params, x):
    outer = jax.checkpoint(lambda ps, h: _tanh_layer(ps[1], jax.checkpoint(_tanh_layer)(ps[0], h)))
    h = outer(params[:2], x)
    save_dots = jax.checkpoint(_tanh_layer, policy=jax.checkpoint_policies.dots_saveable)
    h = save_dots(params[2], h)
    h = checkpoint_name(h, "features")
    return jnp.mean(_apply_dense(params[3], h) ** 2)


def _four_layer_args(key, dtype, width=6, batch=3):
    return _mlp_args(key, dtype, widths=(width,) * 5, batch=batch)


def nested_jit(params, x):
    layer = jax.jit(_tanh_layer)
    two = jax.jit(lambda ps, h: layer(ps[1], layer(ps[0], h)))
    h = two(params[:2], x)
    h = layer(params[2], h)
    return jnp.mean(_apply_dense(params[3], h) ** 2)


class Affine(NamedTuple):
    w: jax.Array
    b: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Scale:
    gain: jax.Array
    offset: jax.Array
    label: str = dataclasses.field(default="scale", metadata={"static": True})


def pytree_params(params, batch):
    h = batch["x"] @ params["affine"].w + params["affine"].b
    for w in params["stack"]:
        h = jnp.tanh(h @ w)
    sign = 1.0 if params["scale"].label == "scale" else -1.0  # the static field is metadata
    h = sign * h * params["scale"].gain + params["scale"].offset
    return jnp.mean((h - batch["y"]) ** 2), {"pred": h}


def _pytree_args(key, dtype, d=4, batch=3):
    k = _split(key, 7)
    params = {"affine": Affine(_normal(k[0], (d, d), dtype, 0.5), _normal(k[1], (d,), dtype, 0.1)),
              "stack": [_normal(k[2], (d, d), dtype, 0.5), _normal(k[3], (d, d), dtype, 0.5)],
              "scale": Scale(_normal(k[4], (d,), dtype), _normal(k[5], (d,), dtype))}
    kx, ky = _split(k[6])
    return params, {"x": _normal(kx, (batch, d), dtype), "y": _normal(ky, (batch, d), dtype)}


def scan_layers(p, x):
    def step(h, w):
        h = jnp.tanh(h @ w + p["b"])
        return h, jnp.sum(h)

    h, sums = jax.lax.scan(step, x, p["ws"])
    _, back = jax.lax.scan(lambda c, w: (c * 0.5 + jnp.sum(w), c), jnp.zeros((), x.dtype),
                           p["ws"], reverse=True)
    return jnp.mean(h**2) + jnp.mean(sums) + 1e-3 * jnp.sum(back)


def _scan_args(key, dtype, layers=3, d=4, batch=2):
    k = _split(key, 3)
    return ({"ws": _normal(k[0], (layers, d, d), dtype, 0.5), "b": _normal(k[1], (d,), dtype, 0.1)},
            _normal(k[2], (batch, d), dtype))


MODELS: list[ModelSpec] = [
    ModelSpec("mlp", mlp, _mlp_args, note="tanh MLP, list of dict params"),
    ModelSpec("residual_mlp", residual_mlp, _residual_args, note="relu residual blocks"),
    ModelSpec("layer_norm", layer_norm, _layer_norm_args, note="mean/var/rsqrt"),
    ModelSpec("causal_attention", causal_attention, _attention_args,
              note="einsum batch dims, tril mask, softmax"),
    ModelSpec("transformer_block", transformer_block, _transformer_args, has_aux=True,
              note="pre-LN block, gelu MLP, aux norm"),
    ModelSpec("cnn_pool_window", cnn_pool_window, lambda k, d: _cnn_args(k, d, 2 * 2 * 4),
              note="conv + reduce_window max and sum, optax xent"),
    ModelSpec("cnn_pool_reshape", cnn_pool_reshape, lambda k, d: _cnn_args(k, d, 3 * 3 * 4),
              note="conv + reshape/max pooling"),
    ModelSpec("embedding", embedding, _embedding_args, note="gather lookup, tied head"),
    ModelSpec("xent_optax", xent_optax, _classifier_args, has_aux=True,
              note="optax integer-label xent, argmax accuracy aux"),
    ModelSpec("xent_hand", xent_hand, _classifier_args, note="log_softmax + take_along_axis"),
    ModelSpec("one_hot_xent", one_hot_xent, _classifier_args, note="one_hot + optax xent"),
    ModelSpec("logsumexp", logsumexp_model, _small_dense_args, note="jax.nn.logsumexp"),
    ModelSpec("activations", activations, _small_dense_args,
              note="gelu (tanh, erf), silu, softplus, sigmoid, relu"),
    ModelSpec("dropout", dropout, _dropout_args, note="bernoulli mask from an explicit key"),
    ModelSpec("checkpointed", checkpointed, _four_layer_args,
              note="nested jax.checkpoint, dots_saveable policy, checkpoint_name"),
    ModelSpec("nested_jit", nested_jit, _four_layer_args, note="jit inside jit"),
    ModelSpec("pytree_params", pytree_params, _pytree_args, has_aux=True,
              note="dict, list, NamedTuple, registered dataclass"),
    ModelSpec("scan_layers", scan_layers, _scan_args, note="lax.scan forward and reverse"),
]

BY_NAME: dict[str, ModelSpec] = {spec.name: spec for spec in MODELS}
