"""Jaxpr-like text for graphs. Printing is API: tests compare it to golden strings.

    { lambda a:f32[4,3]@param b:f32[2,4]@data .
      let c:f32[2,3] = dot_general[contract=[1]x[0]] b a
          d:f32[2,3] = tanh c                            # region 0
          e:f32[] = reduce_sum[axes=(0, 1)] d
      in ( e@loss ) }
    # region 0: checkpoint(layer)

Variables are named a, b, ..., z, ba, bb, ... in order of appearance; each input and output carries
`@role`. Params print as `key=value`, leaving out what the output aval already says (a broadcast's
or reshape's shape), defaults (None, `weak_type=False`, unit dilations, zero window padding) and
empty dimension-number fields; a `scatter` prints its combiner (`update_jaxpr`) on one line when it
has one; `dot_general` prints its contracting and batch dimensions as
`lhs x rhs`, a convolution its layouts as `N01C,01IO->N01C`. Tags and regions follow an eqn as a
comment; the regions of the graph are listed after it.
"""

from __future__ import annotations

import enum
import itertools
import string

import numpy as np

from jgraph.ir import Graph, Literal, Var, short_aval


def _names():
    letters = string.ascii_lowercase
    for n in itertools.count(1):
        for chars in itertools.product(letters, repeat=n):
            name = "".join(chars)
            if n == 1 or name[0] != "a":  # jaxpr's scheme: a..z, ba..zz, baa...
                yield name


class _Namer:
    def __init__(self, fresh=None):
        self.names: dict[int, str] = {}
        self.fresh = fresh if fresh is not None else _names()

    def nested(self) -> _Namer:
        """A namer for a sub-graph: closed, it names only its own variables, so it starts empty
        and draws on the same letters. A sub-graph object shared by two eqns (JAX traces a
        `while_loop`'s cond once) prints with fresh names each time, like a copy of it."""
        return _Namer(self.fresh)

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


def _dims(lhs, rhs) -> str:
    return f"[{','.join(map(str, lhs))}]x[{','.join(map(str, rhs))}]"


def _dot_general_params(params, eqn):
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    out = {"contract": _dims(lc, rc)}
    if lb or rb:
        out["batch"] = _dims(lb, rb)
    pet = params.get("preferred_element_type")
    rest = {k: v for k, v in params.items() if k not in ("dimension_numbers",
                                                         "preferred_element_type")}
    if pet is not None and eqn.outputs and pet != eqn.outputs[0].aval.dtype:
        out["preferred_element_type"] = pet
    return out | rest


def _layout(spec, first: str, second: str) -> str:
    chars = [""] * len(spec)
    chars[spec[0]], chars[spec[1]] = first, second
    for i, dim in enumerate(spec[2:]):
        chars[dim] = str(i)
    return "".join(chars)


def _all(values, unit) -> bool:
    return values is None or all(v == unit for v in values)


def _conv_params(params, eqn):
    out = dict(params)
    dn = out.pop("dimension_numbers")
    if dn is not None:
        lhs, rhs, res = dn
        out = {"dims": f"{_layout(lhs, 'N', 'C')},{_layout(rhs, 'O', 'I')}->"
                       f"{_layout(res, 'N', 'C')}"} | out
    for key in ("lhs_dilation", "rhs_dilation"):
        if _all(out.get(key), 1):
            out.pop(key, None)
    for key in ("feature_group_count", "batch_group_count"):
        if out.get(key) == 1:
            out.pop(key)
    return out


def _gather_params(params, eqn):
    out = dict(params)
    dn = out.pop("dimension_numbers")
    short = {"offset_dims": "offset", "collapsed_slice_dims": "collapsed",
             "start_index_map": "start_map", "operand_batching_dims": "operand_batch",
             "start_indices_batching_dims": "indices_batch",
             "update_window_dims": "window", "inserted_window_dims": "inserted",
             "scatter_dims_to_operand_dims": "to_operand",
             "scatter_indices_batching_dims": "indices_batch"}
    fields = {short.get(k, k): v for k, v in zip(dn._fields, dn, strict=True) if v != ()}
    combiner = out.pop("update_jaxpr", None)
    if combiner is not None and eqn.op == "scatter":  # what it computes (the others: their name)
        out["update_jaxpr"] = " ".join(str(combiner).split())
    if out.get("update_consts") == ():
        out.pop("update_consts")
    return fields | out


