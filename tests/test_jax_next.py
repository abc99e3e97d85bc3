"""JAX's own programs jgraph refused before (issue 19, items 9-12; issue 29), each checked against
JAX:

- a custom_vjp bwd returning an f32 cotangent for a bf16 input;
- `jax.custom_vjp(..., optimize_remat=True)` (primitive `remat_opt`), and its primal output under
  a remat when fwd's is another (issue 29);
- a custom_vjp bwd returning a Python float, and a custom_vjp closing over a value, under vmap
  (issue 29);
- JAX's next remat and custom_vjp (`jax_remat3`, `jax_custom_vjp3`: `call_hi_primitive`), under
  both flag settings (the `jax_flags` fixture sets them and restores them);
- `jax.debug.print`, ordered or not, in scan / fori_loop / cond / while bodies: printed in JAX's
  order, in the forward pass only, never replayed by a remat.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from custom_programs import BY_NAME
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jgraph as jg

FLAGS = ("jax_remat3", "jax_custom_vjp3")


@pytest.fixture(params=[False, True], ids=["jax_default", "remat3_custom_vjp3"])
def jax_flags(request):
    """JAX's next remat and custom_vjp on or off; the previous settings restored after. Tests
    run under both; `_both` cases run the second setting only with `-m slow` (suite time)."""
    saved = {f: getattr(jax.config, f) for f in FLAGS}
    for f in FLAGS:
        jax.config.update(f, request.param)
    try:
        yield request.param
    finally:
        for f, value in saved.items():
            jax.config.update(f, value)


def _both(names, quick=()):
    """(name, flag) cases: every name with the default flags; with JAX's next remat and
    custom_vjp, the `quick` ones by default and all of them with `-m slow`."""
    return ([pytest.param(n, False, id=f"{n}-jax_default") for n in names]
            + [pytest.param(n, True, id=f"{n}-remat3_custom_vjp3",
                            marks=[] if n in quick else [pytest.mark.slow]) for n in names])


def _close(got, want, rtol=2e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=rtol, atol=1e-6)


def _step(fn, *args, argnums=0):
    return jg.compile(jg.backward(jg.trace(fn, *args, param_argnums=argnums)))


# -- item 11: remat3 / custom_vjp3 give the graphs the default flags give ------------------------
def _remat_program(w, x):  # RematTest's shapes: names and a name policy, nesting, a scanned layer
    def layer(h):
        a = checkpoint_name(jnp.tanh(h @ w), "a")
        return jnp.sin(a @ w)

    h = jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names("a"))(x)
    h = jax.checkpoint(lambda h: jax.checkpoint(jnp.sin)(h) * h)(h)
    dots = jax.checkpoint(lambda c: jnp.tanh(c @ w), policy=jax.checkpoint_policies.dots_saveable)
    h, _ = lax.scan(lambda c, _: (dots(c), None), h, None, length=2)
    return jnp.sum(h)


def test_remat3_and_custom_vjp3_trace_to_the_same_graphs():
    """Under JAX's next remat and custom_vjp, jg.trace gives the graph (regions, policies, names,
    custom_vjp ops) and jg.remat the plan that the default flags give."""
    w, x = jnp.full((3, 3), 0.3), jnp.ones((2, 3))
    f = BY_NAME["vjp_basic"].make

    def both(w, x):
        return _remat_program(w, x) + jnp.sum(f()(x))

    printed = []
    for on in (False, True):
        saved = {flag: getattr(jax.config, flag) for flag in FLAGS}
        try:
            for flag in FLAGS:
                jax.config.update(flag, on)
            g = jg.trace(both, w, x, param_argnums=0)
            printed.append((str(g), str(jg.remat(jg.backward(g)))))
        finally:
            for flag, value in saved.items():
                jax.config.update(flag, value)
    assert "call_hi_primitive" not in printed[1][0]
    assert printed[0] == printed[1]


def test_remat_program_gradients_equal_jax(jax_flags):
    w, x = jnp.full((3, 3), 0.3), jnp.ones((2, 3))
    gb = jg.backward(jg.trace(_remat_program, w, x, param_argnums=0))
    want = jax.jit(jax.value_and_grad(_remat_program))(w, x)
    _close(jg.compile(gb)(w, x), want)
    _close(jg.compile(jg.remat(gb))(w, x), want)
    _close(jg.compile(jg.remat(gb, policy=jg.policies.nothing_saveable))(w, x), want)


@pytest.mark.parametrize("name,jax_flags", _both(
    ["vjp_basic", "vjp_own_fwd", "vjp_clip_gradient", "vjp_pytrees", "vjp_nestable"],
    quick=["vjp_basic", "vjp_clip_gradient"]), indirect=["jax_flags"])
def test_custom_vjp_programs_to_the_second_order_equal_jax(jax_flags, name):
    fn, x = BY_NAME[name].make(), jnp.float32(0.7)
    step = _step(fn, x)
    _close(step(x), jax.jit(jax.value_and_grad(fn))(x))
    want = jax.jit(jax.grad(lambda x: jax.value_and_grad(fn)(x)[1]))(x)
    _close(jax.grad(lambda x: step(x)[1])(x), want)
    _close(_step(lambda x: step(x)[1], x)(x)[1], want)


# -- item 9: a bwd's f32 cotangent for a bf16 input ---------------------------------------------
def _scaled_double(cast):
    """A custom_vjp whose bwd computes in f32 (JAX's custom_vjp allows an f32 cotangent for a
    bf16 input); with `cast`, the bwd casts back to the input's dtype itself."""
    @jax.custom_vjp
    def f(x):
        return x * 2

    def bwd(_, g):
        ct = g.astype(jnp.float32) * 2.3
        return (ct.astype(g.dtype) if cast else ct,)

    f.defvjp(lambda x: (f(x), None), bwd)
    return f


