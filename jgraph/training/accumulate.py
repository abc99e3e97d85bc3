"""`accumulate(g, period, loss)`: gradient accumulation over a period, as explicit state.

The input is a joint graph from `backward` (possibly rematerialized) returning `(value, grads)`.
The result takes one `accumulator` input per grad and a `counter` input (the micro-step's index in
the period) and returns `(value, new_accumulators, new_counter)`, where

    new_acc = (0 if counter == 0 else acc) + grad_s,    new_counter = (counter + 1) % period,

and grad_s is the gradient of `s * loss`. Accumulators are zeroed at the start of every period, in
static and dynamic mode alike (ggml's dynamic graphs never re-zero them: not copied). `s` is
ggml-opt's loss scale: per-datapoint losses (`mean`, `mse`, `cross_entropy`) are scaled by 1/period
so the accumulated gradient is the gradient of the whole logical batch; `sum` is never scaled.
Scaling the loss by `s` scales its cotangent seed: that is how the gradients are scaled, in one
place, the seed `backward` recorded (`info["loss_seed"]`), which becomes `s` (or `s * seed` for a
`loss_seed` input). The recorded loss is scaled too; result statistics undo that (`jg.Result`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import ShapedArray

from jgraph.builder import Builder
from jgraph.check import validate
from jgraph.errors import TransformError
from jgraph.ir import Graph, Literal, Var
from jgraph.training.graphs import LEAF, call_parts, gradient_outputs, grads_tree, tuple_tree

LOSS_SCALED_BY_PERIOD = {"sum": False, "mean": True, "mse": True, "cross_entropy": True}


def loss_scale(loss: str, period: int) -> float:
    """ggml-opt's scale of the per-micro-batch loss."""
    if loss not in LOSS_SCALED_BY_PERIOD:
        raise TransformError(f"unknown loss type {loss!r}; known: {sorted(LOSS_SCALED_BY_PERIOD)}")
    return 1.0 / period if LOSS_SCALED_BY_PERIOD[loss] else 1.0


def _scaled(x, *, scale):
    return x if scale == 1.0 else x * jnp.asarray(scale, x.dtype)


def _accumulate(acc, grad, counter):
    return jnp.where(counter == 0, jnp.zeros_like(acc), acc) + grad


def _next_counter(counter, *, period):
    return lax.rem(counter + 1, jnp.int32(period))


def accumulate(graph: Graph, period: int, loss: str = "mean") -> Graph:
    """The micro-step graph of gradient accumulation over `period` micro-batches.

    Args:
        graph: a joint graph from `jg.backward` (possibly rematerialized).
        period: micro-batches per optimizer step (a positive int).
        loss: `"mean"`, `"sum"`, `"mse"` or `"cross_entropy"`: per-datapoint losses (all but
            `"sum"`) are scaled by `1 / period`, so the accumulated gradient is the gradient of the
            whole logical batch (ggml-opt's loss scale).

    Returns:
        A `Graph` taking one `accumulator` input per grad and a `counter` input, returning
        `(value, new_accumulators, new_counter)`: `new_acc = (0 if counter == 0 else acc) +
        grad`, `new_counter = (counter + 1) % period`."""
    validate(graph, "jg.accumulate")
    if not isinstance(period, (int, np.integer)) or period < 1:
        raise TransformError(f"accumulate: period must be a positive int, got {period!r}")
    if "accumulator" in graph.input_roles:
        raise TransformError("accumulate: the graph already has accumulator inputs")
    grad_pos, role = gradient_outputs(graph, "accumulate")
    if role != "grad":
        raise TransformError("accumulate: the graph's gradients are already accumulated")
    scale = loss_scale(loss, int(period))
    tree = grads_tree(graph)
    value_tree, _ = call_parts(graph.out_tree, "accumulate")

    graph = _with_scaled_seed(graph, scale)
    b = Builder()
    accs = tuple(Var(graph.outputs[k].aval) for k in grad_pos)
    counter = Var(ShapedArray((), np.dtype(np.int32)))
    outputs = list(graph.outputs)
    for k, r in enumerate(graph.output_roles):
        if r == "loss":
            outputs[k] = b.call(_scaled, graph.outputs[k], scale=scale)[0]
    new_accs = [b.call(_accumulate, a, graph.outputs[k], counter)[0]
                for a, k in zip(accs, grad_pos, strict=True)]
    new_counter = b.call(_next_counter, counter, period=int(period))[0]
    value = [a for k, a in enumerate(outputs) if k not in grad_pos]
    value_roles = [r for k, r in enumerate(graph.output_roles) if k not in grad_pos]

    return graph.replace(
        inputs=graph.inputs + accs + (counter,),
        input_roles=graph.input_roles + ("accumulator",) * len(accs) + ("counter",),
        eqns=graph.eqns + tuple(b.eqns),
        outputs=tuple(value) + tuple(new_accs) + (new_counter,),
        output_roles=tuple(value_roles) + ("new_accumulator",) * len(accs) + ("new_counter",),
        in_tree=tuple_tree([*call_parts(graph.in_tree, "accumulate"), tree, LEAF]),
        out_tree=tuple_tree([value_tree, tree, LEAF]),
        info={**graph.info, "grads_tree": tree, "period": int(period), "loss": loss,
              "loss_scale": scale},
    )



def _with_scaled_seed(graph: Graph, scale: float) -> Graph:
    """`graph` whose backward starts from `scale` times its recorded loss seed."""
    seed = graph.info.get("loss_seed")
    if scale == 1.0 or seed is None:  # no seed: the loss does not depend on any param
        return graph
    b = Builder(tags={"backward"})
    if isinstance(seed, Literal):
        value = np.asarray(seed.value * scale, seed.aval.dtype)
        scaled = Literal(value[()], seed.aval)
    else:  # a loss_seed input: scale it where the backward starts
        scaled = b.call(_scaled, seed, scale=scale)[0]
    swap = lambda a: scaled if a is seed else a  # noqa: E731 - identity: the seed object itself
    eqns = tuple(dataclasses.replace(e, inputs=tuple(map(swap, e.inputs)))
                 if any(a is seed for a in e.inputs) else e for e in graph.eqns)
    first = next((i for i, e in enumerate(eqns) if "backward" in e.tags), len(eqns))
    return graph.replace(eqns=eqns[:first] + tuple(b.eqns) + eqns[first:],
                         outputs=tuple(map(swap, graph.outputs)),
                         info={**graph.info, "loss_seed": scaled})
