"""The IR: variables, literals, equations and graphs, all immutable.

    graph  ::= { lambda <var>* . let <eqn>* in ( <atom>* ) }
    eqn    ::= <var>* = <op>[<params>] <atom>*
    atom   ::= <var> | <literal>

A `Var` is nothing but its abstract value; two variables are the same only if they are the same
Python object (`eq=False`). Names are invented when a graph is printed. The order of `Graph.eqns`
is the schedule: memory estimates and lowering follow it. Every input and output carries a role
(ggml's tensor flags made explicit), so transforms and callers never rely on positions by
convention.

Beside the types, what every layer above reads of them: the field checks (`check_fields`: every
field has the IR's type, so a hand-built graph gets a `GraphError` naming the field) and the text
form (`str(graph)`, below); `jgraph.naming` names an eqn in errors with it.

The text form is jaxpr-like. Printing is API: tests compare it to golden strings.

    { lambda a:f32[4,3]@param b:f32[2,4]@data .
      let c:f32[2,3] = dot_general[contract=[1]x[0]] b a
          d:f32[2,3] = tanh c                            # region 0
          e:f32[] = reduce_sum[axes=(0, 1)] d
      in ( e@loss ) }
    # region 0: checkpoint(layer)

Variables are named a, b, ..., z, ba, bb, ... in order of appearance; each input and output carries
`@role`. Params print as `key=value`, leaving out what the output aval already says (a broadcast's
or reshape's shape), defaults (None, `weak_type=False`, unit dilations, zero window padding) and
empty dimension-number fields; some ops print theirs compactly (`PARAM_VIEWS`, which `jgraph.ops`
fills: `dot_general`'s dimensions as `lhs x rhs`, a convolution's layouts as `N01C,01IO->N01C`).
Tags and regions follow an eqn as a comment; the regions of the graph are listed after it.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import jax
import numpy as np
from jax.core import ShapedArray

from jgraph.errors import GraphError

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
    """A variable: nothing but its abstract value; two are the same only if they are one object.

    Attributes:
        aval: the `ShapedArray`: shape, dtype and weak type of the value."""

    aval: ShapedArray  # shape, dtype and weak type of the value

    def __repr__(self):
        return f"Var({short_aval(self.aval)})"


@dataclass(frozen=True, eq=False, slots=True)
class Literal:
    """A constant operand of an eqn (closed-over constants are literals too).

    Attributes:
        value: a numpy scalar or array of `aval`'s dtype.
        aval: the abstract value of `value`."""

    value: Any  # a numpy scalar or array of `aval`'s dtype (closed-over constants are literals too)
    aval: ShapedArray  # abstract value of `value`

    def __repr__(self):
        return f"Literal({self.value!r})"


Atom = Union[Var, Literal]


@dataclass(frozen=True, eq=False, slots=True)
class Eqn:
    """One equation: `outputs = op[params] inputs`.

    Attributes:
        op: the op's name; its rules live in the tables of `jgraph.ops`, `jgraph.vjp_rules`, ...
        inputs: the operands (`Var`s and `Literal`s).
        params: the op's static parameters (the JAX primitive's params).
        outputs: the results (`Var`s), each defined exactly once in a graph.
        tags: `"backward"`, `"recompute"`, `"no_cse"`.
        regions: the checkpoint regions holding this eqn, outermost first.
        source: the user's source line that produced it (`"file:line (function)"`)."""

    op: str  # name of the op; its rules live in the tables of `jgraph.ops`, `jgraph.vjp_rules`, ...
    inputs: tuple[Atom, ...]  # operands
    params: Mapping[str, Any]  # static parameters of the op (the JAX primitive's params)
    outputs: tuple[Var, ...]  # results, each defined exactly once in a graph
    tags: frozenset[str] = frozenset()  # "backward", "recompute", "no_cse"
    regions: tuple[int, ...] = ()  # checkpoint regions holding this eqn, outermost first
    source: str = ""  # the user's source line that produced it ("file:line (function)")