_BF16 = {  # name: (program of f, argument dtype, does JAX 0.10.2 accept the f32 cotangent?)
    "direct": (lambda f, x: jnp.sum(f(x).astype(jnp.float32)), jnp.bfloat16, True),
    "twice": (lambda f, x: jnp.sum((f(x) * f(x)).astype(jnp.float32)), jnp.bfloat16, True),
    "from_f32": (lambda f, x: jnp.sum(f(x.astype(jnp.bfloat16)).astype(jnp.float32)),
                 jnp.float32, True),
    "fan_out": (lambda f, x: jnp.sum((f(x) + x).astype(jnp.float32)), jnp.bfloat16, False),
    "in_a_scan": (lambda f, x: jnp.sum(lax.scan(lambda c, _: (f(c), None), x, None,
                                                length=2)[0].astype(jnp.float32)),
                  jnp.bfloat16, False),
}


@pytest.mark.parametrize("name,jax_flags", _both(sorted(_BF16), quick=["fan_out"]),
                         indirect=["jax_flags"])
def test_an_f32_cotangent_for_a_bf16_input_is_cast_to_bf16(jax_flags, name):
    """JAX 0.10.2 passes the f32 cotangent on as it is: its gradient is f32 for a bf16 input, and
    its backward fails where that cotangent meets another bf16 op. jgraph casts it to the input's
    dtype, so the backward stays typed: its gradient is JAX's with the cast written in the bwd,
    bitwise, and JAX's own rounded to bf16 where JAX accepts the program."""
    program, dtype, jax_accepts = _BF16[name]
    x = jnp.full((2, 2), 1.3, dtype)
    ours = _step(functools.partial(program, _scaled_double(False)), x)(x)
    assert ours[1].dtype == dtype
    cast = jax.jit(jax.value_and_grad(functools.partial(program, _scaled_double(True))))(x)
    np.testing.assert_array_equal(np.asarray(ours[1], np.float32),
                                  np.asarray(cast[1], np.float32))
    plain = functools.partial(program, _scaled_double(False))
    if jax_accepts:
        want = jax.jit(jax.grad(plain))(x)
        np.testing.assert_allclose(np.asarray(ours[1], np.float32), np.asarray(want, np.float32),
                                   rtol=1e-2)
    else:
        with pytest.raises((TypeError, AssertionError), match="bfloat16|float32"):
            jax.jit(jax.grad(plain))(x)  # (jitted, JAX fails an internal assertion)


