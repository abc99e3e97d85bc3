"""Issue 19 sweep probes: `jg.remat(budget=, planner=)`, `MemoryReport.plot`, `jg.to_dot`.

Each function returns `(probes, slow_names)`; see tests/test_sweep_issue19.py.
"""

import os
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jgraph as jg


def planner_probes():
    def chain(p, x):
        for w in p:
            x = jnp.tanh(x @ w)
        return jnp.sum(x)
    P = [jnp.full((64, 64), 0.01, jnp.float32) for _ in range(6)]
    X = jnp.ones((128, 64), jnp.float32)
    G = jg.trace(chain, P, X, param_argnums=0)
    GB = jg.backward(G)
    REF = jax.value_and_grad(chain)(P, X)

    def same(g):
        v, gr = jg.evaluate(g, P, X)
        return np.allclose(v, REF[0], rtol=1e-5) and all(np.allclose(a, b, rtol=1e-4,
            atol=1e-6) for a, b in zip(jax.tree.leaves(gr), jax.tree.leaves(REF[1]), strict=True))

    def scan_fn(p, x):
        def body(c, w):
            return jnp.tanh(c @ w), None
        return jnp.sum(lax.scan(body, x, p)[0])
    PS = jnp.full((6, 64, 64), 0.01)
    GS = jg.backward(jg.trace(scan_fn, PS, X, param_argnums=0))
    def cond_fn(p, x):
        y = lax.cond(jnp.sum(x) > 0, lambda: jnp.tanh(x @ p), lambda: jnp.sin(x @ p))
        return jnp.sum(jnp.tanh(y @ p))
    GC = jg.backward(jg.trace(cond_fn, P[0], X, param_argnums=0))
    def while_fn(p, x):
        n = lax.while_loop(lambda i: i < 3, lambda i: i + 1, 0)
        return jnp.sum(jnp.tanh(x @ p) * n)
    GW = jg.backward(jg.trace(while_fn, P[0], X, param_argnums=0))
    GA = jg.accumulate(GB, period=2)
    GO = jg.optimizer_step(GA, optax.adam(1e-3))

    def ok_graph(g):
        jg.check(g)
        return isinstance(g, jg.Graph)

    def warned(fn):
        def call():
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                g = fn()
            return g, [str(x.message) for x in w]
        return call

    PROBES = [
      ("budget 0 bytes", lambda: jg.remat(GB, budget=0), r"smallest|reach"),
      ("budget -1", lambda: jg.remat(GB, budget=-1), r"non-negative"),
      ("budget NaN", lambda: jg.remat(GB, budget=float("nan")), r"non-negative"),
      ("budget inf", lambda: jg.remat(GB, budget=float("inf")), r"non-negative"),
      ("budget -inf", lambda: jg.remat(GB, budget=-float("inf")), r"non-negative"),
      ("budget True", lambda: jg.remat(GB, budget=True), r"non-negative number"),
      ("budget False", lambda: jg.remat(GB, budget=False), r"non-negative number"),
      ("budget '50'", lambda: jg.remat(GB, budget="50"), r"percentage"),
      ("budget 'abc'", lambda: jg.remat(GB, budget="abc"), r"percentage"),
      ("budget '150%'", lambda: jg.remat(GB, budget="150%"), r"\(0%, 100%\]"),
      ("budget '0%'", lambda: jg.remat(GB, budget="0%"), r"\(0%, 100%\]"),
      ("budget '-5%'", lambda: jg.remat(GB, budget="-5%"), r"percentage"),
      ("budget '' ", lambda: jg.remat(GB, budget=""), r"percentage"),
      ("budget '50 %'", lambda: jg.remat(GB, budget="50 %"), same),
      ("budget '100%'", lambda: jg.remat(GB, budget="100%"), same),
      ("budget '1e2%'", lambda: jg.remat(GB, budget="1e2%"), r"percentage"),
      ("budget 'nan%'", lambda: jg.remat(GB, budget="nan%"), r"percentage"),
      ("budget '50MB'", lambda: jg.remat(GB, budget="50MB"), r"percentage"),
      ("budget traced", lambda: jax.jit(lambda b: jg.remat(GB, budget=b) and b)(1e9),
          r"non-negative number"),
      ("budget [1]", lambda: jg.remat(GB, budget=[1]), r"non-negative number"),
      ("budget complex", lambda: jg.remat(GB, budget=1j), r"non-negative number"),
      ("budget huge", lambda: jg.remat(GB, budget=10**30), same),
      ("budget huge int > float", lambda: jg.remat(GB, budget=10**400), r"finite, non-negative"),
      ("budget np.int64", lambda: jg.remat(GB, budget=np.int64(10**9)), same),
      ("budget np.float32", lambda: jg.remat(GB, budget=np.float32(1e9)), same),
      ("budget jnp scalar", lambda: jg.remat(GB, budget=jnp.asarray(10**9)), same),
      ("budget np.nan", lambda: jg.remat(GB, budget=np.float64("nan")), r"non-negative"),
      ("budget np.bool_", lambda: jg.remat(GB, budget=np.bool_(True)), r"non-negative number"),
      ("budget fractional bytes", lambda: jg.remat(GB, budget=1e9 + 0.5), same),
      ("budget '50%' fits", lambda: warned(lambda: jg.remat(GB, budget="50%"))(),
          lambda r: same(r[0])),
      ("budget '1%' warns", lambda: warned(lambda: jg.remat(GB, budget="1%"))(),
          lambda r: same(r[0]) and any("%" in m for m in r[1])),
      ("budget bytes", lambda: jg.remat(GB, budget=300_000), same),
      ("planner 'fastest'", lambda: jg.remat(GB, budget="50%", planner="fastest"),
          r"planner is one of"),
      ("planner None", lambda: jg.remat(GB, budget="50%", planner=None), r"planner is one of"),
      ("planner 'FAST'", lambda: jg.remat(GB, budget="50%", planner="FAST"), r"planner is one of"),
      ("planner 3", lambda: jg.remat(GB, budget="50%", planner=3), r"planner is one of"),
      ("planner ['fast']", lambda: jg.remat(GB, budget="50%", planner=["fast"]),
          r"planner is one of"),
      ("planner np.str_", lambda: jg.remat(GB, budget="50%", planner=np.str_("fast")), same),
      ("planner bad, no budget", lambda: jg.remat(GB, planner="fastest"), r"planner"),
      ("planner bad + bad budget", lambda: jg.remat(GB, budget="x", planner="y"),
          r"planner|budget"),
      ("planner exact", lambda: jg.remat(GB, budget="50%", planner="exact"), same),
      ("planner fast", lambda: jg.remat(GB, budget="50%", planner="fast"), same),
      ("policy and budget", lambda: jg.remat(GB, policy=jg.policies.dots_saveable, budget="50%"),
          r"either policy= or budget="),
      ("forward-only graph", lambda: jg.remat(G, budget="50%"), r"joint forward \+ backward"),
      ("not a graph: function", lambda: jg.remat(chain, budget="50%"), r"Graph"),
      ("not a graph: None", lambda: jg.remat(None, budget="50%"), r"Graph"),
      ("not a graph: str", lambda: jg.remat("graph", budget="50%"), r"Graph"),
      ("accumulate graph budget", lambda: jg.remat(GA, budget="50%"), ok_graph),
      ("optimizer step graph budget", lambda: jg.remat(GO, budget="50%"), ok_graph),
      ("optimizer step graph bytes", lambda: jg.remat(GO, budget=10**9), ok_graph),
      ("reset graph budget", lambda: jg.remat(jg.reset(GO), budget="50%"), r"joint|backward"),
      ("scan graph budget", lambda: jg.remat(GS, budget="50%"), lambda g: np.allclose(jg.evaluate(g,
          PS, X)[1], jax.grad(scan_fn)(PS, X), rtol=1e-4, atol=1e-6)),
      ("cond graph budget", lambda: jg.remat(GC, budget="50%"), lambda g: np.allclose(jg.evaluate(g,
          P[0], X)[1], jax.grad(cond_fn)(P[0], X), rtol=1e-4, atol=1e-6)),
      ("while graph budget", lambda: jg.remat(GW, budget="50%"),
          lambda g: np.allclose(jg.evaluate(g, P[0], X)[1], jax.grad(while_fn)(P[0], X), rtol=1e-4,
              atol=1e-6)),
      ("remat twice with budget", lambda: jg.remat(jg.remat(GB, budget="50%"), budget="50%"), same),
      ("budget on rematted policy graph", lambda: jg.remat(jg.remat(GB,
          policy=jg.policies.dots_saveable), budget="50%"), same),
      ("budget kwarg positional policy str", lambda: jg.remat(GB, "dots_saveable"), r"policy"),
      ("policy not callable", lambda: jg.remat(GB, policy=3), r"policy"),
    ]
    return PROBES, ['budget 0 bytes', "budget '50 %'", 'planner np.str_', 'planner exact',
        'accumulate graph budget', 'optimizer step graph budget', 'scan graph budget',
            'cond graph budget', 'while graph budget', 'remat twice with budget',
                'budget on rematted policy graph', 'planner fast']


