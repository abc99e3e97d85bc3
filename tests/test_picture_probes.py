"""Probes of the pictures: `jg.to_dot` on graphs of every kind (loops, conds, custom rules,
checkpoint regions, remat, accumulate and optimizer-step graphs, no eqns, names and argument
paths with quotes and braces), parsed by Graphviz's `dot` itself; the collapsed view of a big
graph, bounded so that `dot` lays it out in seconds; and `MemoryReport.plot` / `jg.to_dot` given
bad arguments.
"""

import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jgraph as jg
from jgraph.dot import MAX_ENDS, MAX_GROUPS, roles

F32 = jnp.float32
W, X, WS = jnp.full((4, 4), 0.1, F32), jnp.ones((2, 4), F32), jnp.full((3, 4, 4), 0.1, F32)
NAME = 'na"me{with}<br> \\ "quotes"\n and a newline'


def joint(fn, *args):
    return jg.backward(jg.trace(fn, *args, param_argnums=0))


@jax.custom_vjp
def sin_vjp(x):
    return jnp.sin(x)


sin_vjp.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda cos, g: (g * cos,))


def nested_checkpoints(w, x):
    f = jax.checkpoint(lambda x: jnp.tanh(jax.checkpoint(lambda y: jnp.sin(y @ w))(x) @ w))
    return jnp.sum(f(x) ** 2)


def named(w, x):
    return jnp.sum(jax.ad_checkpoint.checkpoint_name(x @ w, NAME) ** 2)


def graphs() -> dict:
    adam = jg.optimizer_step(jg.accumulate(joint(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2),
                                                 W, X), period=4), optax.adamw(1e-3))
    return {
        "scan": joint(lambda ws, x: jnp.mean(lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x,
                                                      ws)[0] ** 2), WS, X),
        "cond": joint(lambda w, x: lax.cond(jnp.sum(x) > 0, lambda: jnp.sum(jnp.sin(x @ w)),
                                            lambda: jnp.sum((x @ w) ** 2)), W, X),
        "while in a forward graph": jg.trace(lambda w, x: jnp.sum(lax.while_loop(
            lambda c: jnp.sum(c) < 10.0, lambda c: c * 2 + w.sum(), x)), W, X),
        "custom_jvp": joint(lambda w, x: jnp.sum(jax.nn.relu(x @ w) + jax.nn.softplus(x)), W, X),
        "custom_vjp": joint(lambda w, x: jnp.sum(sin_vjp(x @ w)), W, X),
        "remat of nested checkpoints": jg.remat(joint(nested_checkpoints, W, X)),
        "remat by a name policy, name with quotes": jg.remat(
            joint(named, W, X), jg.policies.save_only_these_names(NAME)),
        "optimizer step": adam,
        "reset": jg.reset(adam),
        "no eqns": jg.trace(lambda x: x, X),
        "argument paths with quotes and braces": joint(
            lambda p, x: jnp.sum(x @ p['w "q"{}'] + p["b<>|"]), {'w "q"{}': W, "b<>|": W[0]}, X),
        "random keys": joint(lambda w, k: jnp.sum(w * jax.random.normal(k, (4, 4))), W,
                             jax.random.key(0)),
        "drop-in graph with a static argument": jg.value_and_grad(
            lambda w, s, t: jnp.sum(w) * t).graph(W, 'a"b{', 2.0),
    }


GRAPHS = graphs()
NODE = re.compile(r"^\s*(\w+) \[", re.M)
EDGE = re.compile(r"^\s*(\w+) -> (\w+) \[", re.M)


def check_structure(text: str) -> set:
    """Balanced braces outside quotes, escaped quotes, edges between declared nodes."""
    unquoted = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    assert unquoted.count("{") == unquoted.count("}") and '"' not in unquoted.replace('""', "")
    nodes = set(NODE.findall(text)) - {"graph", "node", "edge"}
    for src, dst in EDGE.findall(text):
        assert src in nodes and dst in nodes, (src, dst)
    return nodes