# -- item 10: custom_vjp(..., optimize_remat=True) ----------------------------------------------
def _optimized():
    """JAX's test_optimize_remat_multiple_args."""
    def f_(x, y):
        return jnp.sin(x) * y

    @jax.custom_vjp
    def f(x, y):
        return f_(x, y)

    def f_bwd(res, g):
        cos_x, sin_x, y = res
        return (cos_x * g * y, sin_x * g)

    f.defvjp(lambda x, y: (f(x, y), (jnp.cos(x), jnp.sin(x), y)), f_bwd, optimize_remat=True)
    return f, f_


_OPT_REMAT = {
    "plain": lambda f: lambda x, y: f(x, y),
    "nested": lambda f: lambda x, y: f(f(x, y), y),
    "checkpointed": lambda f: jax.checkpoint(lambda x, y: f(f(x, y) * x, y)),
    "scanned": lambda f: lambda x, y: lax.scan(lambda c, _: (jax.checkpoint(f)(c, y), None), x,
                                               None, length=3)[0],
}


@pytest.mark.parametrize("name,jax_flags", _both(sorted(_OPT_REMAT), quick=["checkpointed"]),
                         indirect=["jax_flags"])
def test_optimize_remat_gradients_equal_jax(jax_flags, name):
    f, f_ = _optimized()
    program, plain = _OPT_REMAT[name](f), _OPT_REMAT[name](f_)
    x, y = jnp.float32(0.8), jnp.float32(1.3)
    g = jg.trace(program, x, y, param_argnums=(0, 1))
    assert "custom_vjp_call" in {e.op for e in g.eqns} | {
        e.op for e in g.eqns for v in e.params.values() if hasattr(v, "eqns") for e in v.eqns}
    gb = jg.backward(g)
    want = jax.jit(jax.value_and_grad(program, (0, 1)))(x, y)
    # the rule is the true derivative
    _close(want, jax.jit(jax.value_and_grad(plain, (0, 1)))(x, y))
    _close(jg.compile(gb)(x, y), want)
    _close(jg.compile(jg.remat(gb, policy=jg.policies.nothing_saveable))(x, y), want)


def _another_primal(residual):
    """JAX's test_optimize_remat_gh21303: the function is tan, but its fwd gives sin as the primal
    output, and the input itself ("input") or cos ("cos") as the residual."""
    @jax.custom_vjp
    def f(x):
        return jnp.tan(x)

    if residual == "input":
        f.defvjp(lambda x: (jnp.sin(x), (x,)), lambda r, g: (jnp.cos(r[0]) * g,),
                 optimize_remat=True)
    else:
        f.defvjp(lambda x: (jnp.sin(x), (jnp.cos(x),)), lambda r, g: (r[0] * g,),
                 optimize_remat=True)
    return f


_SAVING = jax.checkpoint_policies.everything_saveable
_ANOTHER_PRIMAL = {  # name: (residual, program of f)
    "gh21303": ("input", lambda f: lambda x: jax.checkpoint(f)(x) ** 2),
    "remat": ("cos", lambda f: lambda x: jax.checkpoint(f)(x) ** 2),
    "saving_input": ("input", lambda f: lambda x: jax.checkpoint(f, policy=_SAVING)(x) ** 2),
    "saving_cos": ("cos", lambda f: lambda x: jax.checkpoint(f, policy=_SAVING)(x) ** 2),
    "no_remat": ("cos", lambda f: lambda x: f(x) ** 2),
    "cond_in_remat": ("cos", lambda f: lambda x: jax.checkpoint(
        lambda x: lax.cond(x > 0, f, jnp.sin, x))(x) ** 2),
    "remat_in_scan": ("cos", lambda f: lambda x: lax.scan(
        lambda c, _: (jax.checkpoint(f)(c) + 1.0, None), x, None, length=2)[0] ** 2),
    "saving_around_remat": ("cos", lambda f: lambda x: jax.checkpoint(
        jax.checkpoint(f), policy=_SAVING)(x) ** 2),
}


