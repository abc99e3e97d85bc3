"""jg.to_dot: Graphviz DOT text of a graph (eqns, inputs, outputs, bytes on edges, regions and
loop bodies as clusters, roles coloured, a collapsed view). Checked structurally here, and by the
`dot` program itself when it is installed (`apt install graphviz`)."""

import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jgraph as jg
from jgraph.dot import MAX_GROUPS, runs, size

F32 = jnp.float32


def loss(ws, x):
    h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return jnp.mean(jax.checkpoint(lambda h: jnp.sin(jnp.sin(h)) * 2.0)(h) ** 2)


WS, X = jnp.full((3, 4, 4), 0.1, F32), jnp.ones((2, 4), F32)


@pytest.fixture(scope="module")
def remat_graph():
    return jg.remat(jg.backward(jg.trace(loss, WS, X, param_argnums=0)))


NODE = re.compile(r"^\s*(\w+) \[", re.M)
EDGE = re.compile(r"^\s*(\w+) -> (\w+) \[label=\"([^\"]*)\"", re.M)


def check_structure(text: str) -> tuple[set, list]:
    """Balanced braces and quotes; every edge joins declared nodes; returns (nodes, edges)."""
    assert text.startswith("digraph jgraph {") and text.rstrip().endswith("}")
    assert text.count("{") == text.count("}")
    assert all(line.count('"') % 2 == 0 for line in text.splitlines())
    nodes = set(NODE.findall(text)) - {"graph", "node", "edge"}
    edges = EDGE.findall(text)
    for src, dst, _ in edges:
        assert src in nodes and dst in nodes, (src, dst)
    return nodes, edges


def test_eqns_inputs_outputs_and_bytes_on_edges(remat_graph):
    text = jg.to_dot(remat_graph)
    nodes, edges = check_structure(text)
    top = [n for n in nodes if re.fullmatch(r"e\d+", n)]
    assert len(top) == len(remat_graph.eqns)
    assert {f"in{k}" for k in range(2)} <= nodes and "out0" in nodes
    assert 'label="[0] f32[3,4,4]\\nparam"' in text and 'label="loss f32[]"' in text
    assert ("in0", "e0", "192 B") in edges  # the stacked weights into the forward scan
    # a recompute eqn (orange), backward eqns (blue)
    assert 'fillcolor="#fce5cd"' in text and 'fillcolor="#cfe2f3"' in text


def test_regions_and_loop_bodies_are_clusters(remat_graph):
    text = jg.to_dot(remat_graph)
    assert "checkpoint region 0: <lambda>" in text
    assert text.count("scan body (length 3)") == 2  # the forward scan and the backward one
    # body nodes are prefixed by their eqn and joined to it by a dashed edge
    assert re.search(r"e0 -> e0b0_in0 \[style=dashed", text)


def test_a_memory_report_marks_fused_values_and_the_peak(remat_graph):
    rep = jg.memory(remat_graph)
    text = jg.to_dot(remat_graph, report=rep)
    check_structure(text)
    assert "style=dotted" in text  # some values are fused by XLA
    assert f"peak {size(rep.peak_bytes)} at eqn {rep.peak_eqn}" in text
    assert re.search(rf"^\s*e{rep.peak_eqn} \[.*color=red", text, re.M)
    with pytest.raises(jg.JGraphError, match="jg.memory of this graph"):
        jg.to_dot(remat_graph, report=jg.memory(jg.trace(loss, WS, X)))


def test_collapsed_view_of_a_big_graph():
    def chain(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x)

    ws = [jnp.eye(8, dtype=F32)] * 50
    gb = jg.backward(jg.trace(chain, ws, jnp.ones((2, 8), F32), param_argnums=0))
    assert len(gb.eqns) > 400
    text = jg.to_dot(gb)  # collapsed by default above 400 eqns
    nodes, edges = check_structure(text)
    groups = [n for n in nodes if re.fullmatch(r"g\d+", n)]
    assert len(groups) == len(runs(gb, MAX_GROUPS)) < len(gb.eqns) // 2
    assert "eqns: dot_general" in text
    full_nodes, _ = check_structure(jg.to_dot(gb, collapse=False))
    assert len(full_nodes) > len(nodes) + len(gb.eqns) // 2
    assert sum(map(len, runs(gb))) == len(gb.eqns)  # every eqn is in one run


def test_bad_input_is_a_clear_error():
    with pytest.raises(jg.JGraphError, match="takes a jgraph Graph"):
        jg.to_dot(loss)


@pytest.mark.skipif(shutil.which("dot") is None, reason="the dot program is not installed")
def test_graphviz_parses_it(remat_graph, tmp_path):
    for text in (jg.to_dot(remat_graph, report=jg.memory(remat_graph), title='a "title"'),
                 jg.to_dot(remat_graph, collapse=True)):
        path = tmp_path / "g.dot"
        path.write_text(text)
        run = subprocess.run(["dot", "-Tsvg", str(path)], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.lstrip().startswith("<?xml") and "<svg" in run.stdout