def graphviz(text: str, timeout=120) -> str:
    run = subprocess.run(["dot", "-Tsvg"], input=text, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0 and not run.stderr, run.stderr
    return run.stdout


needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz is not installed")


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_every_drawing_is_valid_dot(name):
    graph = GRAPHS[name]
    report = jg.memory(graph)
    texts = [jg.to_dot(graph), jg.to_dot(graph, collapse=True),
             jg.to_dot(graph, report=report, title='a "title" {x}'),
             jg.to_dot(graph, collapse=True, report=report)]
    for text in texts:
        check_structure(text)
        if shutil.which("dot"):
            assert "<svg" in graphviz(text)


def test_names_and_sources_are_shown_escaped():
    text = jg.to_dot(GRAPHS["remat by a name policy, name with quotes"])
    assert 'label="name \'na\\"me{with}<br> ' in text  # the checkpoint name, its quote escaped
    assert re.search(r'tooltip="[^"]*test_picture_probes.py:\d+', text)


def test_updates_are_coloured_as_updates():
    graph = GRAPHS["optimizer step"]
    kinds = roles(graph)
    assert {"forward", "backward", "update"} <= set(kinds)
    first_update = kinds.index("update")
    assert "backward" not in kinds[first_update:]  # the optimizer step comes after
    assert jg.to_dot(graph).count('fillcolor="#d9ead3"') == kinds.count("update")


def test_no_eqns_legend_says_so():
    text = jg.to_dot(GRAPHS["no eqns"], report=jg.memory(GRAPHS["no eqns"]))
    assert "at eqn -1" not in text and "no eqn" in text


def chain(ws, x):
    for w in ws:
        x = jnp.sin(jnp.tanh(x @ w) * 1.01 + 0.1) - x * 0.5
    return jnp.mean(x ** 2)


def big_graph(layers: int):
    ws = [jnp.full((8, 8), 0.01, F32)] * layers
    gb = joint(chain, ws, jnp.ones((4, 8), F32))
    return jg.optimizer_step(jg.remat(gb, jg.policies.dots_saveable), optax.adam(1e-3))


def check_collapsed(graph):
    report = jg.memory(graph)
    text = jg.to_dot(graph, report=report)  # collapsed by default
    nodes = check_structure(text)
    groups = [n for n in nodes if re.fullmatch(r"g\d+", n)]
    assert len(groups) <= MAX_GROUPS + 3
    assert len(nodes) - len(groups) <= 2 * 7 + 1  # one node per role of inputs, outputs; legend
    assert "reads param x" in text and "writes new_param x" in text
    assert re.search(r"g\d+ \[[^\n]*color=red", text)  # the group of the peak eqn
    assert "dir=back" in text and "constraint=false" in text  # backward runs up, residuals
    if shutil.which("dot"):
        graphviz(text, timeout=60)  # minutes before the collapsed view was bounded
    return text


@needs_dot
def test_collapsed_view_of_a_big_training_step_is_bounded():
    graph = big_graph(40)
    assert len(graph.eqns) > 1000 and len(graph.inputs) > MAX_ENDS
    check_collapsed(graph)


@pytest.mark.slow
@needs_dot
def test_collapsed_view_of_a_10k_eqn_step():
    graph = big_graph(400)
    assert len(graph.eqns) > 10_000
    check_collapsed(graph)


# -- bad arguments ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report():
    return jg.memory(GRAPHS["cond"])


def test_to_dot_bad_arguments():
    graph = GRAPHS["cond"]
    for bad in ("abc", None, jax.make_jaxpr(jnp.sin)(1.0), jg.memory(graph)):
        with pytest.raises(jg.JGraphError, match="takes a jgraph Graph"):
            jg.to_dot(bad)
    with pytest.raises(jg.JGraphError, match="collapse"):
        jg.to_dot(graph, collapse="no")  # truthy: it collapsed
    with pytest.raises(jg.JGraphError, match="jg.memory of this graph"):
        jg.to_dot(graph, report=jg.memory(GRAPHS["scan"]))
    with pytest.raises(TypeError, match="unexpected keyword"):
        jg.to_dot(graph, colapse=True)
    assert "label=3, labelloc" in jg.to_dot(graph, title=3).replace('"3"', "3")  # was an
    # AttributeError


def test_plot_paths(report, tmp_path):
    assert report.plot(tmp_path / "m") == tmp_path / "m.png"  # matplotlib adds .png: say so
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    assert report.plot(str(tmp_path / "m.svg")) == tmp_path / "m.svg"
    cases = {tmp_path: "is a folder", tmp_path / "m.xyz": "cannot write '.xyz'",
             tmp_path / "missing" / "m.png": "does not exist",
             tmp_path / "m.png" / "m.png": "is a file, not a folder",
             None: "file name", 3: "file name"}
    for path, message in cases.items():
        with pytest.raises(jg.JGraphError, match=message):
            report.plot(path)
    assert not list(tmp_path.glob("*.xyz")) and not (tmp_path.parent / f"{tmp_path.name}.png")\
        .exists()  # nothing drawn for a refused path (a folder once became folder.png)


def test_plot_arguments(report, tmp_path):
    path = tmp_path / "m.png"
    assert report.plot(path, report, labels=(x for x in "ab"), compiled=[np.int64(10), None],
                       title=3) == path  # numpy integers are bytes too
    for kwargs, message in [({"labels": ["a"]}, "1 labels for 2"),
                            ({"labels": "abc"}, "3 labels for 2"),
                            ({"compiled": [1, 2, 3]}, "3 compiled figures for 2"),
                            ({"compiled": 1.5e3}, "temp bytes"), ({"compiled": -1}, "temp bytes"),
                            ({"compiled": True}, "temp bytes")]:
        with pytest.raises(jg.JGraphError, match=message):
            report.plot(path, report, **kwargs)
    with pytest.raises(jg.JGraphError, match="other MemoryReports"):
        report.plot(path, [report])
    with pytest.raises(TypeError, match="unexpected keyword"):
        report.plot(path, color="red")
    empty = jg.memory(GRAPHS["no eqns"])
    assert empty.plot(path, report) == path  # a report with no steps first