@pytest.mark.parametrize("name,jax_flags", _both(sorted(_ANOTHER_PRIMAL), quick=["gh21303"]),
                         indirect=["jax_flags"])
def test_optimize_remat_takes_the_primal_output_where_jax_does(jax_flags, name):
    """Where fwd's primal output is not the function's, JAX's answer depends on the remat around
    the call: under one, the forward computes the function itself and fwd runs for its residuals
    only, unless the remat saves those (default flags: a policy saving the call, and fwd has
    residuals other than its inputs). jgraph takes the same primal output, so its value and
    gradient are JAX's (it gave fwd's: tan(3.2)**2 was sin(3.2)**2, and the gradient's sign
    flipped). (Not here: where the same remat reads the call's output again in its backward, JAX
    recomputes it with fwd, so its backward reads sin where its forward read tan; jgraph's
    backward reads the forward's value.)"""
    residual, make = _ANOTHER_PRIMAL[name]
    program, x = make(_another_primal(residual)), jnp.float32(3.2)
    want = jax.jit(jax.value_and_grad(program))(x)
    if name == "gh21303":  # what JAX's own test asserts
        _close(want[0], jnp.tan(x) ** 2)
    gb = jg.backward(jg.trace(program, x, param_argnums=0))
    _close(jg.compile(gb)(x), want)
    _close(jg.compile(jg.remat(gb))(x), want)
    _close(jg.value_and_grad(program)(x), want)


# -- item 12: jax.debug.print in loop bodies -----------------------------------------------------
def _print(fmt, ordered, **values):
    jax.debug.print(fmt, ordered=ordered, **values)


def _scan(x, ordered=True, checkpointed=False):
    def body(c, i):
        _print("scan {i} {c}", ordered, i=i, c=c)
        return jnp.sin(c) * 2.0, c

    body = jax.checkpoint(body) if checkpointed else body
    c, ys = lax.scan(body, x, jnp.arange(3))
    _print("after {c}", ordered, c=c)
    return jnp.sum(c) + jnp.sum(ys)


def _fori(x, ordered=True, checkpointed=False):
    def body(i, c):
        _print("fori {i}", ordered, i=i)
        return jnp.tanh(c) + i

    body = jax.checkpoint(body) if checkpointed else body
    return jnp.sum(lax.fori_loop(0, 3, body, x))


def _cond(x, ordered=True, checkpointed=False):
    def a(x):
        _print("branch a {x}", ordered, x=x)
        return jnp.sin(x)

    def b(x):
        _print("branch b {x}", ordered, x=x)
        return jnp.cos(x)

    wrap = jax.checkpoint if checkpointed else (lambda f: f)
    return wrap(lambda x: lax.cond(x > 0, a, b, x) + lax.cond(x < 0, a, b, x))(x)


def _while(x, ordered=True, checkpointed=False):
    def body(c):
        _print("while {i}", ordered, i=c[0])
        return c[0] + 1, c[1] * 2.0

    n, v = lax.while_loop(lambda c: c[0] < 3, body, (0, lax.stop_gradient(x)))
    return jnp.sin(x) * n + v


def _nested(x, ordered=False, checkpointed=False):
    def inner(c, j):
        _print("inner {j} {c}", ordered, j=j, c=c)
        return c * 1.5, None

    def outer(c, i):
        _print("outer {i}", ordered, i=i)
        return lax.scan(inner, jnp.sin(c), jnp.arange(2))[0], None

    outer = jax.checkpoint(outer) if checkpointed else outer
    return jnp.sum(lax.scan(outer, x, jnp.arange(2))[0] ** 2)