def pictures_probes():
    def f(p, x):
        return jnp.sum(jnp.tanh(x @ p) ** 2)
    P = jnp.full((4, 4), 0.1)
    X = jnp.ones((2, 4))
    G = jg.trace(f, P, X, param_argnums=0)
    GB = jg.backward(G)
    R = jg.memory(GB)
    T = tempfile.mkdtemp()
    RO = os.path.join(T, "ro")
    os.mkdir(RO)
    os.chmod(RO, 0o500)
    FILE = os.path.join(T, "afile")
    open(FILE, "w").write("x")
    def scan_g():
        return jg.backward(jg.trace(lambda p, x: jnp.sum(lax.scan(lambda c, _: (jnp.sin(c @ p),
            None), x, None, length=3)[0]), P, X, param_argnums=0))
    def png(p):
        return lambda out: os.path.getsize(out) > 0
    def isdot(s):
        return isinstance(s, str) and s.startswith("digraph") and s.rstrip().endswith("}")

    PROBES = [
      ("plot None path", lambda: R.plot(None), r"file name"),
      ("plot int path", lambda: R.plot(123), r"file name"),
      ("plot bytes path", lambda: R.plot(b"x.png"), r"file name"),
      ("plot folder", lambda: R.plot(T), r"is a folder"),
      ("plot missing folder", lambda: R.plot(os.path.join(T, "nope", "m.png")), r"does not exist"),
      ("plot under a file", lambda: R.plot(os.path.join(FILE, "m.png")), r"is a file"),
      ("plot name too long", lambda: R.plot(os.path.join(T, "m" * 300 + ".png")),
          r"cannot write .*too long"),
      ("plot name too long, no suffix", lambda: R.plot(os.path.join(T, "m" * 300)),
          r"cannot write .*too long"),
      ("plot bad suffix", lambda: R.plot(os.path.join(T, "m.xyz")), r"cannot write '.xyz'"),
      ("plot no suffix", lambda: R.plot(os.path.join(T, "m")),
          lambda p: str(p).endswith(".png") and os.path.exists(p)),
      ("plot empty string", lambda: R.plot(""), r"folder|file name"),
      ("plot svg", lambda: R.plot(os.path.join(T, "m.svg")), lambda p: os.path.exists(p)),
      ("plot upper suffix", lambda: R.plot(os.path.join(T, "m.PNG")), lambda p: os.path.exists(p)),
      ("plot other not report", lambda: R.plot(os.path.join(T, "a.png"), GB),
          r"overlays other MemoryReports"),
      ("plot labels wrong length", lambda: R.plot(os.path.join(T, "a.png"), R, labels=["a"]),
          r"1 labels for 2"),
      ("plot labels a str", lambda: R.plot(os.path.join(T, "a.png"), labels="plan"), r"labels"),
      ("plot labels int", lambda: R.plot(os.path.join(T, "a.png"), labels=3), r"labels"),
      ("plot labels of non-str", lambda: R.plot(os.path.join(T, "a.png"), labels=[1]),
          lambda p: os.path.exists(p)),
      ("plot compiled negative", lambda: R.plot(os.path.join(T, "a.png"), compiled=-1),
          r"temp bytes"),
      ("plot compiled float", lambda: R.plot(os.path.join(T, "a.png"), compiled=1.5),
          r"temp bytes"),
      ("plot compiled nan", lambda: R.plot(os.path.join(T, "a.png"), compiled=float("nan")),
          r"temp bytes"),
      ("plot compiled str", lambda: R.plot(os.path.join(T, "a.png"), compiled="1MB"),
          r"temp bytes|compiled"),
      ("plot compiled True", lambda: R.plot(os.path.join(T, "a.png"), compiled=True),
          r"temp bytes"),
      ("plot compiled too many", lambda: R.plot(os.path.join(T, "a.png"), compiled=[1, 2]),
          r"2 compiled figures for 1"),
      ("plot compiled np.int64", lambda: R.plot(os.path.join(T, "a.png"), compiled=np.int64(1000)),
          png(1)),
      ("plot compiled 0", lambda: R.plot(os.path.join(T, "a.png"), compiled=0), png(1)),
      ("plot compiled dict", lambda: R.plot(os.path.join(T, "a.png"), compiled={"temp": 3}),
          r"temp bytes|compiled"),
      ("plot title int", lambda: R.plot(os.path.join(T, "a.png"), title=12), png(1)),
      ("plot empty graph report", lambda: jg.memory(jg.trace(lambda p: jnp.sum(p), P,
          param_argnums=0)).plot(os.path.join(T, "e.png")), png(1)),
      ("memory of None", lambda: jg.memory(None), r"Graph"),
      ("memory of function", lambda: jg.memory(f), r"Graph"),
      ("to_dot None", lambda: jg.to_dot(None), r"jgraph Graph"),
      ("to_dot function", lambda: jg.to_dot(f), r"jgraph Graph"),
      ("to_dot report of another graph", lambda: jg.to_dot(GB, report=jg.memory(G)),
          r"jg.memory of this graph"),
      ("to_dot report a dict", lambda: jg.to_dot(GB, report={}), r"report"),
      ("to_dot report a str", lambda: jg.to_dot(GB, report="peak"), r"report"),
      ("to_dot collapse str", lambda: jg.to_dot(GB, collapse="yes"), r"collapse"),
      ("to_dot collapse 1", lambda: jg.to_dot(GB, collapse=1), r"collapse"),
      ("to_dot title None", lambda: jg.to_dot(GB, title=None), isdot),
      ("to_dot title quotes", lambda: jg.to_dot(GB, title='a "b" \\ {c} <d>'),
          lambda s: isdot(s) and '\\"b\\"' in s),
      ("to_dot title newline", lambda: jg.to_dot(GB, title="a\nb"),
          lambda s: isdot(s) and "a\nb" not in s),
      ("to_dot scan", lambda: jg.to_dot(scan_g()), isdot),
      ("to_dot collapsed scan", lambda: jg.to_dot(scan_g(), collapse=True), isdot),
      ("to_dot positional collapse", lambda: jg.to_dot(GB, True), (TypeError, "positional")),
      ("to_dot malformed graph", lambda: jg.to_dot(GB.replace(inputs=None)), r"inputs"),
      ("to_dot malformed eqn input", lambda: jg.to_dot(GB.replace(outputs=(3,) + GB.outputs[1:])),
          r"outputs\[0\]"),
      ("memory malformed graph", lambda: jg.memory(GB.replace(inputs=None)), r"inputs"),
      ("to_dot remat graph with report", lambda: jg.to_dot(jg.remat(GB,
          policy=jg.policies.nothing_saveable), report=jg.memory(jg.remat(GB,
              policy=jg.policies.nothing_saveable))), isdot),
    ]
    return PROBES, []
