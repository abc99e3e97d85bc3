"""Helpers shared by the training transforms: the call structure of training graphs.

A training graph is called like the traced function with state arguments appended, and returns a
tuple: `backward` gives `(value, grads)`; `accumulate` appends the accumulator and counter
arguments and returns `(value, new_accumulators, new_counter)`; `optimizer_step` appends the
optimizer state argument and returns `(..., new_params, new_opt_state)`. Grads, accumulators and
params share one pytree structure, the grads tree, recorded in `graph.info["grads_tree"]`.
"""

from __future__ import annotations

import jax

from jgraph.errors import TransformError
from jgraph.ir import Graph, Var

LEAF = jax.tree.structure(0)  # the treedef of a single array


def skeleton(treedef):
    """A pytree of zeros with structure `treedef` (to rebuild tuples of treedefs)."""
    return jax.tree.unflatten(treedef, [0] * treedef.num_leaves)


def tuple_tree(treedefs) -> jax.tree_util.PyTreeDef:
    """The treedef of a tuple whose elements have the given treedefs."""
    return jax.tree.structure(tuple(skeleton(t) for t in treedefs))


def call_parts(treedef, what: str) -> list:
    """The element treedefs of a graph's tuple-shaped argument or result structure."""
    if treedef is None:
        raise TransformError(f"{what}: the graph has no pytree structure (trace it with jg.trace)")
    return list(treedef.children())


def grads_tree(graph: Graph):
    """The pytree structure of the gradients (== of the params they update)."""
    if "grads_tree" in graph.info:
        return graph.info["grads_tree"]
    parts = call_parts(graph.out_tree, "grads_tree")
    if len(parts) != 2 or "grad" not in graph.output_roles:
        raise TransformError("expected a joint graph from jg.backward, returning (value, grads)")
    return parts[1]


def grad_params(graph: Graph) -> list[Var]:
    """The param inputs in the order of the grad outputs (`Graph.grad_params`)."""
    return graph.grad_params()


def gradient_outputs(graph: Graph, what: str) -> tuple[list[int], str]:
    """Positions of the gradient outputs: accumulated (`new_accumulator`) or fresh (`grad`)."""
    for role in ("new_accumulator", "grad"):
        pos = [k for k, r in enumerate(graph.output_roles) if r == role]
        if pos:
            return pos, role
    raise TransformError(f"{what}: the graph has no gradient outputs; apply jg.backward first")


def with_labels(graph: Graph, argnum: int) -> Graph:
    """`graph` whose inputs from call argument `argnum` have the role `label` (ggml-opt's labels:
    data the loss compares predictions with)."""
    sizes = [t.num_leaves for t in call_parts(graph.in_tree, "with_labels")]
    start = sum(sizes[:argnum])
    roles = list(graph.input_roles)
    roles[start:start + sizes[argnum]] = ["label"] * sizes[argnum]
    return graph.replace(input_roles=tuple(roles))


def update_only(grad_graph: Graph) -> Graph:
    """`(params, acc) -> acc`: the accumulated gradient alone, for `optimizer_step` to update."""
    params = tuple(Var(p.aval) for p in grad_params(grad_graph))
    accs = tuple(Var(a.aval) for a in grad_graph.inputs_with_role("accumulator"))
    tree = grads_tree(grad_graph)
    return Graph(inputs=params + accs, eqns=(), outputs=accs,
                 input_roles=("param",) * len(params) + ("accumulator",) * len(accs),
                 output_roles=("new_accumulator",) * len(accs),
                 in_tree=tuple_tree([tree, tree]), out_tree=tuple_tree([tree]), param_argnums=0,
                 info={"grads_tree": tree})