def _reduce_window_params(params, eqn):
    out = dict(params)
    if _all((p for pair in out.get("padding", ()) for p in pair), 0):
        out.pop("padding", None)
    for key in ("base_dilation", "window_dilation"):
        if _all(out.get(key), 1):
            out.pop(key, None)
    return out


def _without(*keys):
    return lambda params, eqn: {k: v for k, v in params.items() if k not in keys}


def _broadcast_params(params, eqn):
    return {"dims": params["broadcast_dimensions"]} | _without(
        "shape", "broadcast_dimensions")(params, eqn)


# Per-op rewriting of params for printing (what the output aval says, or a compact form).
_PARAM_VIEWS = {
    "dot_general": _dot_general_params,
    "conv_general_dilated": _conv_params,
    "gather": _gather_params,
    "broadcast_in_dim": _broadcast_params,
    "reshape": _without("new_sizes"),
}
for _op in ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter-min", "scatter-max"):
    _PARAM_VIEWS[_op] = _gather_params
for _op in ("reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window"):
    _PARAM_VIEWS[_op] = _reduce_window_params
# Params left out when they have this (default) value.
_DEFAULTS = {"weak_type": False, "unique_indices": False, "indices_are_sorted": False,
             "reverse": False, "unroll": 1}
# Params that are bookkeeping of transforms, not part of what an op computes.
_HIDDEN = frozenset({"joint"})


def format_params(eqn, nested: bool = False) -> str:
    """`[k=v ...]`; with `nested`, sub-graph params are left out (printed below the eqn)."""
    view = _PARAM_VIEWS.get(eqn.op)
    params = view(eqn.params, eqn) if view else eqn.params
    shown = [f"{k}={format_param(v)}" for k, v in params.items()
             if v is not None and k not in _HIDDEN
             and not (k in _DEFAULTS and type(v) is type(_DEFAULTS[k]) and v == _DEFAULTS[k])
             and not (nested and _graphs_in(v))]
    return f"[{' '.join(shown)}]" if shown else ""


def eqn_lines(graph: Graph, name: _Namer | None = None, nested: bool = False,
              roles: bool = True) -> tuple[str, list[str], str]:
    """(head, one text per eqn, outputs), with the graph's variable names. With `nested`, an
    eqn holding sub-graphs is several lines: its sub-graphs are printed in full below it (without
    roles, which only a top-level graph has)."""
    name = name or _Namer()

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


def _graph_lines(graph: Graph, name: _Namer, roles: bool = True) -> list[str]:
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
    """`str(graph)`; a graph whose fields do not have the IR's types (a hand-built one) raises
    `GraphError` naming the field instead (`repr(graph)` still shows it as it is)."""
    from jgraph.check import check_fields

    check_fields(graph, deep=True)
    return "\n".join(_graph_lines(graph, _Namer()))


def var_name(graph: Graph, v: Var) -> str:
    """The name `str(graph)` gives `v` (for error messages)."""
    name = _Namer()
    eqn_lines(graph, name)
    return name(v)


def format_eqn(eqn, graph: Graph | None = None) -> str:
    """One eqn as text, named as in `str(graph)` when the graph is given (for error messages)."""
    if graph is not None:
        index = next((i for i, e in enumerate(graph.eqns) if e is eqn), -1)
        if index >= 0:
            return eqn_lines(graph)[1][index]
    name = _Namer()
    outs = " ".join(f"{name(v)}:{short_aval(v.aval)}" for v in eqn.outputs) or "_"
    ins = " ".join(name(a) if isinstance(a, Var) else format_literal(a) for a in eqn.inputs)
    return f"{outs} = {eqn.op}{format_params(eqn)} {ins}".rstrip()
