"""`jg.to_dot(graph)`: the graph as Graphviz DOT text (render it with `dot -Tsvg g.dot > g.svg`).

Eqns are boxes labelled with their op and result avals (literal operands inline), inputs and
outputs are ellipses labelled with their role and place in the call's arguments, and each edge
carries the bytes of the value it moves. Forward eqns are white, backward blue, recompute orange,
updates green. Checkpoint regions are clusters (nested as they nest) and so are the bodies of
loops and conds, drawn beside their eqn with dashed edges into the body's inputs. With a memory
report (`report=jg.memory(graph)`), values XLA fuses away are dotted edges and the eqn at the peak
is outlined in red. `collapse=True` (the default above 400 eqns) draws runs of eqns of one role
and region, cut after each matrix product, convolution or loop, as one node each ("12 eqns:
dot_general, tanh x2, ..."), with one edge per pair of runs carrying their total bytes. The text
uses no Graphviz library: no dependency.
"""

from __future__ import annotations

from collections import Counter

from jgraph.errors import JGraphError
from jgraph.ir import Eqn, Graph, Literal, Var, short_aval, sub_graphs
from jgraph.memory.opkinds import nbytes

FILL = {"forward": "white", "backward": "#cfe2f3", "recompute": "#fce5cd", "update": "#d9ead3"}
INPUT_FILL = {"param": "#fff2cc", "accumulator": "#ead1dc", "opt_state": "#ead1dc"}
HEAVY = frozenset({"dot_general", "conv_general_dilated", "scan", "cond", "while"})
AUTO_COLLAPSE = 400


def to_dot(graph: Graph, *, collapse: bool | None = None, report=None, title: str = "") -> str:
    """Graphviz DOT text of `graph`. `collapse`: draw runs of eqns as single nodes (default: when
    the graph has more than 400 eqns); `report`: `jg.memory(graph)`, to mark fused values and
    the peak; `title`: the drawing's label."""
    if not isinstance(graph, Graph):
        raise JGraphError(f"jg.to_dot takes a jgraph Graph (from jg.trace), got "
                          f"{type(graph).__name__}")
    if report is not None and len(getattr(report, "materialised", ())) != len(graph.eqns):
        raise JGraphError("jg.to_dot(report=...): the report must be jg.memory of this graph")
    if collapse is None:
        collapse = len(graph.eqns) > AUTO_COLLAPSE
    out = _Writer()
    out.line("digraph jgraph {")
    out.line('  graph [rankdir=TB, fontname="Helvetica", fontsize=11, compound=true'
             + (f", label={_quote(title)}, labelloc=t" if title else "") + "];")
    out.line('  node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica",'
             ' fontsize=10];')
    out.line('  edge [fontname="Helvetica", fontsize=8, color="#555555"];')
    if collapse:
        _collapsed(out, graph)
    else:
        _graph(out, graph, "", report, depth=1)
    out.line("}")
    return out.text()


class _Writer:
    def __init__(self):
        self.lines: list[str] = []
        self.clusters = 0

    def line(self, text: str) -> None:
        self.lines.append(text)

    def cluster(self) -> str:
        self.clusters += 1
        return f"cluster_{self.clusters}"

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def size(n: int) -> str:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def _role(eqn: Eqn) -> str:
    if "recompute" in eqn.tags:
        return "recompute"
    return "backward" if "backward" in eqn.tags else "forward"


def _eqn_label(eqn: Eqn, index: int) -> str:
    literals = [str(a.value) for a in eqn.inputs if isinstance(a, Literal)]
    head = f"{eqn.op}" + (f" ({', '.join(literals)[:24]})" if literals else "")
    avals = ", ".join(short_aval(v.aval) for v in eqn.outputs)
    return f"{head}\n{avals}\n#{index}"


