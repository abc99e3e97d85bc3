"""`jg.to_dot(graph)`: the graph as Graphviz DOT text (render it with `dot -Tsvg g.dot > g.svg`).

Eqns are boxes labelled with their op and result avals (literal operands inline; the user's
source line as the tooltip of an SVG), inputs and outputs are ellipses labelled with their role
and place in the call's arguments, and each edge carries the bytes of the value it moves. Forward
eqns are white, backward blue, recompute orange, updates green (an untagged eqn that reads a
backward value: the optimizer step, the accumulator). Checkpoint regions are clusters (nested as
they nest) and so are the bodies of loops and conds, drawn beside their eqn with dashed edges into
the body's inputs. With a memory report (`report=jg.memory(graph)`), values XLA fuses away are
dotted edges and the eqn at the peak is outlined in red.

`collapse=True` (the default above 400 eqns, loop bodies counted) draws runs of eqns of one role
and region, cut after each matrix product, convolution or loop, as one node each ("12 eqns:
dot_general, tanh x2, ..."), with one edge per pair of runs carrying their total bytes. So that
Graphviz lays out a 10k-eqn graph in seconds and a reader can follow it, neighbouring runs of one
phase (forward; or backward, recompute and updates) are joined until at most `MAX_GROUPS` remain,
and the inputs (and the outputs) are drawn as one node per role when there are more than
`MAX_ENDS`. The text uses no Graphviz library: no dependency.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from jgraph.check import validate
from jgraph.errors import JGraphError
from jgraph.ir import Eqn, Graph, Literal, Var, short_aval, sub_graphs
from jgraph.opkinds import nbytes

FILL = {"forward": "white", "backward": "#cfe2f3", "recompute": "#fce5cd", "update": "#d9ead3"}
INPUT_FILL = {"param": "#fff2cc", "accumulator": "#ead1dc", "opt_state": "#ead1dc"}
HEAVY = frozenset({"dot_general", "conv_general_dilated", "scan", "cond", "while"})
AUTO_COLLAPSE = 400  # eqns, loop bodies included
MAX_GROUPS = 120  # nodes for eqns in the collapsed view
MAX_ENDS = 24  # inputs (outputs) drawn one by one in the collapsed view; more: one per role


def to_dot(graph: Graph, *, collapse: bool | None = None, report=None, title: str = "") -> str:
    """Graphviz DOT text of `graph`.

    Eqns are labelled with op and avals, edges with the bytes they move (dotted where XLA fuses the
    value); checkpoint regions and loop and cond bodies are clusters; backward eqns blue,
    recompute orange, optimizer updates green. Render with `dot -Tsvg g.dot > g.svg`.

    Args:
        graph: any graph.
        collapse: draw runs of eqns as single nodes (default None: when the graph has more than
            400 eqns).
        report: `jg.memory(graph)`, to mark fused values and the peak.
        title: the drawing's label.

    Returns:
        The DOT source, a string."""
    validate(graph, "jg.to_dot")
    if report is not None and len(getattr(report, "materialised", ())) != len(graph.eqns):
        raise JGraphError("jg.to_dot(report=...): the report must be jg.memory of this graph")
    if collapse is not None and not isinstance(collapse, (bool, np.bool_)):
        raise JGraphError(f"jg.to_dot(collapse=...): True, False or None (automatic), got "
                          f"{collapse!r:.40}")
    if collapse is None:
        collapse = _count_eqns(graph) > AUTO_COLLAPSE
    out = _Writer()
    out.line("digraph jgraph {")
    title = "" if title is None else str(title)
    # Collapsed views are for big graphs: straight edges and a bounded network simplex keep
    # Graphviz's layout to seconds (minutes otherwise, for a hundred nodes and long residuals).
    fast = ", splines=line, nslimit=2, nslimit1=2" if collapse else ""
    out.line('  graph [rankdir=TB, fontname="Helvetica", fontsize=11, compound=true' + fast
             + (f", label={_quote(title)}, labelloc=t" if title else "") + "];")
    out.line('  node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica",'
             ' fontsize=10];')
    out.line('  edge [fontname="Helvetica", fontsize=8, color="#555555"];')
    if collapse:
        _collapsed(out, graph, report)
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


def _count_eqns(graph: Graph) -> int:
    return sum(1 + sum(_count_eqns(b) for b in sub_graphs(e)) for e in graph.eqns)


def roles(graph: Graph) -> list[str]:
    """Per eqn: recompute, backward (as tagged), update (untagged, but reading a backward value:
    an optimizer step, an accumulator) or forward."""
    later: set[Var] = set()
    out = []
    for eqn in graph.eqns:
        if "recompute" in eqn.tags:
            role = "recompute"
        elif "backward" in eqn.tags:
            role = "backward"
        elif any(isinstance(a, Var) and a in later for a in eqn.inputs):
            role = "update"
        else:
            role = "forward"
        if role in ("backward", "update"):
            later.update(eqn.outputs)
        out.append(role)
    return out


def _eqn_label(eqn: Eqn, index: int) -> str:
    literals = [str(a.value) for a in eqn.inputs if isinstance(a, Literal)]
    head = f"{eqn.op}" + (f" ({', '.join(literals)[:24]})" if literals else "")
    if eqn.op == "name":  # checkpoint_name: the name policies select by
        head += f" {str(eqn.params.get('name'))[:24]!r}"
    avals = ", ".join(short_aval(v.aval) for v in eqn.outputs)
    return f"{head}\n{avals}\n#{index}"


def _tooltip(eqn: Eqn) -> str:
    return f", tooltip={_quote(eqn.source)}" if eqn.source else ""


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
    role = roles(graph)

    def emit_region(region_id, indent):
        for i in members.get(region_id, ()):
            eqn = graph.eqns[i]
            ident = f"{prefix}e{i}"
            for v in eqn.outputs:
                node[v] = ident
            extra = ", color=red, penwidth=2" if i == peak else ""
            out.line(f"{indent}{ident} [fillcolor={_quote(FILL[role[i]])}, "
                     f"label={_quote(_eqn_label(eqn, i))}{_tooltip(eqn)}{extra}];")
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
        _legend(out, pad, report, f"dotted: {fused} of {len(graph.eqns)} eqns fused by XLA or "
                                  "bitcasts")
    return node


def _legend(out: _Writer, pad: str, report, more: str) -> None:
    where = (f" at eqn {report.peak_eqn} (red)" if report.peak_eqn >= 0 else
             " (no eqn: arguments and results are not temps)")
    note = f"estimated peak {size(report.peak_bytes)}{where};\n{more}"
    out.line(f'{pad}legend [shape=note, fillcolor=white, label={_quote(note)}];')


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
def runs(graph: Graph, limit: int | None = None) -> list[list[int]]:
    """Consecutive eqns of one role and region path, cut after each heavy op (dot, conv, loop).
    With `limit`, neighbouring runs of one phase (`phases`) are joined so that at most about
    `limit` remain: a tenth of them for the updates, the rest shared by forward and backward in
    proportion to their runs."""
    role = roles(graph)
    groups: list[list[int]] = []
    key = None
    for i, eqn in enumerate(graph.eqns):
        k = (role[i], eqn.regions)
        if k != key or (groups and graph.eqns[groups[-1][-1]].op in HEAVY):
            groups.append([])
            key = k
        groups[-1].append(i)
    if limit is None or len(groups) <= limit:
        return groups
    bounds = phases(role)
    per_phase = [[g for g in groups if lo <= g[0] < hi] for lo, hi in bounds]
    budget = [0, 0, max(1, limit // 10) if per_phase[2] else 0]
    main = len(per_phase[0]) + len(per_phase[1])
    budget[0] = max(1, (limit - budget[2]) * len(per_phase[0]) // max(main, 1))
    budget[1] = max(1, limit - budget[2] - budget[0])
    joined: list[list[int]] = []
    for part, n in zip(per_phase, budget, strict=True):
        per = -(-len(part) // n) if part else 1  # runs per joined group
        for k in range(0, len(part), per):
            joined.append([i for g in part[k:k + per] for i in g])
    return joined


def phases(role: list[str]) -> list[tuple[int, int]]:
    """Eqn index ranges of the forward phase (up to the first backward or recompute eqn), the
    backward phase (to the last of them) and the updates after it."""
    later = [i for i, r in enumerate(role) if r in ("backward", "recompute")]
    start = later[0] if later else len(role)
    end = later[-1] + 1 if later else len(role)
    return [(0, start), (start, end), (end, len(role))]


def _group_label(graph: Graph, members: list[int], role: list[str]) -> tuple[str, str]:
    """(label, majority role) of a collapsed group."""
    eqns = [graph.eqns[i] for i in members]
    ops = Counter(e.op for e in eqns)
    summary = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in ops.most_common(4))
    kinds = Counter(role[i] for i in members)
    main = kinds.most_common(1)[0][0]
    mixed = f" ({', '.join(f'{k} {n}' for k, n in kinds.most_common())})" if len(kinds) > 1 else ""
    regions = sorted({e.regions[-1] for e in eqns if e.regions})
    where = (f" region {regions[0]}" if len(regions) == 1 else
             f" regions {regions[0]}..{regions[-1]}" if regions else "")
    label = (f"{len(eqns)} eqns{mixed}{where}: {summary}" + (", ..." if len(ops) > 4 else "")
             + f"\n#{members[0]}..{members[-1]}")
    return label, main


def _ends(values, roles_, paths, kind: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Node ids per value, and (id, label) per node: one per value, or one per role when there
    are more than `MAX_ENDS`."""
    if len(values) <= MAX_ENDS:
        ids = [f"{kind}{k}" for k in range(len(values))]
        labels = [f"{paths[k]} {short_aval(v.aval)}\n{r}" if paths else f"{r} {short_aval(v.aval)}"
                  for k, (v, r) in enumerate(zip(values, roles_, strict=True))]
        return ids, list(zip(ids, labels, strict=True))
    by_role: dict[str, list] = {}
    for v, r in zip(values, roles_, strict=True):
        by_role.setdefault(r, []).append(v)
    ident = {r: f"{kind}_{k}" for k, r in enumerate(by_role)}
    nodes = []
    for r, vs in by_role.items():
        total = sum(nbytes(v.aval) for v in vs)
        what = "inputs" if kind == "in" else "outputs"
        nodes.append((ident[r], f"{len(vs)} {r} {what}\n{size(total)}"))
    return [ident[r] for r in roles_], nodes