@dataclass(frozen=True)
class Region:
    """A checkpoint region recorded while tracing (`jax.checkpoint`, `jg.checkpoint`, a plan's).

    Attributes:
        id: unique within a graph; `Eqn.regions` refers to it.
        parent: the enclosing region's id, or None.
        policy: a `jgraph.policies` policy; None saves nothing but the region's inputs.
        prevent_cse: as `jax.checkpoint(prevent_cse=...)`.
        name: the checkpointed function's name, for printing and reports.
        source: where the region was entered.
        outputs_recomputed: the backward reads recomputed outputs, as JAX's does."""

    id: int  # unique within a graph; `Eqn.regions` refers to it
    parent: int | None  # enclosing region, or None
    policy: Callable | None  # a `jgraph.policies` policy; None saves nothing but the region inputs
    prevent_cse: bool = True  # as `jax.checkpoint(prevent_cse=...)`
    name: str = ""  # the checkpointed function's name, for printing and reports
    source: str = ""  # where the region was entered
    outputs_recomputed: bool = False  # the backward reads recomputed outputs, as JAX's does


@dataclass(frozen=True, eq=False)
class Graph:
    """A graph: inputs, eqns in schedule order, outputs; every input and output with a role.

    `str(graph)` is its jaxpr-like text; `jg.check(graph)` its invariants. Graphs are immutable:
    transforms return new ones (`graph.replace(**fields)`).

    Attributes:
        inputs: the flat inputs (`Var`s), in the order of the flattened call arguments.
        eqns: the eqns, in schedule order.
        outputs: the flat outputs (`Var`s or `Literal`s).
        input_roles: one per input: `param`, `data`, `label`, `accumulator`, `opt_state`,
            `loss_seed`, `counter`.
        output_roles: one per output: `loss`, `aux`, `grad`, `metric`, or `new_` and an input
            role (`new_param`, `new_opt_state`, ...).
        in_tree: the treedef of the call's positional-argument tuple (None: a flat call).
        out_tree: the treedef of the call's result (None: a tuple of flat outputs).
        regions: the checkpoint regions recorded while tracing.
        param_argnums: as given to `jg.trace`; shapes the grad outputs.
        has_aux: the traced function returned `(loss, aux)`.
        info: side data of transforms (`info["remat"]`, `info["fuse_updates"]`, ...)."""

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


# -- field checks: every field has the IR's type (what printing and `check` rely on)
_TUPLES = ("inputs", "eqns", "outputs", "input_roles", "output_roles", "regions")


