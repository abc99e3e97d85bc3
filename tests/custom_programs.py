"""JAX's own custom-derivative programs (CustomJVPTest / CustomVJPTest in jax-ml/jax's
tests/custom_api_test.py), ported as scalar functions whose higher derivatives depend on the
user's rule: each rule differs from its primal body's derivative, so losing the rule at any order
changes the answer.

`Program.reference()` is the JAX function jgraph's answers are compared with: the program itself,
except for a custom_jvp inside `lax.scan`. There JAX 0.10.2 itself drops the rule when it
differentiates the scan twice (a linearized scan recomputes its primal values with the custom
function's body, so the next derivative is the body's), unlike the same program unrolled and unlike
JAX's documented rule ("each differentiation uses the custom JVP rule iff the rule calls f for the
primal"). Where jgraph differentiates (its backward, at any order; JAX once on top of it), the
reference is the unrolled program; where JAX differentiates a compiled scan twice, jgraph's answer
is JAX's own (`Program.make`). `jvp_errors`: JAX refuses forward mode over its gradient (a fwd
calling a custom_vjp function), and so must jgraph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax


@dataclass(frozen=True)
class Program:
    name: str
    make: Callable[[], Callable]  # () -> fn(x: f32[]) -> f32[]
    make_reference: Callable[[], Callable] | None = None  # the JAX program to compare with
    jvp_errors: bool = False  # JAX refuses jax.jvp(jax.grad(fn))

    def reference(self):
        return (self.make_reference or self.make)()


def _sin_rule_2cos(explicit_primal=False):
    """test_basic: sin with the JVP 2 cos (the primal from f itself, or written out)."""
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (jnp.sin(p[0]) if explicit_primal else f(p[0]),
                           2 * jnp.cos(p[0]) * t[0]))
    return f


def _twice(f):
    return lambda x: f(f(x))


def _scanned(f, length=3):
    return lambda x: lax.scan(lambda c, _: (f(c), None), x, None, length=length)[0]


def _unrolled(f, length=3):
    def fn(x):
        for _ in range(length):
            x = f(x)
        return x

    return fn


def _expit():  # test_eval_shape: the rule's tangent calls the function itself
    @jax.custom_jvp
    def expit(x):
        return 1 / (1 + lax.exp(-x))

    @expit.defjvp
    def _(p, t):
        ans = expit(p[0])
        return ans, t[0] * ans * (1 - ans) * 1.5

    return lambda x: expit(jnp.sin(x) * expit(x))


def _two_args():  # test_pytrees-like: two inputs, a rule unlike the body in each
    @jax.custom_jvp
    def f(x, y):
        return x * jnp.sin(y)

    f.defjvp(lambda p, t: (f(*p), 2 * jnp.sin(p[1]) * t[0] + 3 * p[0] * jnp.cos(p[1]) * t[1]))
    return lambda x: f(jnp.cos(x), x * x)


def _closure():  # test_initial_style_vmap_2: the primal closes over an array constant
    y = jnp.arange(1.0, 4.0)

    @jax.custom_jvp
    def f(x):
        return jnp.sum(jnp.sin(x * y))

    f.defjvp(lambda p, t: (f(p[0]), 2 * jnp.sum(jnp.cos(p[0] * y) * y) * t[0]))
    return lambda x: f(x) * f(x * 0.5)


def _relu_scan():  # test_hard_stuff3
    @jax.custom_jvp
    def relu(x):
        return jnp.maximum(x, 0)

    relu.defjvp(lambda p, t: (relu(p[0]), lax.select(p[0] > 0, t[0], lax.full_like(t[0], 0))))

    def body(c, _):
        return [relu(c[0]) * c[0]] + [c[i - 1] + jnp.sin(c[i]) for i in range(1, len(c))], None

    def fn(x):
        z = jnp.zeros_like(x)
        return lax.scan(body, [x, z, z], None, length=4)[0][-1]

    return fn


def _library():  # custom_jvps of jax.nn: relu, softplus (logaddexp), gelu, logsumexp
    return lambda x: (jax.nn.softplus(x) * jax.nn.gelu(x) + jax.nn.relu(x) ** 2
                      + jax.nn.logsumexp(jnp.stack([x, 2 * x])))


def _vjp_sin(fwd_calls_f):
    """test_basic: sin with fwd (sin, cos) and bwd 2 cos g; fwd may call f itself."""
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (f(x) if fwd_calls_f else jnp.sin(x), jnp.cos(x)),
             lambda c, g: (2 * c * g,))
    return f


def _vjp_scan():  # test_initial_style
    f = _vjp_sin(False)
    return lambda x: lax.scan(lambda c, _: (f(c) * c, None), x, None, length=2)[0]


def _bwd_nones():  # test_bwd_nones
    @jax.custom_vjp
    def f(x, y):
        return x * jnp.sin(y)

    f.defvjp(lambda x, y: (f(x, y), jnp.cos(y)), lambda cos, g: (None, 2 * cos * g))
    return lambda x: f(x, x) * x


def _clip_gradient():  # test_clip_gradient: residuals depend on x
    @jax.custom_vjp
    def clip(lo, hi, x):
        return x

    clip.defvjp(lambda lo, hi, x: (x, (lo, hi)),
                lambda res, g: (None, None, jnp.clip(g, res[0], res[1]) * res[1]))
    return lambda x: jnp.sin(clip(-0.1, x * x + 0.1, x)) * x


def _custom_gradient():  # test_custom_gradient
    @jax.custom_gradient
    def f(x):
        return x ** 2, lambda g: (g * x * jnp.cos(x),)

    return lambda x: f(jnp.sin(x))


def _nestable():  # test_nestable_vjp: fwd returns a vjp function as its residual
    def h(x):
        return x ** 3

    @jax.custom_vjp
    def g(x):
        return h(x)

    def g_fwd(x):
        y, h_vjp = jax.vjp(h, x)
        return y, h_vjp

    g.defvjp(g_fwd, lambda h_vjp, y_bar: h_vjp(2 * y_bar))
    return lambda x: g(jnp.sin(x))


def _vjp_pytrees():  # test_pytrees
    @jax.custom_vjp
    def f(x):
        return {"b": jnp.sin(x["a"])}

    f.defvjp(lambda x: (f(x), {"r": jnp.cos(x["a"])}),
             lambda res, g: ({"a": 2 * res["r"] * g["b"]},))
    return lambda x: f({"a": x * x})["b"]


PROGRAMS = [
    Program("jvp_basic", lambda: _twice(_sin_rule_2cos())),
    Program("jvp_checkpoint", lambda: jax.checkpoint(_twice(_sin_rule_2cos()))),
    Program("jvp_explicit_primal", lambda: _twice(_sin_rule_2cos(explicit_primal=True))),
    Program("jvp_scan", lambda: _scanned(_sin_rule_2cos()),
            make_reference=lambda: _unrolled(_sin_rule_2cos())),
    Program("jvp_expit", _expit),
    Program("jvp_two_args", _two_args),
    Program("jvp_closure", _closure),
    Program("jvp_relu_scan", _relu_scan),
    Program("jvp_library", _library),
    Program("vjp_basic", lambda: _twice(_vjp_sin(True)), jvp_errors=True),
    Program("vjp_own_fwd", lambda: _twice(_vjp_sin(False))),
    Program("vjp_checkpoint", lambda: jax.checkpoint(_twice(_vjp_sin(True))), jvp_errors=True),
    Program("vjp_scan", _vjp_scan),
    Program("vjp_bwd_nones", _bwd_nones, jvp_errors=True),
    Program("vjp_clip_gradient", _clip_gradient),
    Program("vjp_custom_gradient", _custom_gradient),
    Program("vjp_nestable", _nestable),
    Program("vjp_pytrees", _vjp_pytrees, jvp_errors=True),
]
BY_NAME = {p.name: p for p in PROGRAMS}
