"""`check(graph)`: the IR's invariants, verified; a `GraphError` names the offending eqn.

Checked: every variable is defined once (inputs and eqn outputs), every use comes after its
definition, every output aval equals what the op's shape rule gives, every op has rules, roles are
known and one per input/output, a loss output is a floating scalar, and outputs are defined.
"""

from __future__ import annotations

import jax.numpy as jnp

from jgraph import ops
from jgraph.errors import GraphError
from jgraph.ir import INPUT_ROLES, OUTPUT_ROLES, Graph, Literal, Var, short_aval
from jgraph.printing import format_eqn


def _same_aval(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


def check(graph: Graph) -> Graph:
    """Raise `GraphError` if `graph` is malformed; return it unchanged otherwise."""
    _check_roles(graph)
    defined: set[Var] = set()
    for v in graph.inputs:
        if not isinstance(v, Var):
            raise GraphError(f"graph input {v!r} is not a Var")
        if v in defined:
            raise GraphError(f"input {v!r} appears twice among the graph inputs")
        defined.add(v)
    region_ids = {r.id for r in graph.regions}
    for i, eqn in enumerate(graph.eqns):
        where = f"eqn {i} `{format_eqn(eqn)}`" + (f" ({eqn.source})" if eqn.source else "")
        for k, a in enumerate(eqn.inputs):
            if isinstance(a, Var) and a not in defined:
                raise GraphError(f"{where}: input {k} is used before it is defined")
            if not isinstance(a, (Var, Literal)):
                raise GraphError(f"{where}: input {k} is not an atom: {a!r}")
        if not ops.has_op(eqn.op):
            raise GraphError(f"{where}: unknown op {eqn.op!r} (no shape rule or lowering)")
        try:
            want = ops.shape_rules[eqn.op](*(a.aval for a in eqn.inputs), **eqn.params)
        except Exception as e:
            raise GraphError(f"{where}: shape rule of {eqn.op!r} rejects its inputs: {e}") from e
        if len(want) != len(eqn.outputs):
            raise GraphError(f"{where}: {eqn.op!r} gives {len(want)} outputs, eqn has "
                             f"{len(eqn.outputs)}")
        for k, (v, aval) in enumerate(zip(eqn.outputs, want)):
            if not _same_aval(v.aval, aval):
                raise GraphError(f"{where}: output {k} has aval {short_aval(v.aval)} but the "
                                 f"shape rule of {eqn.op!r} gives {short_aval(aval)}")
            if v in defined:
                raise GraphError(f"{where}: output {k} is defined twice")
            defined.add(v)
        for r in eqn.regions:
            if r not in region_ids:
                raise GraphError(f"{where}: refers to unknown checkpoint region {r}")
    for k, a in enumerate(graph.outputs):
        if isinstance(a, Var) and a not in defined:
            raise GraphError(f"graph output {k} is dangling: no input or eqn defines it")
    return graph


def _check_roles(graph: Graph) -> None:
    if len(graph.input_roles) != len(graph.inputs):
        raise GraphError(f"{len(graph.inputs)} inputs but {len(graph.input_roles)} input roles")
    if len(graph.output_roles) != len(graph.outputs):
        raise GraphError(f"{len(graph.outputs)} outputs but {len(graph.output_roles)} output roles")
    for k, r in enumerate(graph.input_roles):
        if r not in INPUT_ROLES:
            raise GraphError(f"input {k} has unknown role {r!r} (known: {sorted(INPUT_ROLES)})")
    for k, r in enumerate(graph.output_roles):
        if r not in OUTPUT_ROLES:
            raise GraphError(f"output {k} has unknown role {r!r} (known: {sorted(OUTPUT_ROLES)})")
    for k, (a, r) in enumerate(zip(graph.outputs, graph.output_roles)):
        if r == "loss" and not (a.aval.shape == () and jnp.issubdtype(a.aval.dtype, jnp.floating)):
            raise GraphError(f"output {k} has role 'loss' but is {short_aval(a.aval)}, "
                             f"not a floating scalar")
    if graph.in_tree is not None and graph.in_tree.num_leaves != len(graph.inputs):
        raise GraphError(f"in_tree has {graph.in_tree.num_leaves} leaves for "
                         f"{len(graph.inputs)} inputs")
    if graph.out_tree is not None and graph.out_tree.num_leaves != len(graph.outputs):
        raise GraphError(f"out_tree has {graph.out_tree.num_leaves} leaves for "
                         f"{len(graph.outputs)} outputs")
