"""Issue 19 sweep probes: hand-built malformed graphs; custom rules at higher orders and JAX's
next remat/custom_vjp
`jg.testing` options and `check_grads` arguments.

Each function returns `(probes, slow_names)`; see tests/test_sweep_issue19.py.
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from jax import lax
from jax.core import ShapedArray

import jgraph as jg
from jgraph.ir import Literal, Region, Var


def graphs_probes():
    X = jnp.linspace(0.5, 1.0, 3)
    def good():
        return jg.trace(lambda p, x: jnp.sum(jnp.tanh(x * p) * x), X, X, param_argnums=0)
    def eq(g, i, **ch):
        e = list(g.eqns)
        e[i] = dataclasses.replace(e[i], **ch)
        return g.replace(eqns=tuple(e))
    def first(g, op):
        return next(i for i, e in enumerate(g.eqns) if e.op == op)

    MAL = [
      ("unknown input role", lambda g: g.replace(input_roles=("weights",) + g.input_roles[1:]),
          r"role"),
      ("input_roles too short", lambda g: g.replace(input_roles=g.input_roles[:1]),
          r"input_roles|role"),
      ("output_roles too long", lambda g: g.replace(output_roles=g.output_roles + ("aux",)),
          r"output_roles|role"),
      ("two loss outputs", lambda g: g.replace(outputs=g.outputs * 2, output_roles=("loss", "loss"),
          out_tree=None), r"loss"),
      ("loss output undefined var", lambda g: g.replace(outputs=(Var(g.outputs[0].aval),)),
          r"dangling"),
      ("mul with one input", lambda g: eq(g, first(g, "mul"), inputs=g.eqns[first(g,
          "mul")].inputs[:1]), r"mul"),
      ("mul with two outputs", lambda g: eq(g, first(g, "mul"), outputs=g.eqns[first(g,
          "mul")].outputs * 2), r"mul"),
      ("mul output wrong aval", lambda g: eq(g, first(g, "mul"), outputs=(Var(ShapedArray((4,),
          jnp.float32)),)), r"mul"),
      ("mul output int dtype", lambda g: eq(g, first(g, "mul"), outputs=(Var(ShapedArray((3,),
          jnp.int32)),)), r"mul"),
      ("reduce_sum missing axes param", lambda g: eq(g, first(g, "reduce_sum"), params={}),
          r"reduce_sum"),
      ("reduce_sum axes bad", lambda g: eq(g, first(g, "reduce_sum"), params={**g.eqns[first(g,
          "reduce_sum")].params, "axes": (5,)}), r"reduce_sum"),
      ("unknown op", lambda g: eq(g, first(g, "tanh"), op="tanhh"), r"unknown op 'tanhh'"),
      ("literal string value", lambda g: eq(g, first(g, "mul"), inputs=(Literal("a", ShapedArray((),
          jnp.float32)), g.eqns[first(g, "mul")].inputs[1])), r"literal|Literal|value"),
      ("literal value shape mismatch", lambda g: eq(g, first(g, "mul"), inputs=(Literal(np.ones(5,
          np.float32), ShapedArray((3,
              ), jnp.float32)), g.eqns[first(g, "mul")].inputs[1])), r"literal|Literal|value"),
      ("literal dtype mismatch", lambda g: eq(g, first(g, "mul"), inputs=(Literal(np.ones(3,
          np.int32), ShapedArray((3,
              ), jnp.float32)), g.eqns[first(g, "mul")].inputs[1])), r"literal|Literal|dtype"),
      ("eqn defines an input again", lambda g: eq(g, 0, outputs=(g.inputs[0],)),
          r"defined|twice|assign"),
      ("same eqn twice", lambda g: g.replace(eqns=g.eqns[:1] + g.eqns), r"defined|twice|assign"),
      ("eqn reads its own output", lambda g: eq(g, 0, inputs=(g.eqns[0].outputs[0],
          ) + g.eqns[0].inputs[1:]), r"before it is defined"),
      ("source an int", lambda g: eq(g, 0, source=17), "OK"),
      ("region parent cycle", lambda g: g.replace(regions=(Region(0, 1, None), Region(1, 0, None))),
          r"region"),
      ("region id duplicate", lambda g: g.replace(regions=(Region(0, None, None), Region(0, None,
          None))), r"region"),
      ("region policy not callable", lambda g: eq(g.replace(regions=(Region(0, None, "dots"),)), 0,
          regions=(0,)), r"policy"),
      ("eqn names missing region", lambda g: eq(g, 0, regions=(7,)), r"region 7"),
      ("param_argnums negative bool", lambda g: g.replace(param_argnums=True), r"param_argnums"),
      ("in_tree of 3 leaves", lambda g: g.replace(in_tree=jax.tree.structure(((0,), (0,), (0,)))),
          r"in_tree|inputs|leaves"),
      ("out_tree of 2 leaves", lambda g: g.replace(out_tree=jax.tree.structure((0, 0))),
          r"out_tree|outputs|leaves"),
      ("input aval a numpy array", lambda g: g.replace(inputs=(Var(np.ones(3)),) + g.inputs[1:]),
          r"aval"),
      ("output Literal wrong aval type", lambda g: g.replace(outputs=(Literal(1.0, "f32"),)),
          r"aval"),
      ("reduce_sum axes a str", lambda g: eq(g, first(g, "reduce_sum"), params={"axes": "0",
          "out_sharding": None}), r"reduce_sum"),
    ]
    ENTRY = [
      ("check", jg.check),
      ("evaluate", lambda g: jg.evaluate(g, X, X)),
      ("compile", lambda g: jg.compile(g)(X, X)),
      ("backward", lambda g: jg.evaluate(jg.backward(g), X, X)),
      ("remat", lambda g: jg.evaluate(jg.remat(jg.backward(g)), X, X)),
    ]
    CHECK_ONLY = ("mul output wrong aval", "mul output int dtype")
    REF = jax.value_and_grad(lambda p, x: jnp.sum(jnp.tanh(x * p) * x))(X, X)
    def _str_or_graph_error(g):
        try:
            return str(g)
        except jg.GraphError as e:  # a field of the wrong type: named, as check names it
            return str(e)
    PROBES = []
    for what, make, pat in MAL:
        for name, entry in ENTRY:
            if what in CHECK_ONLY and name != "check":
                continue
            if pat == "OK":
                exp = (lambda r: True) if name in ("check", "compile",
                    "evaluate") else (lambda r: np.allclose(r[0], REF[0]) and np.allclose(r[1],
                        REF[1]))
            else:
                exp = pat
            PROBES.append((f"{name}({what})", (lambda m=make, e=entry: e(m(good()))), exp))
        PROBES.append((f"str({what})", (lambda m=make: _str_or_graph_error(m(good()))),
            lambda s: isinstance(s, str)))
    return PROBES, []


def custom_testing_probes():
    T = jg.testing
    def draw(strategy):
        out = []
        @settings(max_examples=2, deadline=None, database=None,
            suppress_health_check=list(HealthCheck))
        @given(strategy)
        def t(x):
            out.append(x)
        t()
        return out
    def opt_probe(**kw):
        return lambda: draw(T.graphs(**kw))

    # custom jvp/vjp
    @jax.custom_jvp
    def f(x): return jnp.sin(x)
    f.defjvp(lambda p, t: (f(p[0]), 2 * jnp.cos(p[0]) * t[0]))
    @jax.custom_vjp
    def h(x): return jnp.sin(x)
    h.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (3 * jnp.cos(x) * ct,))
    @jax.custom_vjp
    def bad_struct(x): return jnp.sin(x)
    bad_struct.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (ct, ct))
    @jax.custom_vjp
    def bad_shape(x): return jnp.sin(x)
    bad_shape.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (jnp.ones(5),))
    @jax.custom_vjp
    def none_ct(x, y): return jnp.sin(x) * y
    none_ct.defvjp(lambda x, y: (jnp.sin(x) * y, (x, y)), lambda r, ct: (jnp.cos(r[0]) * r[1] * ct,
        None))
    @jax.custom_vjp
    def bf16_ct(x): return x * 2
    bf16_ct.defvjp(lambda x: (x * 2, None), lambda r, ct: (ct.astype(jnp.float32) * 2,))
    @jax.custom_vjp
    def int_ct(x): return x * 2
    int_ct.defvjp(lambda x: (x * 2, None), lambda r, ct: (jnp.ones(ct.shape, jnp.int32),))
    @jax.custom_jvp
    def bad_jvp_dtype(x): return jnp.sin(x)
    bad_jvp_dtype.defjvp(lambda p, t: (jnp.sin(p[0]), (jnp.cos(p[0]) * t[0]).astype(jnp.float16)))
    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def nd(x, n): return jnp.sin(x) * n
    nd.defvjp(lambda x, n: (jnp.sin(x) * n, x), lambda n, x, ct: (jnp.cos(x) * n * ct,))
    @jax.custom_vjp
    def orr(x): return jnp.sin(x) * x
    orr.defvjp(lambda x: (jnp.sin(x) * x, x), lambda x, ct: ((jnp.cos(x) * x + jnp.sin(x)) * ct,),
        optimize_remat=True)

    def eq_jax(fn, *args, order=1, atol=1e-5):
        def go():
            g, j = fn, fn
            for _ in range(order):
                g, j = jg.grad(g), jax.grad(j)
            return g(*args), j(*args)
        return go
    def close(r):
        a, b = r
        return all(np.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(jax.tree.leaves(a),
            jax.tree.leaves(b), strict=True))
    def both_raise(fn, *args):
        def go():
            try:
                jax.grad(fn)(*args)
            except Exception as e:
                jax_err = type(e).__name__
            else:
                jax_err = None
            try:
                out = jg.grad(fn)(*args)
            except jg.JGraphError:
                raise
            return jax_err, out
        return go
    def scan_print(x):
        def body(c, _):
            jax.debug.print("c={c}", c=c, ordered=True)
            return jnp.sin(c), None
        return jnp.sum(lax.scan(body, x, None, length=3)[0])
    def remat3(fn, *args, flag="jax_remat3"):
        def go():
            with jax.config.__getattribute__("_read")(flag) if False else _flag(flag):
                return jg.grad(fn)(*args), jax.grad(fn)(*args)
        return go
    @contextlib.contextmanager
    def _flag(name):
        old = getattr(jax.config, name)
        jax.config.update(name, True)
        try:
            yield
        finally:
            jax.config.update(name, old)

    X = jnp.float32(0.7)
    PROBES = [
      ("custom_jvp order 2", eq_jax(lambda x: f(f(x)), X, order=2), close),
      ("custom_jvp order 3", eq_jax(lambda x: f(x) * x, X, order=3), close),
      ("custom_jvp under checkpoint order 2", eq_jax(jax.checkpoint(lambda x: f(f(x))), X, order=2),
          close),
      ("custom_vjp order 1", eq_jax(lambda x: h(h(x)), X), close),
      ("custom_vjp order 2 (JAX: bwd traced)", eq_jax(lambda x: h(x) * x, X, order=2), close),
      ("custom_vjp bwd wrong structure", lambda: jg.grad(lambda x: bad_struct(x))(X),
          r"bwd|cotangent|custom_vjp|structure|2"),
      ("custom_vjp bwd wrong shape", lambda: jg.grad(lambda x: jnp.sum(bad_shape(x)))(jnp.ones(3)),
          r"bwd|cotangent|shape|custom_vjp"),
      ("custom_vjp bwd None cotangent", eq_jax(lambda x, y: none_ct(x, y), X, X), close),
      ("custom_vjp bwd None grad wrt y", lambda: (jg.grad(lambda x, y: none_ct(x, y), argnums=1)(X,
          X), jax.grad(lambda x, y: none_ct(x, y), argnums=1)(X, X)), close),
      ("custom_vjp f32 ct for bf16 input: grad in its dtype (JAX: f32)",
          lambda: (jg.grad(lambda x: jnp.sum(bf16_ct(x)).astype(jnp.float32))(jnp.ones(3,
              jnp.bfloat16)),
                  jax.grad(lambda x: jnp.sum(bf16_ct(x)).astype(jnp.float32))(jnp.ones(3,
                      jnp.bfloat16))), lambda r: r[0].dtype == jnp.bfloat16 and close(r)),
      ("custom_vjp int ct for float input (JAX: int grads)",
          lambda: (jg.grad(lambda x: jnp.sum(int_ct(x)))(jnp.ones(3)),
              jax.grad(lambda x: jnp.sum(int_ct(x)))(jnp.ones(3))), close),
      ("custom_jvp tangent wrong dtype", lambda: jg.grad(lambda x: bad_jvp_dtype(x))(X),
          r"dtype|tangent|float16|custom_jvp"),
      ("custom_vjp nondiff_argnums", eq_jax(lambda x: nd(x, 3.0), X), close),
      ("custom_vjp optimize_remat", eq_jax(lambda x: orr(orr(x)), X), close),
      ("custom_vjp optimize_remat order 2 (JAX refuses)", lambda: (jg.grad(jg.grad(orr))(X),
          2 * jnp.cos(X) - X * jnp.sin(X)), close),
      ("jax_remat3 flag", remat3(jax.checkpoint(lambda x: jnp.sin(jnp.sin(x))), X), close),
      ("jax_custom_vjp3 flag", remat3(lambda x: h(h(x)), X, flag="jax_custom_vjp3"), close),
      ("jax_custom_vjp3 optimize_remat", remat3(lambda x: orr(x), X, flag="jax_custom_vjp3"),
          close),
      ("debug.print ordered in scan", lambda: (jg.grad(scan_print)(jnp.ones(2)),
          jax.grad(scan_print)(jnp.ones(2))), close),
      ("debug.print ordered in scan, rematted",
          lambda: (jg.grad(jax.checkpoint(scan_print))(jnp.ones(2)),
              jax.grad(jax.checkpoint(scan_print))(jnp.ones(2))), close),
      # jg.testing options
      ("graphs exclude unknown", opt_probe(exclude=("bogus",)), r"unknown op families \['bogus'\]"),
      ("graphs exclude a str", opt_probe(exclude="scan"), r"tuple of op family names"),
      ("graphs families empty", opt_probe(families=()), r"no op family is left"),
      ("graphs dtype int32", opt_probe(dtype="int32"), r"floating dtype"),
      ("graphs dtype jnp.int32", opt_probe(dtype=jnp.int32), r"floating dtype"),
      ("graphs dtype complex64", opt_probe(dtype=jnp.complex64), r"floating dtype"),
      ("graphs dtype 'float'", opt_probe(dtype="float"), r"floating dtype|float"),
      ("graphs dtype bfloat16", opt_probe(dtype=jnp.bfloat16), lambda r: len(r) > 0),
      ("graphs dtype float16 str", opt_probe(dtype="float16"), lambda r: len(r) > 0),
      ("graphs dtype np.float32", opt_probe(dtype=np.float32), lambda r: len(r) > 0),
      ("graphs dtype float64 without x64", opt_probe(dtype="float64"), r"enable_x64"),
      ("graphs min>max", opt_probe(min_steps=5, max_steps=2), r"more than max_steps"),
      ("graphs negative min", opt_probe(min_steps=-1), r"min_steps must be in"),
      ("graphs huge max", opt_probe(max_steps=10**6), r"max_steps must be in"),
      ("graphs float steps", opt_probe(max_steps=2.0), r"max_steps must be an int"),
      ("graphs ranks reversed", opt_probe(ranks=(3, 1)), r"reversed"),
      ("graphs dims 0", opt_probe(dims=(0, 2)), r"dims\[0\] must be in"),
      ("graphs ranks an int", opt_probe(ranks=2), r"ranks must be a pair"),
      ("graphs loops 'yes'", opt_probe(loops="yes"), r"loops must be True or False"),
      ("graphs regions 1", opt_probe(regions=1), r"regions must be True or False"),
      ("graphs unknown option", opt_probe(steps=3), r"unknown options"),
      ("programs unknown option", lambda: draw(T.programs(max_step=3)), r"unknown options"),
      ("programs dtype int", lambda: draw(T.programs(dtype="int8")), r"floating dtype"),
      ("programs exclude unknown", lambda: draw(T.programs(exclude=["nope"])),
          r"unknown op families"),
      ("graphs min 0 max 0", opt_probe(min_steps=0, max_steps=0), lambda r: len(r) > 0),
      ("check_grads order 1.5", lambda: T.check_grads(jnp.sin, (X,), order=1.5),
          r"order must be an int"),
      ("check_grads order 0", lambda: T.check_grads(jnp.sin, (X,), order=0), r"order must be in"),
      ("check_grads order True", lambda: T.check_grads(jnp.sin, (X,), order=True),
          r"order must be an int"),
      ("check_grads order '2'", lambda: T.check_grads(jnp.sin, (X,), order="2"),
          r"order must be an int"),
      ("check_grads eps 0", lambda: T.check_grads(jnp.sin, (X,), eps=0), r"eps must be"),
      ("check_grads eps nan", lambda: T.check_grads(jnp.sin, (X,), eps=float("nan")),
          r"eps must be"),
      ("check_grads rtol -1", lambda: T.check_grads(jnp.sin, (X,), rtol=-1), r"rtol must be"),
      ("check_grads atol str", lambda: T.check_grads(jnp.sin, (X,), atol="1e-3"), r"atol must be"),
      ("check_grads seed -1", lambda: T.check_grads(jnp.sin, (X,), seed=-1), r"seed must be in"),
      ("check_grads args an array", lambda: T.check_grads(jnp.sin, X), r"args must be the tuple"),
      ("check_grads fn not callable", lambda: T.check_grads(3, (X,)), r"fn must be callable"),
      ("check_grads int args only", lambda: T.check_grads(lambda i: i * 2, (jnp.int32(3),)),
          r"no floating argument"),
      ("check_grads wrong rule caught", lambda: T.check_grads(lambda x: f(x), (X,)),
          (AssertionError, "order-1")),
      ("check_grads fn raising", lambda: T.check_grads(lambda x: x @ jnp.ones(5), (jnp.ones(2),)),
          (TypeError, "dot_general|shape")),
      ("check_grads args dict", lambda: T.check_grads(lambda d: jnp.sin(d["a"]), ({"a": X},)),
          lambda r: True),
      ("check_grads order 2 custom_jvp", lambda: T.check_grads(lambda x: h(x), (X,), order=2),
          (AssertionError, "order-1")),
      ("check_grads np.int64 order", lambda: T.check_grads(jnp.sin, (X,), order=np.int64(2)),
          lambda r: True),
    ]
    return PROBES, []
