"""`check(graph)`: the IR's invariants, verified; a `GraphError` names the offending eqn.

Checked first, in one cheap pass (`jgraph.ir.check_fields`): every field has the IR's type
(tuples of `Var`s, `Literal`s, `Eqn`s, roles as strings, params as mappings, avals with a shape
and dtype), so that a hand-built graph gets a `GraphError` naming the field (`eqns[3].params`,
`outputs[0]`) and never an `AttributeError` from deep inside a pass or the printer. Then: every
variable is defined once (inputs and eqn outputs), every use comes after its definition, every
output aval equals what the op's shape rule gives, every op has rules, literals agree with their
avals, regions exist and nest, roles are known and one per input/output, a loss output is a
floating scalar, and outputs are defined. Messages quote the eqn as `str(graph)` prints it (same
variable names), with its index and the user's source line.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jgraph import config, control_flow, ops
from jgraph.errors import GraphError
from jgraph.ir import (
    INPUT_ROLES,
    OUTPUT_ROLES,
    TAGS,
    Graph,
    Literal,
    Var,
    check_fields,
    eqn_lines,
    is_extended,
    short_aval,
)
from jgraph.naming import var_name


def _same_aval(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


def validate(graph: Graph, what: str) -> Graph:
    """The check every public transform makes of its input: the structure (field types, atoms,
    definitions before use, roles, regions), cheap and linear; with `jgraph.config.check_graphs`
    (on in the test suite, or `JGRAPH_CHECK_GRAPHS=1`), the full `check`, shape rules included."""
    if not isinstance(graph, Graph):
        raise GraphError(f"{what} takes a jgraph Graph (from jg.trace), got "
                         f"{type(graph).__name__}")
    try:
        return check(graph, shapes=config.check_graphs)
    except GraphError as e:
        e.add_note(f"(the graph given to {what})")
        raise


def check(graph: Graph, *, shapes: bool = True) -> Graph:
    """Raise `GraphError` if `graph` is malformed; return it unchanged otherwise.

    Args:
        graph: any graph.
        shapes: also re-run every op's shape rule on its input avals. `shapes=False` checks the
            structure only (each value defined once, before its use; roles; regions), which is
            what the transforms' own validation does by default.

    Returns:
        `graph` itself, so that `jg.check(jg.backward(g))` chains.

    Raises:
        GraphError: naming the eqn that breaks an invariant of the IR."""
    check_fields(graph)
    _check_roles(graph)
    _check_regions(graph)
    defined: set[Var] = set()
    for k, v in enumerate(graph.inputs):
        if v in defined:
            raise GraphError(f"graph input {k} ({var_name(graph, v)}) appears twice among the "
                             f"inputs")
        defined.add(v)
    region_ids = {r.id for r in graph.regions}
    for i, eqn in enumerate(graph.eqns):
        for k, a in enumerate(eqn.inputs):
            if isinstance(a, Literal):
                _check_literal(graph, i, k, a)
            elif a not in defined:
                raise GraphError(f"{_where(graph, i)}: input {k} ({var_name(graph, a)}) is used "
                                 f"before it is defined")
        if not ops.has_op(eqn.op):
            raise GraphError(f"{_where(graph, i)}: unknown op {eqn.op!r} (no shape rule or "
                             f"lowering)")
        if shapes:
            try:
                want = ops.shape_rules[eqn.op](*(a.aval for a in eqn.inputs), **eqn.params)
            except Exception as e:
                raise GraphError(f"{_where(graph, i)}: the shape rule of {eqn.op!r} rejects its "
                                 f"inputs: {e}") from e
        else:
            want = [v.aval for v in eqn.outputs]
        if len(want) != len(eqn.outputs):
            raise GraphError(f"{_where(graph, i)}: {eqn.op!r} gives {len(want)} outputs, the eqn "
                             f"has {len(eqn.outputs)}")
        for k, (v, aval) in enumerate(zip(eqn.outputs, want, strict=True)):
            if shapes and not _same_aval(v.aval, aval):
                raise GraphError(f"{_where(graph, i)}: output {k} has aval {short_aval(v.aval)} "
                                 f"but the shape rule of {eqn.op!r} gives {short_aval(aval)}")
            if v in defined:
                raise GraphError(f"{_where(graph, i)}: output {k} ({var_name(graph, v)}) is "
                                 f"defined twice")
            defined.add(v)
        if not eqn.tags <= TAGS:
            raise GraphError(f"{_where(graph, i)}: unknown tags {sorted(eqn.tags - TAGS)} (known: "
                             f"{sorted(TAGS)})")
        _check_sub_graphs(graph, i, eqn, shapes)
        for r in eqn.regions:
            if r not in region_ids:
                raise GraphError(f"{_where(graph, i)}: refers to unknown checkpoint region {r}")
    _check_state_outputs(graph)
    for k, a in enumerate(graph.outputs):
        if isinstance(a, Var) and a not in defined:
            raise GraphError(f"graph output {k} ({var_name(graph, a)}@{graph.output_roles[k]}) is "
                             f"dangling: no input or eqn defines it")
    return graph


def _check_sub_graphs(graph: Graph, i: int, eqn, shapes: bool = True) -> None:
    """A control-flow eqn's sub-graphs are valid graphs that fit its operands."""
    subs = [(k, v) for k, value in eqn.params.items()
            for v in (value if isinstance(value, tuple) else (value,)) if isinstance(v, Graph)]
    for key, sub in subs:
        try:
            check(sub, shapes=shapes)
        except GraphError as e:
            raise GraphError(f"{_where(graph, i)}: in its {key}: {e}") from e
    if subs and shapes:
        problem = control_flow.signature_problem(eqn)
        if problem:
            raise GraphError(f"{_where(graph, i)}: {problem}")