def _custom_rules(x, ordered=True, checkpointed=False):
    """Prints in a custom_jvp's body, a custom_vjp's fwd and bwd: the bwd prints in the backward,
    the others once (jgraph's backward re-runs the jvp rule's primal: not its prints)."""
    @jax.custom_jvp
    def f(x):
        _print("f body {x}", ordered, x=x)
        return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), 2 * jnp.cos(p[0]) * t[0]))

    @jax.custom_vjp
    def g(x):
        return jnp.cos(x)

    def g_fwd(x):
        _print("g fwd {x}", ordered, x=x)
        return g(x), jnp.sin(x)

    def g_bwd(s, ct):
        _print("g bwd {ct}", ordered, ct=ct)
        return (-s * ct,)

    g.defvjp(g_fwd, g_bwd)
    body = lambda c, _: (g(f(c)), None)  # noqa: E731
    body = jax.checkpoint(body) if checkpointed else body
    return lax.scan(body, x, None, length=2)[0] * 2


_PRINTING = {"scan": _scan, "scan_unordered": functools.partial(_scan, ordered=False),
             "fori": _fori, "cond": _cond, "while": _while, "nested": _nested,
             "custom_rules": _custom_rules}


def _printed(capfd, run):
    capfd.readouterr()
    jax.block_until_ready(run())
    jax.effects_barrier()
    return capfd.readouterr().out.splitlines()


@pytest.mark.parametrize("name", sorted(_PRINTING))
def test_prints_in_loop_bodies_run_in_jax_order_once(capfd, name):
    """A compiled step prints what jax.jit(jax.value_and_grad(fn)) prints, in its order: in the
    forward pass only. A remat (a policy, the program's own checkpoints, a budget) replays
    nothing (JAX's jax.checkpoint would print again in its backward)."""
    fn, x = _PRINTING[name], jnp.float32(0.5)
    want = _printed(capfd, lambda: jax.jit(jax.value_and_grad(fn))(x))
    assert len(want) >= 2
    gb = jg.backward(jg.trace(fn, x, param_argnums=0))
    assert _printed(capfd, lambda: jg.compile(gb)(x)) == want
    saving_nothing = jg.remat(gb, policy=jg.policies.nothing_saveable)
    assert _printed(capfd, lambda: jg.compile(saving_nothing)(x)) == want
    checkpointed = functools.partial(fn, checkpointed=True)
    own = jg.remat(jg.backward(jg.trace(checkpointed, x, param_argnums=0)))
    assert _printed(capfd, lambda: jg.compile(own)(x)) == want
    if name == "scan":
        replayed = _printed(capfd, lambda: jax.jit(jax.value_and_grad(checkpointed))(x))
        assert len(replayed) > len(want)  # JAX's remat prints again; jgraph's does not
        assert _printed(capfd, lambda: jg.evaluate(gb, x)) == want


def test_a_budget_plan_recomputing_a_scan_body_prints_once(capfd):
    """The planner's plan for a scanned model recomputes inside the loop body; the body's print
    runs once per layer, in the forward, as in jax.jit(jax.value_and_grad(fn))."""
    def fn(w, x):
        def body(h, i):
            jax.debug.print("layer {i}", i=i, ordered=True)
            return jnp.tanh(jnp.tanh(h @ w[i]) @ w[i].T), None

        h, _ = lax.scan(body, x, jnp.arange(6))
        jax.debug.print("done", ordered=True)
        return jnp.sum(h * h)

    w = jax.random.normal(jax.random.PRNGKey(0), (6, 32, 32)) / 6
    x = jnp.ones((64, 32))
    want = _printed(capfd, lambda: jax.jit(jax.value_and_grad(fn))(w, x))
    assert want == [f"layer {i}" for i in range(6)] + ["done"]
    gr = jg.remat(jg.backward(jg.trace(fn, w, x, param_argnums=0)), budget="60%")
    report = gr.info["remat"]
    assert report["plan"] != "no remat" and report["xla_temp"] <= report["budget"]
    assert _printed(capfd, lambda: jg.compile(gr)(w, x)) == want


def test_a_print_is_an_op_no_pass_drops_or_merges():
    def fn(x):
        jax.debug.print("x {x}", x=x)
        jax.debug.print("x {x}", x=x)  # the same print twice: printed twice
        lax.scan(lambda c, _: (jax.debug.print("unused {c}", c=c) or c, None), x, None, length=1)
        return jnp.sin(x)

    gb = jg.backward(jg.trace(fn, jnp.float32(1.0), param_argnums=0))
    assert sum(e.op == "debug_print" for e in gb.eqns) == 2
    assert any(e.op == "scan" for e in gb.eqns)  # its result is unused, but it prints
    assert str(jg.passes.cse(gb)) == str(gb) and str(jg.passes.dce(gb)) == str(gb)