def _got(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _atom(a, where: str, kinds=(Var, Literal)) -> None:
    if not isinstance(a, kinds):
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        names = " or ".join(k.__name__ for k in kinds)
        raise GraphError(f"graph field `{where}` must be a {names}, got {_got(a)}")
    aval = a.aval
    if not isinstance(aval, ShapedArray) and not (
            hasattr(aval, "shape") and hasattr(aval, "dtype") and hasattr(aval, "str_short")):
        raise GraphError(f"graph field `{where}.aval` must be an abstract value (a "
                         f"jax.core.ShapedArray), got {_got(aval)}")


def check_fields(graph, deep: bool = False) -> None:
    """`GraphError` naming the first field of `graph` that does not have the IR's type; with
    `deep`, also the fields of its sub-graphs (what printing walks)."""
    if not isinstance(graph, Graph):
        raise GraphError(f"expected a jgraph Graph (from jg.trace), got {type(graph).__name__}")
    for name in _TUPLES:
        if not isinstance(getattr(graph, name), tuple):
            raise GraphError(f"graph field `{name}` must be a tuple, got "
                             f"{_got(getattr(graph, name))}")
    for k, v in enumerate(graph.inputs):
        _atom(v, f"inputs[{k}]", Var)
    for k, a in enumerate(graph.outputs):
        _atom(a, f"outputs[{k}]")
    for name in ("input_roles", "output_roles"):
        for k, r in enumerate(getattr(graph, name)):
            if not isinstance(r, str):
                raise GraphError(f"graph field `{name}[{k}]` must be a str, got {_got(r)}")
    for k, r in enumerate(graph.regions):
        if not isinstance(r, Region):
            raise GraphError(f"graph field `regions[{k}]` must be a Region, got {_got(r)}")
    for name in ("in_tree", "out_tree"):
        tree = getattr(graph, name)
        if tree is not None and not isinstance(tree, jax.tree_util.PyTreeDef):
            raise GraphError(f"graph field `{name}` must be a PyTreeDef or None, got "
                             f"{_got(tree)}")
    if not isinstance(graph.info, Mapping):
        raise GraphError(f"graph field `info` must be a mapping, got {_got(graph.info)}")
    _check_argnums(graph)
    atoms = (Var, Literal)
    for i, eqn in enumerate(graph.eqns):
        # the common case in one expression (this runs on every graph a transform is given);
        # `_eqn_fields` finds what is wrong
        if deep or not (
                type(eqn) is Eqn and type(eqn.op) is str and type(eqn.inputs) is tuple
                and type(eqn.outputs) is tuple and type(eqn.regions) is tuple
                and type(eqn.tags) is frozenset and isinstance(eqn.params, dict | Mapping)
                and all(type(a) in atoms and type(a.aval) is ShapedArray for a in eqn.inputs)
                and all(type(v) is Var and type(v.aval) is ShapedArray for v in eqn.outputs)
                and all(type(r) is int for r in eqn.regions)):
            _eqn_fields(eqn, f"eqns[{i}]", deep)


def _check_argnums(graph) -> None:
    argnums = graph.param_argnums
    if argnums is None:
        return
    nums = argnums if isinstance(argnums, tuple) else (argnums,)
    nargs = None if graph.in_tree is None else len(graph.in_tree.children())
    for n in nums:
        if (not isinstance(n, int) or isinstance(n, bool)
                or (nargs is not None and not -nargs <= n < nargs)):
            within = "" if nargs is None else f" (in [-{nargs}, {nargs}))"
            raise GraphError(f"graph field `param_argnums` must be None, an argument index or a "
                             f"tuple of them{within}, got {_got(argnums)}")


def _eqn_fields(eqn, where: str, deep: bool) -> None:
    if not isinstance(eqn, Eqn):
        raise GraphError(f"graph field `{where}` must be an Eqn, got {_got(eqn)}")
    if not isinstance(eqn.op, str):
        raise GraphError(f"graph field `{where}.op` must be a str, got {_got(eqn.op)}")
    for name in ("inputs", "outputs", "regions"):
        if not isinstance(getattr(eqn, name), tuple):
            raise GraphError(f"graph field `{where}.{name}` ({eqn.op}) must be a tuple, got "
                             f"{_got(getattr(eqn, name))}")
    if not isinstance(eqn.params, dict) and not isinstance(eqn.params, Mapping):
        raise GraphError(f"graph field `{where}.params` ({eqn.op}) must be a mapping, got "
                         f"{_got(eqn.params)}")
    if not isinstance(eqn.tags, frozenset | set):
        raise GraphError(f"graph field `{where}.tags` ({eqn.op}) must be a frozenset, got "
                         f"{_got(eqn.tags)}")
    for k, a in enumerate(eqn.inputs):
        _atom(a, f"{where}.inputs[{k}]")
    for k, v in enumerate(eqn.outputs):
        _atom(v, f"{where}.outputs[{k}]", Var)
    for k, r in enumerate(eqn.regions):
        if not isinstance(r, int):
            raise GraphError(f"graph field `{where}.regions[{k}]` ({eqn.op}) must be a region id "
                             f"(int), got {_got(r)}")
    if deep:
        for key, value in eqn.params.items():
            for k, sub in enumerate(value if isinstance(value, tuple) else (value,)):
                if isinstance(sub, Graph):
                    try:
                        check_fields(sub, deep=True)
                    except GraphError as e:
                        raise GraphError(f"graph field `{where}.params[{key!r}]`"
                                         f"{f'[{k}]' if isinstance(value, tuple) else ''}: "
                                         f"{e}") from None


# -- the text form: `str(graph)`


def _names():
    letters = string.ascii_lowercase
    for n in itertools.count(1):
        for chars in itertools.product(letters, repeat=n):
            name = "".join(chars)
            if n == 1 or name[0] != "a":  # jaxpr's scheme: a..z, ba..zz, baa...
                yield name


class Namer:
    def __init__(self, fresh=None):
        self.names: dict[int, str] = {}
        self.fresh = fresh if fresh is not None else _names()

    def nested(self) -> Namer:
        """A namer for a sub-graph: closed, it names only its own variables, so it starts empty
        and draws on the same letters. A sub-graph object shared by two eqns (JAX traces a
        `while_loop`'s cond once) prints with fresh names each time, like a copy of it."""
        return Namer(self.fresh)

    def __call__(self, v: Var) -> str:
        if id(v) not in self.names:
            self.names[id(v)] = next(self.fresh)
        return self.names[id(v)]


def format_literal(lit: Literal) -> str:
    if np.ndim(lit.value) == 0:
        return f"{np.asarray(lit.value).item()}:{short_aval(lit.aval)}"
    return f"const:{short_aval(lit.aval)}"


def _is_jaxpr(value) -> bool:
    return type(value).__name__ in ("ClosedJaxpr", "Jaxpr")


def _graphs_in(value) -> list:
    values = value if isinstance(value, tuple) else (value,)
    return [v for v in values if isinstance(v, Graph)]


def format_param(value) -> str:
    if isinstance(value, Graph):  # one-line form (error messages); str(graph) nests it in full
        count = lambda xs: len(xs) if isinstance(xs, tuple | list) else "?"  # noqa: E731
        return f"{{ lambda {count(value.inputs)} inputs, {count(value.eqns)} eqns }}"
    if isinstance(value, tuple) and value and all(isinstance(v, Graph) for v in value):
        return f"({', '.join(map(format_param, value))})"
    if _is_jaxpr(value):
        return "<jaxpr>"
    if isinstance(value, (tuple, list)) and any(_is_jaxpr(v) for v in value):
        return "(<jaxpr>, ...)"
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # NamedTuple dimension numbers
        fields = [f"{k}={format_param(v)}" for k, v in zip(value._fields, value, strict=True)
                  if v not in ((), None)]
        return f"{type(value).__name__}({', '.join(fields)})"
    if isinstance(value, tuple):
        items = [format_param(v) for v in value]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if isinstance(value, np.generic):
        return str(value.item())
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    return str(value)


# Per-op rewriting of params for printing (what the output aval says, or a compact form): a
# table read here, filled by `jgraph.ops` (op -> fn(params, eqn) -> the params to print).
PARAM_VIEWS: dict[str, Callable] = {}
# Params left out when they have this (default) value.
_DEFAULTS = {"weak_type": False, "unique_indices": False, "indices_are_sorted": False,
             "reverse": False, "unroll": 1}
# Params that are bookkeeping of transforms, not part of what an op computes.
_HIDDEN = frozenset({"joint"})


def format_params(eqn, nested: bool = False) -> str:
    """`[k=v ...]`; with `nested`, sub-graph params are left out (printed below the eqn)."""
    view = PARAM_VIEWS.get(eqn.op)
    params = view(eqn.params, eqn) if view else eqn.params
    shown = [f"{k}={format_param(v)}" for k, v in params.items()
             if v is not None and k not in _HIDDEN
             and not (k in _DEFAULTS and type(v) is type(_DEFAULTS[k]) and v == _DEFAULTS[k])
             and not (nested and _graphs_in(v))]
    return f"[{' '.join(shown)}]" if shown else ""


def eqn_lines(graph: Graph, name: Namer | None = None, nested: bool = False,
              roles: bool = True) -> tuple[str, list[str], str]:
    """(head, one text per eqn, outputs), with the graph's variable names. With `nested`, an
    eqn holding sub-graphs is several lines: its sub-graphs are printed in full below it (without
    roles, which only a top-level graph has)."""
    name = name or Namer()

    def atom(a):
        return name(a) if isinstance(a, Var) else format_literal(a)

    head = " ".join(f"{name(v)}:{short_aval(v.aval)}" + (f"@{role}" if roles else "")
                    for v, role in zip(graph.inputs, graph.input_roles, strict=False))
    texts = []
    for eqn in graph.eqns:
        outs = " ".join(f"{name(v)}:{short_aval(v.aval)}" for v in eqn.outputs) or "_"
        subs = [(k, v) for k, v in eqn.params.items() if k not in _HIDDEN and _graphs_in(v)]
        ins = " ".join(atom(a) for a in eqn.inputs)
        if nested and subs:
            lines = [f"{outs} = {eqn.op}[{format_params(eqn, nested=True)[1:-1]}".rstrip()]
            for key, value in subs:
                for k, sub in enumerate(_graphs_in(value)):
                    label = f"{key}={{" if len(_graphs_in(value)) == 1 else f"{key}[{k}]={{"
                    body = _graph_lines(sub, name.nested(), roles=False)
                    body[0] = body[0].removeprefix("{")
                    lines += ["  " + label + body[0]] + ["  " + " " * len(label) + line
                                                          for line in body[1:]]
            lines.append(f"] {ins}".rstrip())
            texts.append("\n".join(lines))
        else:
            texts.append(f"{outs} = {eqn.op}{format_params(eqn)} {ins}".rstrip())
    outs = " ".join(f"{atom(a)}@{role}" if roles else atom(a)
                    for a, role in zip(graph.outputs, graph.output_roles, strict=False))
    return head, texts, outs


def _notes(eqn) -> str:
    notes = sorted(eqn.tags)
    if eqn.regions:
        notes.append("region " + "/".join(map(str, eqn.regions)))
    return ", ".join(notes)


def format_region(region) -> str:
    args = [region.name or "?"]
    if region.policy is not None:
        args.append(f"policy={format_param(region.policy)}")
    if not region.prevent_cse:
        args.append("prevent_cse=False")
    parent = f" in region {region.parent}" if region.parent is not None else ""
    return f"# region {region.id}: checkpoint({', '.join(args)}){parent}"


def _graph_lines(graph: Graph, name: Namer, roles: bool = True) -> list[str]:
    head, texts, outs = eqn_lines(graph, name, nested=True, roles=roles)
    notes = [_notes(eqn) for eqn in graph.eqns]
    width = max((len(t) for t, n in zip(texts, notes, strict=True) if n and "\n" not in t),
                default=0)
    lines = [f"{{ lambda {head} ."]
    for i, (text, note) in enumerate(zip(texts, notes, strict=True)):
        prefix = "  let " if i == 0 else "      "
        first, *rest = text.split("\n")
        if note and not rest:
            first = f"{first:<{width}}  # {note}"
        elif note:
            first = f"{first}  # {note}"
        lines.append(prefix + first)
        lines += ["      " + line for line in rest]
    lines.append(f"  in ( {outs} ) }}")
    lines += [format_region(r) for r in graph.regions]
    return lines


def format_graph(graph: Graph) -> str:
    """`str(graph)`. Printing is how a pass is debugged, so a graph whose fields do not have the
    IR's types (a hand-built one) prints too: a first line names the first bad field, as
    `check` does (which raises), and every value that cannot print as the IR prints is shown
    as `<bad ...>` where it stands."""
    try:
        check_fields(graph, deep=True)
    except GraphError as e:
        return "\n".join([f"# malformed graph (jg.check raises): {e}"]
                         + _lenient_graph_lines(graph, Namer()))
    return "\n".join(_graph_lines(graph, Namer()))


def _bad(value) -> str:
    return f"<bad {_got(value)}>"


def _lenient(fn, value) -> str:
    try:
        return fn(value)
    except Exception:  # noqa: BLE001 - any field may be anything: show it as it is
        return _bad(value)


def _items(value) -> list | None:
    return list(value) if isinstance(value, tuple | list) else None


def _lenient_graph_lines(graph, name: Namer) -> list[str]:
    """The text form of a graph with malformed fields, each bad value marked where it stands."""
    def atom(a):
        if isinstance(a, Var):
            return f"{name(a)}:{_lenient(short_aval, a.aval)}"
        if isinstance(a, Literal):
            return _lenient(format_literal, a)
        return _bad(a)

    def atoms(value, roles=None):
        items = _items(value)
        if items is None:
            return _bad(value)
        texts = [atom(a) for a in items]
        if roles is not None:
            role_items = _items(roles)
            if role_items is None:
                texts.append(f"(roles {_bad(roles)})")
            else:
                texts = [t + "@" + (r if isinstance(r, str) else _bad(r))
                         for t, r in zip(texts, role_items, strict=False)] + texts[len(role_items):]
        return " ".join(texts)

    lines = [f"{{ lambda {atoms(graph.inputs, graph.input_roles)} ."]
    eqns = _items(graph.eqns)
    if eqns is None:
        lines.append(f"  let {_bad(graph.eqns)}")
    for i, eqn in enumerate(eqns or []):
        prefix = "  let " if i == 0 else "      "
        if not isinstance(eqn, Eqn):
            lines.append(prefix + _bad(eqn))
            continue
        op = eqn.op if isinstance(eqn.op, str) else _bad(eqn.op)
        params = (_lenient(format_params, eqn) if isinstance(eqn.params, Mapping)
                  else f"[{_bad(eqn.params)}]")
        lines.append(f"{prefix}{atoms(eqn.outputs) or '_'} = {op}{params} "
                     f"{atoms(eqn.inputs)}".rstrip())
    lines.append(f"  in ( {atoms(graph.outputs, graph.output_roles)} ) }}")
    return lines