def _where(graph: Graph, i: int) -> str:
    """`eqn 3 `d:f32[2] = tanh c` (file.py:12 (fn))`, with the names of `str(graph)`."""
    eqn = graph.eqns[i]
    text = eqn_lines(graph)[1][i]
    return f"eqn {i} `{text}`" + (f" ({eqn.source})" if eqn.source else "")


def _check_literal(graph: Graph, i: int, k: int, lit: Literal) -> None:
    value = lit.value if is_extended(lit.aval.dtype) else np.asarray(lit.value)
    shape, dtype = np.shape(value), getattr(value, "dtype", None)
    if shape != lit.aval.shape or dtype != lit.aval.dtype:
        raise GraphError(f"{_where(graph, i)}: literal input {k} holds a "
                         f"{dtype}{list(shape)} value but its aval is {short_aval(lit.aval)}")


def _check_state_outputs(graph: Graph) -> None:
    """Each grad output has its param's shape and dtype (in `param_argnums` order), and each new
    value of a state input (`new_accumulator`, `new_param`, ...) has that input's."""
    pairs = []
    grads = graph.outputs_with_role("grad")
    if grads:
        params = graph.grad_params()
        if len(grads) != len(params):
            raise GraphError(f"{len(grads)} grad outputs for {len(params)} params")
        pairs.append(("grad", grads, "param", params))
    for role in sorted(set(graph.output_roles)):
        if role.startswith("new_") and role[4:] in graph.input_roles:
            olds = graph.grad_params() if role == "new_param" else graph.inputs_with_role(role[4:])
            news = graph.outputs_with_role(role)
            if len(news) != len(olds):
                raise GraphError(f"{len(news)} {role} outputs for {len(olds)} {role[4:]} inputs")
            pairs.append((role, news, role[4:], olds))
    positions = {id(a): k for k, a in enumerate(graph.outputs)}
    for out_role, outs, in_role, ins in pairs:
        for n, (out, inp) in enumerate(zip(outs, ins, strict=True)):
            if not _same_aval(out.aval, inp.aval):
                raise GraphError(
                    f"output {positions[id(out)]} ({out_role} {n}) is {short_aval(out.aval)} but "
                    f"its {in_role} input {var_name(graph, inp)} is {short_aval(inp.aval)}")


def _check_regions(graph: Graph) -> None:
    seen: set[int] = set()
    for region in graph.regions:
        if region.id in seen:
            raise GraphError(f"checkpoint region {region.id} is listed twice")
        if region.parent is not None and region.parent not in seen:
            raise GraphError(f"checkpoint region {region.id} has parent {region.parent}, which is "
                             f"not listed before it")
        if region.policy is not None and not callable(region.policy):
            raise GraphError(f"checkpoint region {region.id} has policy {region.policy!r:.40}: a "
                             f"policy is a callable (from jg.policies) or None")
        seen.add(region.id)


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
    if graph.output_roles.count("loss") > 1:
        raise GraphError(f"{graph.output_roles.count('loss')} outputs have role 'loss' (outputs "
                         f"{[k for k, r in enumerate(graph.output_roles) if r == 'loss']}); a "
                         f"graph has at most one loss")
    for k, (a, r) in enumerate(zip(graph.outputs, graph.output_roles, strict=True)):
        if r == "loss" and not (a.aval.shape == () and jnp.issubdtype(a.aval.dtype, jnp.floating)):
            raise GraphError(f"output {k} has role 'loss' but is {short_aval(a.aval)}, "
                             f"not a floating scalar")
    if graph.in_tree is not None and graph.in_tree.num_leaves != len(graph.inputs):
        raise GraphError(f"in_tree has {graph.in_tree.num_leaves} leaves for "
                         f"{len(graph.inputs)} inputs")
    if graph.out_tree is not None and graph.out_tree.num_leaves != len(graph.outputs):
        raise GraphError(f"out_tree has {graph.out_tree.num_leaves} leaves for "
                         f"{len(graph.outputs)} outputs")
