"""Models written the way users of flax (linen and nnx), haiku and equinox write them.

Each `RealModel` builds, once, a loss function over `(params, *rest)` and its example arguments,
with tiny sizes. The loss is what a user hands to `jax.value_and_grad`: for models with mutable
collections (BatchNorm statistics) it returns `(loss, new_state)` and `has_aux` is True, and the
state travels as an ordinary argument. Library code stays as it is; only the wiring around it
(`apply`, `merge`, `combine`) is ours. Used by `tests/test_real_models.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


@dataclass(frozen=True)
class RealModel:
    name: str  # the pytest id: library_model
    make: Callable[[], tuple]  # () -> (loss_fn, args); args[0] holds the params
    has_aux: bool = False  # the loss returns (loss, aux): new mutable state

    @functools.cached_property
    def built(self) -> tuple:
        return self.make()


def _data(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def _labels(seed, n, classes):
    return jnp.asarray(np.random.default_rng(seed).integers(0, classes, n, dtype=np.int32))


def _values(abstract, seed=0):
    """Arrays in the shapes of `abstract` (what `jax.eval_shape` of a library's `init` gives), as
    flax and haiku initialize them: weights normal with variance 1/fan-in, scales 1, biases and
    other vectors 0, integers 0. Values come from numpy: compiling each library's initializers
    would dominate the time of the tests."""
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        if len(leaf.shape) < 2 or not jnp.issubdtype(leaf.dtype, jnp.floating):
            one = any(w in jax.tree_util.keystr(path) for w in ("scale", "var"))
            return jnp.full(leaf.shape, 1 if one else 0, leaf.dtype)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        return jnp.asarray(noise / np.sqrt(np.prod(leaf.shape[:-1])), leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, abstract)


def _images(seed, shape, spatial=(1, 2)):
    """Images with a zero border two pixels wide on the `spatial` axes, as MNIST digits have: a
    convolution with zero bias gives exact zeros there (where relu's derivative matters)."""
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    inner = tuple(slice(2, -2) if a in spatial else slice(None) for a in range(len(shape)))
    border = np.zeros(shape, np.float32)
    border[inner] = 1.0
    return jnp.asarray(x * border)


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# -- flax linen ------------------------------------------------------------------------------------
class LinenConvBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(self.features, (3, 3), use_bias=False)(x)  # BatchNorm follows
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.relu(x)


class LinenCNN(nn.Module):  # flax's MNIST CNN, with BatchNorm and Dropout
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.Conv(4, (3, 3))(x))  # zero bias on zero pixels: relu'(0) matters
        x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = nn.remat(LinenConvBlock, static_argnums=(2,))(8)(x, train)
        x = x.reshape((x.shape[0], -1))
        x = nn.Dropout(0.25, deterministic=not train)(x)
        return nn.Dense(10)(x)


def linen_cnn():
    model, x, y = LinenCNN(), _images(0, (4, 8, 8, 1)), _labels(1, 4, 10)
    variables = _values(jax.eval_shape(functools.partial(model.init, train=False),
                                        jax.random.key(0), x))

    def loss(params, batch_stats, x, y, key):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x,
                                      train=True, rngs={"dropout": key}, mutable=["batch_stats"])
        return _xent(logits, y), updates["batch_stats"]

    args = (variables["params"], variables["batch_stats"], x, y, jax.random.key(1))
    return loss, args


class LinenGPTBlock(nn.Module):
    heads: int
    width: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(h)))
        return x + h


class LinenGPT(nn.Module):
    vocab: int = 16
    width: int = 8

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.width)
        x = embed(tokens) + self.param("pos", nn.initializers.normal(0.02),
                                       (tokens.shape[1], self.width))
        x = nn.remat(LinenGPTBlock)(2, self.width)(x)
        return embed.attend(nn.LayerNorm()(x))


def linen_gpt():
    model = LinenGPT()
    tokens = _labels(2, 2 * 6, 16).reshape(2, 6)
    params = _values(jax.eval_shape(model.init, jax.random.key(0), tokens))["params"]

    def loss(params, tokens):
        logits = model.apply({"params": params}, tokens)
        return _xent(logits[:, :-1], tokens[:, 1:])

    return loss, (params, tokens)


class LinenRNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.LSTMCell(8, param_dtype=x.dtype))(x)
        return nn.Dense(3)(h[:, -1])


def linen_lstm():
    model, x, y = LinenRNN(), _data(3, 2, 5, 4), _labels(4, 2, 3)
    params = _values(jax.eval_shape(model.init, jax.random.key(0), x))["params"]

    def loss(params, x, y):
        return _xent(model.apply({"params": params}, x), y)

    return loss, (params, x, y)


# -- flax nnx --------------------------------------------------------------------------------------
class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(6, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.2)
        self.fc2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs):
        return self.fc2(self.dropout(nnx.relu(self.norm(self.fc1(x))), rngs=rngs))


def nnx_mlp():
    abstract = nnx.eval_shape(lambda: NnxMLP(nnx.Rngs(0)))
    graphdef, params, stats = nnx.split(abstract, nnx.Param, nnx.BatchStat)
    params, stats = _values(params), _values(stats, seed=1)
    x, y = _data(5, 4, 6), _labels(6, 4, 4)

    def loss(params, stats, x, y, key):
        model = nnx.merge(graphdef, params, stats, copy=True)  # fresh Variables in this trace
        logits = model(x, nnx.Rngs(dropout=key))
        return _xent(logits, y), nnx.state(model, nnx.BatchStat)

    return loss, (params, stats, x, y, jax.random.key(1))


