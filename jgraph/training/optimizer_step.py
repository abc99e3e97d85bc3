"""`optimizer_step(g, tx)`: an optax update traced into IR eqns (ggml's OPT_STEP ops).

The input graph returns gradients: fresh (`grad`, from `backward`) or accumulated over a period
(`new_accumulator`, from `accumulate`). The result takes the optimizer state as extra inputs (role
`opt_state`, structured as `tx.init(params)`) and returns `(..., new_params, new_opt_state)`:
`tx.update` and `optax.apply_updates` are traced by `Builder.call` and appended as plain eqns, so
the step is part of the graph that later passes and the printer see. Any optax
`GradientTransformation` works; the update never needs a VJP.
"""

from __future__ import annotations

import jax
import optax
from jax.core import ShapedArray

from jgraph.builder import Builder
from jgraph.check import validate
from jgraph.errors import TransformError
from jgraph.ir import Graph, Var
from jgraph.training.graphs import (
    call_parts,
    grad_params,
    gradient_outputs,
    grads_tree,
    tuple_tree,
)


def opt_state_avals(tx, tree, param_avals):
    """Flat avals and treedef of `tx.init(params)` for params of these avals."""
    params = jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in param_avals])
    shapes = jax.eval_shape(tx.init, params)
    leaves, state_tree = jax.tree.flatten(shapes)
    return [ShapedArray(s.shape, s.dtype, weak_type=s.weak_type) for s in leaves], state_tree


def _update(*flat, tx, tree, state_tree):
    n, m = tree.num_leaves, state_tree.num_leaves
    grads = jax.tree.unflatten(tree, flat[:n])
    state = jax.tree.unflatten(state_tree, flat[n:n + m])
    params = jax.tree.unflatten(tree, flat[n + m:])
    updates, new_state = tx.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    return [*jax.tree.leaves(new_params), *jax.tree.leaves(new_state)]


def optimizer_step(graph: Graph, tx: optax.GradientTransformation) -> Graph:
    """Append the optimizer update to `graph`: new params and optimizer state become outputs.

    Args:
        graph: a joint graph (`jg.backward`) or an accumulation micro-step (`jg.accumulate`: the
            update then applies on the period's last micro-step).
        tx: an optax `GradientTransformation`; its update is traced into IR eqns.

    Returns:
        A `Graph` with `opt_state` inputs and `new_param` / `new_opt_state` outputs."""
    validate(graph, "jg.optimizer_step")
    if "opt_state" in graph.input_roles:
        raise TransformError("optimizer_step: the graph already has an optimizer step")
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TransformError(f"optimizer_step: {tx!r} is not an optax GradientTransformation")
    grad_pos, _ = gradient_outputs(graph, "optimizer_step")
    tree = grads_tree(graph)
    params = grad_params(graph)
    grads = [graph.outputs[k] for k in grad_pos]
    for p, g in zip(params, grads, strict=True):
        if p.aval.shape != g.aval.shape:
            raise TransformError(f"optimizer_step: grad {g.aval} does not match param {p.aval}")
    state_avals, state_tree = opt_state_avals(tx, tree, [p.aval for p in params])
    states = tuple(Var(a) for a in state_avals)

    b = Builder()
    outs = b.call(_update, *grads, *states, *params, tx=tx, tree=tree, state_tree=state_tree)
    new_params, new_states = outs[:len(params)], outs[len(params):]
    return graph.replace(
        inputs=graph.inputs + states,
        input_roles=graph.input_roles + ("opt_state",) * len(states),
        eqns=graph.eqns + tuple(b.eqns),
        outputs=graph.outputs + tuple(new_params) + tuple(new_states),
        output_roles=graph.output_roles + ("new_param",) * len(new_params)
        + ("new_opt_state",) * len(new_states),
        in_tree=tuple_tree([*call_parts(graph.in_tree, "optimizer_step"), state_tree]),
        out_tree=tuple_tree([*call_parts(graph.out_tree, "optimizer_step"), tree, state_tree]),
        info={**graph.info, "grads_tree": tree, "tx": tx, "opt_state_tree": state_tree},
    )