# -- issue 29: CustomVJPTest programs jgraph still refused -----------------------------------------
def _float0_in_a_scan(x, y):
    """JAX's test_float0_initial_style: a custom_vjp of a (float, int) pair, in a scan, whose bwd
    returns a Python float for the float and a float0 zero for the int."""
    @jax.custom_vjp
    def f(c):
        return c

    f.defvjp(lambda c: (c, (2.0, c)),
             lambda *_: ((2.0, jnp.zeros((), jax.dtypes.float0)),))
    out, _ = lax.scan(lambda c, _: (f(c), None), (x, y), None, length=1)
    return out[0]


def test_a_bwd_returning_a_python_float_and_a_float0_zero(jax_flags):
    """The backward took the Python float for an array (AttributeError: 'float' object has no
    attribute 'dtype'); JAX accepts it for a scalar input."""
    x, y = 2.0, 3
    want = jax.grad(_float0_in_a_scan, argnums=(0, 1), allow_int=True)(x, y)
    got = jg.grad(_float0_in_a_scan, argnums=(0, 1), allow_int=True)(x, y)
    _close(got[0], want[0])
    assert got[1].dtype == want[1].dtype == jax.dtypes.float0 and got[1].shape == ()
    _close(_step(_float0_in_a_scan, x, y)(x, y),
           jax.jit(jax.value_and_grad(_float0_in_a_scan))(x, y))


def _vmapped_scan_closing_over(y):
    """JAX's test_initial_style_vmap_3: a custom_vjp closing over `y`, in a scan, under vmap
    (which makes `y` an input of the custom_vjp JAX binds again)."""
    @jax.custom_vjp
    def f(x):
        assert jnp.ndim(x) == 0
        return 3 * x * jnp.sum(y)

    f.defvjp(lambda x: (f(x), jnp.cos(x)), lambda cos_x, g: (2 * cos_x * g,))
    return jax.vmap(lambda x: lax.scan(lambda c, _: (f(c), None), x, None, length=1)[0])


def test_vmap_of_a_scanned_custom_vjp_closing_over_a_constant(jax_flags):
    """A raw `CustomVJPException` escaped jg.trace: jgraph asked the custom_vjp's fwd for a
    tangent of the closed-over constant, which JAX asks for only if something perturbs it."""
    y = jnp.arange(1.0, 4.0)

    def loss(x):
        return _vmapped_scan_closing_over(y)(x).sum()

    x = jnp.arange(3.0)
    want = jax.jit(jax.value_and_grad(loss))(x)
    _close(want[1], 2 * jnp.cos(x))  # what JAX's own test asserts
    _close(jg.value_and_grad(loss)(x), want)
    _close(_step(loss, x)(x), want)
    _close(jax.grad(jg.to_jax(jg.trace(loss, x, param_argnums=0)))(x), want[1])


def test_differentiating_a_value_closed_over_under_vmap_names_the_line(jax_flags):
    """A param the closed-over value depends on: JAX refuses (a `CustomVJPException`; with its
    next custom_vjp, an escaped tracer), and so does jgraph, naming the user's line. Where nothing
    differentiates it, both take the gradient (default flags: JAX's next custom_vjp refuses the
    traced closure under jit, as jg.trace does)."""
    def loss(w, x):
        return _vmapped_scan_closing_over(w * 2)(x).sum()

    w, x = jnp.arange(1.0, 4.0), jnp.arange(3.0)
    with pytest.raises(Exception, match="closed-over value|closed over"):
        jax.grad(loss)(w, x)
    with pytest.raises((jg.TransformError, jg.TraceError), match=r"test_jax_next\.py:\d+"):
        jg.grad(loss)(w, x)
    if not jax.config.jax_custom_vjp3:
        _close(jg.grad(loss, argnums=1)(w, x), jax.jit(jax.grad(loss, argnums=1))(w, x))