# -- haiku -----------------------------------------------------------------------------------------
def hk_mlp():  # a binary classifier whose output layer starts at zero, as many are initialized
    def forward(x):
        hidden = hk.remat(lambda x: hk.nets.MLP([16, 16], activation=jax.nn.gelu)(x))(x)
        return hk.Linear(1, w_init=jnp.zeros)(jax.nn.gelu(hidden))[:, 0]

    net = hk.without_apply_rng(hk.transform(forward))
    x, y = _data(7, 4, 6), _labels(8, 4, 2).astype(jnp.float32)
    params = jax.jit(net.init)(jax.random.key(0), x)

    def loss(params, x, y):  # the logits are 0 at the start: softplus'(0) matters
        return optax.sigmoid_binary_cross_entropy(net.apply(params, x), y).mean()

    return loss, (params, x, y)


def hk_resnet():
    def forward(x, is_training):
        net = hk.nets.ResNet(blocks_per_group=(1, 1, 1, 1), num_classes=5, bottleneck=False,
                             channels_per_group=(4, 4, 8, 8), strides=(1, 1, 1, 1),
                             bn_config={"decay_rate": 0.9})
        return net(x, is_training)

    net = hk.without_apply_rng(hk.transform_with_state(forward))
    x, y = _images(9, (2, 16, 16, 3)), _labels(10, 2, 5)
    params, state = _values(jax.eval_shape(functools.partial(net.init, is_training=True),
                                            jax.random.key(0), x))

    def loss(params, state, x, y):
        logits, state = net.apply(params, state, x, is_training=True)
        return _xent(logits, y), state

    return loss, (params, state, x, y)


def hk_lstm():
    def forward(xs):  # time major, as hk.dynamic_unroll wants
        core = hk.LSTM(8)
        hs, _ = hk.dynamic_unroll(core, xs, core.initial_state(xs.shape[1]))
        return hk.Linear(3)(hs[-1])

    net = hk.without_apply_rng(hk.transform(forward))
    xs, y = _data(11, 5, 2, 4), _labels(12, 2, 3)
    params = _values(jax.eval_shape(net.init, jax.random.key(0), xs))

    def loss(params, xs, y):
        return _xent(net.apply(params, xs), y)

    return loss, (params, xs, y)


# -- equinox ---------------------------------------------------------------------------------------
def _eqx_split(make):
    abstract = eqx.filter_eval_shape(make, jax.random.key(0))
    is_array = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    params, static = eqx.partition(abstract, is_array)
    return _values(params), static


def eqx_mlp():
    params, static = _eqx_split(
        lambda key: eqx.nn.MLP(6, 4, width_size=16, depth=2, activation=jax.nn.silu, key=key))
    x, y = _data(13, 4, 6), _data(14, 4, 4)

    def loss(params, x, y):
        model = eqx.combine(params, static)
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    return loss, (params, x, y)


class EqxCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    dropout: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 4, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(4, 8, 3, stride=2, key=k2)
        self.dropout = eqx.nn.Dropout(0.25)
        self.head = eqx.nn.Linear(8 * 3 * 3, 10, key=k3)

    def __call__(self, x, key):
        x = eqx.filter_checkpoint(lambda m, x: jax.nn.relu(m(x)))(self.conv1, x)
        x = jax.nn.relu(self.conv2(x))
        x = self.dropout(jnp.ravel(x), key=key)
        return self.head(x)


def eqx_cnn():
    params, static = _eqx_split(EqxCNN)
    x, y = _images(15, (4, 1, 8, 8), spatial=(2, 3)), _labels(16, 4, 10)

    def loss(params, x, y, key):
        model = eqx.combine(params, static)
        logits = jax.vmap(model)(x, jax.random.split(key, x.shape[0]))
        return _xent(logits, y)

    return loss, (params, x, y, jax.random.key(1))


def eqx_attention():
    params, static = _eqx_split(
        lambda key: eqx.nn.MultiheadAttention(2, 8, use_query_bias=True, use_output_bias=True,
                                              key=key))
    x = _data(17, 2, 5, 8)
    mask = jnp.tril(jnp.ones((5, 5), bool))

    def loss(params, x):
        model = eqx.combine(params, static)
        y = jax.vmap(lambda s: model(s, s, s, mask=mask))(x)
        return jnp.mean(jnp.tanh(y) ** 2)

    return loss, (params, x)


def eqx_gru():
    params, static = _eqx_split(lambda key: eqx.nn.GRUCell(4, 8, key=key))
    xs, y = _data(18, 6, 4), _data(19, 8)

    def loss(params, xs, y):
        cell = eqx.combine(params, static)

        def step(h, x):
            h = cell(x, h)
            return h, h

        h, _ = jax.lax.scan(jax.checkpoint(step), jnp.zeros(8), xs)
        return jnp.sum((h - y) ** 2)

    return loss, (params, xs, y)


MODELS = [
    RealModel("linen_cnn_batchnorm_dropout", linen_cnn, has_aux=True),
    RealModel("linen_gpt_block", linen_gpt),
    RealModel("linen_rnn_lstm", linen_lstm),
    RealModel("nnx_mlp_batchnorm_dropout", nnx_mlp, has_aux=True),
    RealModel("haiku_mlp", hk_mlp),
    RealModel("haiku_resnet", hk_resnet, has_aux=True),
    RealModel("haiku_lstm_dynamic_unroll", hk_lstm),
    RealModel("equinox_mlp", eqx_mlp),
    RealModel("equinox_cnn_dropout", eqx_cnn),
    RealModel("equinox_attention", eqx_attention),
    RealModel("equinox_gru_scan", eqx_gru),
]