def _collapsed(out: _Writer, graph: Graph, report) -> None:
    """Groups of eqns (`runs`) as nodes. The forward phase runs down, the backward phase (and the
    updates) up beside it, so a residual, drawn as a straight edge that does not constrain the
    layout, joins a forward group to the backward group that reads it at about its height (the
    U of a training step). An input (output) node standing for more than `MAX_ENDS` values
    draws no edges: each group's label says how many of them it reads (writes) instead."""
    in_ids, in_nodes = _ends(graph.inputs, graph.input_roles, graph.input_paths(), "in")
    out_ids, out_nodes = _ends(graph.outputs, graph.output_roles, None, "out")
    hubs = {i for i in in_ids + out_ids if "_" in i}  # one node per role
    fill = dict(zip(in_ids, graph.input_roles, strict=True))
    for ident, label in in_nodes:
        out.line(f"  {ident} [shape=ellipse, fillcolor="
                 f"{_quote(INPUT_FILL.get(fill[ident], 'white'))}, label={_quote(label)}];")
    for ident, label in out_nodes:
        out.line(f"  {ident} [shape=ellipse, fillcolor=\"#f3f3f3\", label={_quote(label)}];")
    owner: dict[Var, str] = dict(zip(graph.inputs, in_ids, strict=True))
    origin = dict(zip(in_ids, graph.input_roles, strict=True))
    written: dict[Var, list] = {}  # a value of a many-value output node -> its roles there
    for a, ident, r in zip(graph.outputs, out_ids, graph.output_roles, strict=True):
        if ident in hubs and isinstance(a, Var):
            written.setdefault(a, []).append(r)
    edges: Counter = Counter()
    role = roles(graph)
    later = set()  # groups after the forward phase
    start = phases(role)[0][1]
    peak = report.peak_eqn if report is not None else -1
    for g, members in enumerate(runs(graph, MAX_GROUPS)):
        if members[0] >= start:
            later.add(f"g{g}")
        ends: Counter = Counter()  # values of many-value input and output nodes, by role
        for e in (graph.eqns[i] for i in members):
            for a in dict.fromkeys(a for a in e.inputs if isinstance(a, Var)):
                src = owner.get(a)
                if src in hubs:
                    ends[f"reads {origin[src]}"] += 1
                elif src not in (None, f"g{g}"):
                    edges[(src, f"g{g}")] += nbytes(a.aval)
            for v in e.outputs:
                owner[v] = f"g{g}"
                for r in written.get(v, ()):
                    ends[f"writes {r}"] += 1
        label, main = _group_label(graph, members, role)
        extra = ", color=red, penwidth=2" if peak in members else ""
        more = "".join(f"\n{what} x{n}" for what, n in ends.items())
        out.line(f"  g{g} [fillcolor={_quote(FILL[main])}, label={_quote(label + more)}{extra}];")
    for a, ident in zip(graph.outputs, out_ids, strict=True):
        if isinstance(a, Var) and a in owner and ident not in hubs:
            edges[(owner[a], ident)] += nbytes(a.aval)
    for (src, dst), n in edges.items():
        label = f"label={_quote(size(n))}"
        if src in later and dst in later:  # the backward phase runs up
            out.line(f"  {dst} -> {src} [{label}, dir=back];")
        elif src in later or dst in later:  # residuals, and values into outputs
            out.line(f"  {src} -> {dst} [{label}, constraint=false];")
        else:
            out.line(f"  {src} -> {dst} [{label}];")
    if report is not None:
        _legend(out, "  ", report, "collapsed: one node per run of eqns")
