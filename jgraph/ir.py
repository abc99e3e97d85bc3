"""The IR: variables, literals, equations and graphs, all immutable.

    graph  ::= { lambda <var>* . let <eqn>* in ( <atom>* ) }
    eqn    ::= <var>* = <op>[<params>] <atom>*
    atom   ::= <var> | <literal>

A `Var` is nothing but its abstract value; two variables are the same only if they are the same
Python object (`eq=False`). Names are invented when a graph is printed. The order of `Graph.eqns`
is the schedule: memory estimates and lowering follow it. Every input and output carries a role
(ggml's tensor flags made explicit), so transforms and callers never rely on positions by
convention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Union

import jax
import numpy as np
from jax.core import ShapedArray

# Roles of graph inputs.
INPUT_ROLES = frozenset(
    {"param", "data", "label", "accumulator", "opt_state", "loss_seed", "counter"}
)
# Roles of graph outputs: the loss, auxiliary values, gradients, per-step metrics, and the new
# value of each kind of state input.
OUTPUT_ROLES = frozenset(
    {"loss", "aux", "grad", "metric"} | {"new_" + r for r in INPUT_ROLES - {"data", "label"}}
)
# Tags an equation may carry.
TAGS = frozenset({"backward", "recompute", "no_cse"})


@dataclass(frozen=True, eq=False, slots=True)
class Var:
    aval: ShapedArray  # shape, dtype and weak type of the value

    def __repr__(self):
        return f"Var({short_aval(self.aval)})"


@dataclass(frozen=True, eq=False, slots=True)
class Literal:
    value: Any  # a numpy scalar or array of `aval`'s dtype (closed-over constants are literals too)
    aval: ShapedArray  # abstract value of `value`

    def __repr__(self):
        return f"Literal({self.value!r})"


Atom = Union[Var, Literal]


@dataclass(frozen=True, eq=False, slots=True)
class Eqn:
    op: str  # name of the op; its rules live in the tables of `jgraph.ops`, `jgraph.vjp_rules`, ...
    inputs: tuple[Atom, ...]  # operands
    params: Mapping[str, Any]  # static parameters of the op (the JAX primitive's params)
    outputs: tuple[Var, ...]  # results, each defined exactly once in a graph
    tags: frozenset[str] = frozenset()  # "backward", "recompute", "no_cse"
    regions: tuple[int, ...] = ()  # checkpoint regions holding this eqn, outermost first
    source: str = ""  # the user's source line that produced it ("file:line (function)")


@dataclass(frozen=True)
class Region:
    id: int  # unique within a graph; `Eqn.regions` refers to it
    parent: int | None  # enclosing region, or None
    policy: Callable | None  # a `jgraph.policies` policy; None saves nothing but the region inputs
    prevent_cse: bool = True  # as `jax.checkpoint(prevent_cse=...)`
    name: str = ""  # the checkpointed function's name, for printing and reports
    source: str = ""  # where the region was entered


@dataclass(frozen=True, eq=False)
class Graph:
    inputs: tuple[Var, ...]  # flat inputs, in the order of the flattened call arguments
    eqns: tuple[Eqn, ...]  # the schedule
    outputs: tuple[Atom, ...]  # flat outputs
    input_roles: tuple[str, ...]  # one of INPUT_ROLES per input
    output_roles: tuple[str, ...]  # one of OUTPUT_ROLES per output
    in_tree: Any = None  # treedef of the call's positional-argument tuple (None: flat call)
    out_tree: Any = None  # treedef of the call's result (None: tuple of flat outputs)
    regions: tuple[Region, ...] = ()  # checkpoint regions recorded while tracing
    param_argnums: int | tuple[int, ...] | None = None  # as given to `trace`; shapes grad outputs
    has_aux: bool = False  # the traced function returned (loss, aux)
    info: Mapping[str, Any] = field(default_factory=dict)  # side data of transforms (period, ...)

    def replace(self, **changes) -> Graph:
        return dataclasses.replace(self, **changes)

    def inputs_with_role(self, role: str) -> list[Var]:
        return [v for v, r in zip(self.inputs, self.input_roles, strict=True) if r == role]

    def outputs_with_role(self, role: str) -> list[Atom]:
        return [a for a, r in zip(self.outputs, self.output_roles, strict=True) if r == role]

    def region(self, region_id: int) -> Region:
        for r in self.regions:
            if r.id == region_id:
                return r
        from jgraph.errors import GraphError

        raise GraphError(f"the graph has no checkpoint region {region_id} (it has "
                         f"{[r.id for r in self.regions]})")

    def grad_params(self) -> list[Var]:
        """The param inputs in the order of the grad outputs: the `param_argnums` order, as
        `jax.value_and_grad(fn, argnums=param_argnums)` returns them."""
        n = self.param_argnums
        if n is None or self.in_tree is None:
            return self.inputs_with_role("param")
        argnums = (n,) if isinstance(n, int) else tuple(n)
        sizes = [t.num_leaves for t in self.in_tree.children()]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [self.inputs[starts[i] + k] for i in argnums for k in range(sizes[i])]

    def input_paths(self) -> list[str]:
        """Each input's place in the call arguments, as `[0]['w']` (`[k]` for flat graphs)."""
        if self.in_tree is None:
            return [f"[{k}]" for k in range(len(self.inputs))]
        tree = jax.tree.unflatten(self.in_tree, list(range(len(self.inputs))))
        paths = {k: jax.tree_util.keystr(path)
                 for path, k in jax.tree_util.tree_flatten_with_path(tree)[0]}
        return [paths[k] for k in range(len(self.inputs))]

    def __str__(self):
        from jgraph.printing import format_graph

        return format_graph(self)


def literal(value, dtype=None) -> Literal:
    """A literal of `value` (weakly typed if it is a Python scalar and no dtype is given)."""
    weak = dtype is None and isinstance(value, (bool, int, float, complex))
    if dtype is None:
        dtype = jax.dtypes.canonicalize_dtype(np.result_type(value))
    arr = np.asarray(value, dtype=dtype)
    aval = ShapedArray(arr.shape, arr.dtype, weak_type=weak)
    return Literal(arr[()] if arr.ndim == 0 else arr, aval)


def sub_graphs(eqn: Eqn) -> list[Graph]:
    """The graphs in an eqn's params (a loop's body, a cond's branches), in param order."""
    found = []
    for value in eqn.params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, Graph):
                found.append(v)
    return found


def literal_of(value, aval) -> Literal:
    """A literal of `aval` holding `value` as a numpy value of the aval's dtype.

    JAX hands the tracer typed Python scalars (`TypedFloat`, `TypedInt`) and device arrays; taken
    as they are, `np.asarray` would widen the scalars to 64 bits. Extended dtypes (PRNG keys),
    which numpy cannot hold, keep their JAX value."""
    if not is_extended(aval.dtype):
        value = np.asarray(value, dtype=aval.dtype)
        value = value[()] if value.ndim == 0 else value
    return Literal(value, aval)


def short_aval(aval) -> str:
    """`f32[3,4]`, as jaxprs print avals."""
    return aval.str_short(short_dtypes=True)


def is_extended(dtype) -> bool:
    """PRNG key and other extended dtypes, which numpy cannot represent."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def is_float(aval) -> bool:
    return jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)


def atom_aval(atom: Atom):
    return atom.aval
