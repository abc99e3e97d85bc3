"""ggml-opt's loss types, as functions of `(params, inputs[, labels])` built around the model.

The model `fn(params, inputs)` returns outputs. `sum` and `mean` reduce them (no labels);
`cross_entropy` and `mse` compare them with labels of the same shape (for `cross_entropy`, integer
class labels of one dimension less are one-hot encoded; a class id outside [0, classes) makes the
loss NaN, as optax's integer-label cross-entropy does, instead of a silent zero row).
`cross_entropy` also returns, as aux, the predictions (argmax over the last axis) and the count of
correct ones. The loss of one micro-batch
is unscaled here; `accumulate` applies ggml-opt's 1/period scaling.

`ndata` counts datapoints as ggml-opt does: the leading axis of outputs of rank >= 2, else 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jgraph.errors import TransformError

LOSSES = ("sum", "mean", "cross_entropy", "mse")
NEEDS_LABELS = frozenset({"cross_entropy", "mse"})


def log_softmax(logits):
    shifted = logits - lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))


def _as_targets(outputs, labels):
    if jnp.issubdtype(labels.dtype, jnp.integer) and labels.ndim == outputs.ndim - 1:
        if labels.shape != outputs.shape[:-1]:
            raise TransformError(f"class-id labels {labels.shape} do not match model outputs "
                                 f"{outputs.shape} (one id per row of {outputs.shape[-1]} "
                                 f"classes: labels of shape {outputs.shape[:-1]})")
        return jax.nn.one_hot(labels, outputs.shape[-1], dtype=outputs.dtype)
    if labels.shape != outputs.shape:
        raise TransformError(f"labels {labels.shape} do not match model outputs {outputs.shape}")
    return labels.astype(outputs.dtype)


def _are_class_ids(labels, outputs) -> bool:
    return jnp.issubdtype(labels.dtype, jnp.integer) and labels.ndim == outputs.ndim - 1


def _class_ids(labels, outputs):
    if _are_class_ids(labels, outputs):
        return labels.astype(jnp.int32)
    return jnp.argmax(labels, axis=-1).astype(jnp.int32)


def _nan_unless_valid(loss_value, labels, logits):
    """The loss, or NaN if a class id is out of range (a one-hot zero row would hide it)."""
    if not _are_class_ids(labels, logits):
        return loss_value
    valid = jnp.all((labels >= 0) & (labels < logits.shape[-1]))
    return jnp.where(valid, loss_value, jnp.nan)


def loss_function(fn, loss: str):
    """`(loss_fn, has_aux)`: the scalar loss of one micro-batch for ggml-opt loss type `loss`."""
    if loss not in LOSSES:
        raise TransformError(f"unknown loss type {loss!r}; known: {list(LOSSES)}")

    def sum_loss(params, inputs):
        return jnp.sum(fn(params, inputs))

    def mean_loss(params, inputs):
        return jnp.mean(fn(params, inputs))

    def mse_loss(params, inputs, labels):
        outputs = fn(params, inputs)
        diff = outputs - _as_targets(outputs, labels)
        return jnp.mean(diff * diff)

    def cross_entropy_loss(params, inputs, labels):
        logits = fn(params, inputs)
        nrows = max(1, logits.size // logits.shape[-1]) if logits.ndim else 1
        loss_value = -jnp.sum(_as_targets(logits, labels) * log_softmax(logits)) / nrows
        loss_value = _nan_unless_valid(loss_value, labels, logits)
        pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        ncorrect = jnp.sum(pred == _class_ids(labels, logits)).astype(jnp.int32)
        return loss_value, (pred, ncorrect)

    table = {"sum": (sum_loss, False), "mean": (mean_loss, False),
             "mse": (mse_loss, False), "cross_entropy": (cross_entropy_loss, True)}
    return table[loss]


def class_count(fn, loss: str, params, inputs, labels) -> int | None:
    """For `cross_entropy` with class-id labels, the number of classes (else None)."""
    if loss != "cross_entropy" or labels is None:
        return None
    logits = jax.eval_shape(fn, params, inputs)
    if not hasattr(logits, "shape") or not _are_class_ids(labels, logits):
        return None
    return int(logits.shape[-1])


def ndata_of(fn, params, inputs) -> int:
    """Datapoints per call as ggml-opt counts them (outputs' leading axis if rank >= 2, else 1)."""
    out = jax.eval_shape(fn, params, inputs)
    shape = jax.tree.leaves(out)[0].shape
    return int(shape[0]) if len(shape) >= 2 else 1