def _graph(out: _Writer, graph: Graph, prefix: str, report, depth: int) -> dict:
    """Emit `graph`'s nodes and edges; node ids start with `prefix`. Returns var -> node id."""
    pad = "  " * depth
    node: dict[Var, str] = {}
    paths = graph.input_paths() if prefix == "" else [f"[{k}]" for k in range(len(graph.inputs))]
    for k, (v, role) in enumerate(zip(graph.inputs, graph.input_roles, strict=True)):
        node[v] = f"{prefix}in{k}"
        label = f"{paths[k]} {short_aval(v.aval)}" + (f"\n{role}" if not prefix else "")
        out.line(f"{pad}{node[v]} [shape=ellipse, fillcolor={_quote(INPUT_FILL.get(role, 'white'))}"
                 f", label={_quote(label)}];")
    regions = {r.id: r for r in graph.regions}
    children: dict = {}
    for r in graph.regions:
        children.setdefault(r.parent, []).append(r.id)
    members: dict = {}
    for i, eqn in enumerate(graph.eqns):
        members.setdefault(eqn.regions[-1] if eqn.regions else None, []).append(i)
    peak = report.peak_eqn if report is not None else -1

    def emit_region(region_id, indent):
        for i in members.get(region_id, ()):
            eqn = graph.eqns[i]
            ident = f"{prefix}e{i}"
            for v in eqn.outputs:
                node[v] = ident
            extra = ", color=red, penwidth=2" if i == peak else ""
            out.line(f"{indent}{ident} [fillcolor={_quote(FILL[_role(eqn)])}, "
                     f"label={_quote(_eqn_label(eqn, i))}{extra}];")
        for child in children.get(region_id, ()):
            r = regions[child]
            name = f"checkpoint region {r.id}: {r.name or 'remat'}"
            out.line(f"{indent}subgraph {out.cluster()} {{")
            out.line(f'{indent}  style="dashed,rounded"; color="#999999"; label={_quote(name)};')
            emit_region(child, indent + "  ")
            out.line(f"{indent}}}")

    emit_region(None, pad)
    buffer = {}  # var -> whether XLA materialises it (with a report)
    if report is not None:
        buffer = {v: m for e, m in zip(graph.eqns, report.materialised, strict=True)
                  for v in e.outputs}

    def edge(a, dst):
        style = ", style=dotted" if not buffer.get(a, True) else ""
        out.line(f"{pad}{node[a]} -> {dst} [label={_quote(size(nbytes(a.aval)))}{style}];")

    for i, eqn in enumerate(graph.eqns):
        for a in dict.fromkeys(a for a in eqn.inputs if isinstance(a, Var)):
            edge(a, f"{prefix}e{i}")
        for k, body in enumerate(sub_graphs(eqn)):
            _body(out, eqn, k, body, f"{prefix}e{i}", report, depth)
    for k, (a, role) in enumerate(zip(graph.outputs, graph.output_roles, strict=True)):
        ident = f"{prefix}out{k}"
        out.line(f"{pad}{ident} [shape=ellipse, fillcolor=\"#f3f3f3\", "
                 f"label={_quote(f'{role} {short_aval(a.aval)}')}];")
        if isinstance(a, Var):
            edge(a, ident)
    if report is not None:
        fused = len(graph.eqns) - sum(report.materialised)
        note = (f"peak {size(report.peak_bytes)} at eqn {report.peak_eqn} (red);\n"
                f"dotted: {fused} of {len(graph.eqns)} eqns fused by XLA or bitcasts")
        out.line(f'{pad}legend [shape=note, fillcolor=white, label={_quote(note)}];')
    return node


def _body(out: _Writer, eqn: Eqn, k: int, body: Graph, owner: str, report, depth: int) -> None:
    pad = "  " * depth
    what = {"scan": f"scan body (length {eqn.params.get('length')})", "while": "while",
            "cond": f"cond branch {k}"}.get(eqn.op, eqn.op)
    if eqn.op == "while":
        what = "while condition" if body is eqn.params.get("cond_graph") else "while body"
    out.line(f"{pad}subgraph {out.cluster()} {{")
    out.line(f'{pad}  style="rounded,filled"; fillcolor="#f7f7f7"; color="#777777"; '
             f"label={_quote(what)};")
    prefix = f"{owner}b{k}_"
    _graph(out, body, prefix, None, depth + 1)
    out.line(f"{pad}}}")
    if body.inputs:
        out.line(f"{pad}{owner} -> {prefix}in0 [style=dashed, arrowhead=none, "
                 f"label={_quote(what.split(' ')[0])}];")


# -- collapsed drawing ---------------------------------------------------------------------------
def runs(graph: Graph) -> list[list[int]]:
    """Consecutive eqns of one role and region path, cut after each heavy op (dot, conv, loop)."""
    groups: list[list[int]] = []
    key = None
    for i, eqn in enumerate(graph.eqns):
        k = (_role(eqn), eqn.regions)
        if k != key or (groups and graph.eqns[groups[-1][-1]].op in HEAVY):
            groups.append([])
            key = k
        groups[-1].append(i)
    return groups


def _collapsed(out: _Writer, graph: Graph) -> None:
    owner: dict[Var, str] = {}
    paths = graph.input_paths()
    for k, (v, role) in enumerate(zip(graph.inputs, graph.input_roles, strict=True)):
        owner[v] = f"in{k}"
        out.line(f"  in{k} [shape=ellipse, fillcolor={_quote(INPUT_FILL.get(role, 'white'))}, "
                 f"label={_quote(f'{paths[k]} {short_aval(v.aval)}' + chr(10) + role)}];")
    edges: Counter = Counter()
    for g, members in enumerate(runs(graph)):
        eqns = [graph.eqns[i] for i in members]
        ops = Counter(e.op for e in eqns)
        summary = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in ops.most_common(4))
        region = f" region {eqns[0].regions[-1]}" if eqns[0].regions else ""
        label = (f"{len(eqns)} eqns{region}: {summary}" + (", ..." if len(ops) > 4 else "")
                 + f"\n#{members[0]}..{members[-1]}")
        out.line(f"  g{g} [fillcolor={_quote(FILL[_role(eqns[0])])}, label={_quote(label)}];")
        for e in eqns:
            for a in dict.fromkeys(a for a in e.inputs if isinstance(a, Var)):
                if owner.get(a) not in (None, f"g{g}"):
                    edges[(owner[a], f"g{g}")] += nbytes(a.aval)
            for v in e.outputs:
                owner[v] = f"g{g}"
    for k, (a, role) in enumerate(zip(graph.outputs, graph.output_roles, strict=True)):
        out.line(f"  out{k} [shape=ellipse, fillcolor=\"#f3f3f3\", "
                 f"label={_quote(f'{role} {short_aval(a.aval)}')}];")
        if isinstance(a, Var) and a in owner:
            edges[(owner[a], f"out{k}")] += nbytes(a.aval)
    for (src, dst), n in edges.items():
        out.line(f"  {src} -> {dst} [label={_quote(size(n))}];")
