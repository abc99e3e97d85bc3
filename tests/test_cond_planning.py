"""Conds under a memory plan: branches share their residual slots (one branch runs), and the
planner's "cond branches planned ..." modes plan each branch like straight-line code
(`cond[plan_fraction=f]`, `jgraph.planner.loops.planned_branch`).

Gradients against `jax.value_and_grad` and float64 finite differences; slots on the graph;
memory on XLA's compiled donated step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jgraph as jg
from jgraph.planner.search import problems, xla_temp

RNG = np.random.default_rng(5)


def layers(ws, h):
    for w in ws:
        h = jnp.tanh(h @ w)
    return h


def two_stacks(ws, x):
    """The same layers in both branches (one negated): their residuals have the same shapes."""
    h = lax.cond(jnp.sum(x) > 0, layers, lambda ws, h: -layers(ws, h), ws, x)
    return jnp.mean(h ** 2)


def different_branches(ws, x):
    """Branches of different residuals: a sin stack, a matrix product, a passthrough."""
    branches = [lambda ws, h: jnp.sin(layers(ws, h)), lambda ws, h: h @ ws[0] @ ws[1],
                lambda ws, h: h * 2.0]
    return jnp.sum(lax.switch(jnp.argmax(jnp.sum(x, 0)) % 3, branches, ws, x) ** 2)


def args(n=6, width=8, batch=4):
    ws = [(RNG.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
          for _ in range(n)]
    return ws, RNG.standard_normal((batch, width)).astype(np.float32)


def marked(graph, fraction):
    return graph.replace(eqns=tuple(
        dataclasses.replace(e, params={**e.params, "plan_fraction": fraction})
        if e.op == "cond" else e for e in graph.eqns))


def forward_cond(graph):
    return next(e for e in graph.eqns if e.op == "cond" and "backward" not in e.tags)


@pytest.mark.parametrize("fraction", [None, 0.5, 0.0])
@pytest.mark.parametrize("fn", [two_stacks, different_branches], ids=lambda f: f.__name__)
@pytest.mark.parametrize("sign", [1.0, -1.0])  # each branch taken
def test_gradients_equal_value_and_grad(fn, fraction, sign):
    ws, x = args()
    x = x * sign + (0.5 if fn is different_branches and sign < 0 else 0.0)
    g = jg.trace(fn, ws, x, param_argnums=0)
    gb = jg.check(jg.backward(g if fraction is None else marked(g, fraction)))
    value, grads = jg.compile(gb)(ws, x)
    want_value, want = jax.jit(jax.value_and_grad(fn))(ws, x)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for got, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=1e-6)
    for got, w in zip(jg.evaluate(gb, ws, x)[1], want, strict=True):
        np.testing.assert_allclose(got, w, rtol=2e-5, atol=1e-6)
    plain = jg.backward(g)  # the plan recomputes the same ops on the same values
    for got, w in zip(jg.evaluate(gb, ws, x)[1], jg.evaluate(plain, ws, x)[1], strict=True):
        np.testing.assert_array_equal(got, w)


@pytest.mark.f64
def test_planned_branches_match_finite_differences():
    ws, x = args()
    ws, x = [w.astype(np.float64) for w in ws], x.astype(np.float64)
    gb = jg.backward(marked(jg.trace(two_stacks, ws, x, param_argnums=0), 0.0))
    grads = jg.compile(gb)(ws, x)[1]
    eps, rng = 1e-6, np.random.default_rng(1)
    for _ in range(3):
        d = [rng.standard_normal(w.shape) for w in ws]
        plus = two_stacks([w + eps * e for w, e in zip(ws, d, strict=True)], x)
        minus = two_stacks([w - eps * e for w, e in zip(ws, d, strict=True)], x)
        directional = sum(np.sum(g * e) for g, e in zip(grads, d, strict=True))
        np.testing.assert_allclose(directional, (plus - minus) / (2 * eps), rtol=1e-6)


def test_branches_share_slots_of_the_same_shapes():
    ws, x = args()
    cond = forward_cond(jg.backward(jg.trace(two_stacks, ws, x, param_argnums=0)))
    slots = cond.outputs[1:]
    # one branch's residuals (its tanh outputs and its input), not both branches'
    per_branch = 6 + 1
    assert len(slots) <= per_branch + 1


def test_a_planned_branch_returns_fewer_residuals():
    ws, x = args(n=12)
    g = jg.trace(two_stacks, ws, x, param_argnums=0)
    plain = forward_cond(jg.backward(g))
    planned = forward_cond(jg.backward(marked(g, 0.0)))
    assert len(planned.outputs) < len(plain.outputs)


def test_the_planner_plans_a_cond_heavy_step_below_what_loop_policies_reach():
    """12 layers of 512 inside a cond (batch 512): slot sharing halves no remat's temp against
    JAX's; planning the branches reaches below what the loop-body policies reach."""
    ws, x = args(n=12, width=256, batch=512)
    gb = jg.backward(jg.trace(two_stacks, ws, x, param_argnums=0))
    theirs = jax.jit(jax.value_and_grad(two_stacks), donate_argnums=0).lower(
        ws, x).compile().memory_analysis().temp_size_in_bytes
    ours = xla_temp(gb)
    assert ours < 0.7 * theirs, (ours, theirs)
    by_mode = problems(gb)
    policies = min(xla_temp(by_mode[m].graph) for m in (
        "loop bodies keep their inputs", "loop bodies keep contractions"))
    budget = int(0.95 * policies)
    gr = jg.remat(gb, budget=budget)
    report = gr.info["remat"]
    assert report["plan"].startswith("cond branches planned")
    assert report["xla_temp"] <= budget
    for got, want in zip(jg.compile(gr)(ws, x)[1], jg.compile(gb)(ws, x)[1], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_a_planned_branch_replaces_the_branchs_own_checkpoints():
    """A branch with `jax.checkpoint` inside: the plan replaces its regions (as the planner
    replaces the step's), and gradients stay those of no remat."""
    def checkpointed(ws, x):
        h = lax.cond(jnp.sum(x) > 0, jax.checkpoint(layers), lambda ws, h: h, ws, x)
        return jnp.mean(h ** 2)

    ws, x = args()
    x = np.abs(x)
    gb = jg.check(jg.backward(marked(jg.trace(checkpointed, ws, x, param_argnums=0), 0.0)))
    for got, want in zip(jg.compile(gb)(ws, x)[1], jax.grad(checkpointed)(ws, x), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
