"""The plan cache (`jgraph.planner.cache`): a graph planned again under the same budget on the same
kind of target is not planned again, in the process and, with a directory named, in a new one."""

import importlib
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg
from jgraph import config
from jgraph.planner import cache as plans

remat_module = importlib.import_module("jgraph.remat")


def _model(scale=1.0):
    """(loss, params, x): a 6-layer tanh MLP whose activations dominate its step."""
    k = jax.random.split(jax.random.PRNGKey(4), 8)
    params = [jax.random.normal(k[i], (64, 64)) / 8 for i in range(6)]
    x = jax.random.normal(k[7], (512, 64))

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w) * scale
        return jnp.mean(x**2)

    return loss, params, x


def _joint(scale=1.0):
    loss, params, x = _model(scale)
    return jg.backward(jg.trace(loss, params, x, param_argnums=0)), loss, params, x


def _assert_runs_as_jax(plan, loss, params, x):
    got = jg.compile(plan)(params, x)
    want = jax.value_and_grad(loss)(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_graph_traced_again_is_not_planned_again(count_compiles):
    gb, loss, params, x = _joint()
    first = jg.remat(gb, budget="75%")
    assert "cached" not in first.info["remat"]
    compiles = count_compiles()
    again_gb = _joint()[0]  # traced anew: other objects, the same graph
    again = jg.remat(again_gb, budget="75%")
    assert compiles == [], "planned again"
    assert again.info["remat"]["cached"] == "process"
    assert again.info["remat"]["plan"] == first.info["remat"]["plan"]
    assert str(again) == str(first)
    assert again.info["unplanned"].inputs == jg.remat(again_gb).info["unplanned"].inputs
    _assert_runs_as_jax(again, loss, params, x)


def test_another_budget_target_or_graph_is_planned_anew():
    gb = _joint()[0]
    cpu = jax.devices("cpu")[0]
    key = plans.key(gb, None, "75%", "auto", 8, jg.target.resolve(cpu))
    assert key == plans.key(_joint()[0], None, "75%", "auto", 8, jg.target.resolve(cpu))
    others = [plans.key(gb, None, "40%", "auto", 8, jg.target.resolve(cpu)),
              plans.key(gb, None, "75%", "fast", 8, jg.target.resolve(cpu)),
              plans.key(gb, None, "75%", "auto", None, jg.target.resolve(cpu)),
              plans.key(_joint(scale=0.5)[0], None, "75%", "auto", 8, jg.target.resolve(cpu)),
              plans.key(gb, gb, "75%", "auto", 8, jg.target.resolve(cpu))]
    assert len({key, *others}) == 1 + len(others)
    jg.remat(gb, budget="75%")
    assert jg.remat(_joint(scale=0.5)[0], budget="75%").info["remat"].get("cached") is None


def test_a_graph_holding_an_object_by_identity_is_not_kept():
    """Two graphs holding different Python objects of one name print alike but for the address:
    such a graph's plan is not kept (nor one holding an array numpy prints in part)."""
    gb = _joint()[0]
    eqn = gb.eqns[0]
    odd = gb.replace(eqns=(eqn.__class__(eqn.op, eqn.inputs, {**eqn.params, "how": object()},
                                         eqn.outputs, eqn.tags, eqn.regions, eqn.source),)
                     + gb.eqns[1:])
    target = jg.target.resolve(jax.devices("cpu")[0])
    assert plans.key(odd, None, "75%", "auto", 8, target) is None
    assert plans.key(gb, None, "75%", "auto", 8, target) is not None


def test_a_plan_that_met_no_percentage_warns_again():
    gb = _joint()[0]
    with pytest.warns(jg.BudgetWarning) as first:
        least = jg.remat(gb, budget="1%")
    with pytest.warns(jg.BudgetWarning) as again:
        kept = jg.remat(_joint()[0], budget="1%")
    assert kept.info["remat"]["cached"] == "process"
    assert str(again[0].message) == str(first[0].message)
    assert again[0].filename == __file__  # at the caller's line, as the first
    assert kept.info["remat"]["plan"] == least.info["remat"]["plan"]


def test_a_byte_budget_no_plan_reaches_raises_each_time():
    gb = _joint()[0]
    for _ in range(2):
        with pytest.raises(jg.errors.TransformError, match="no plan"):
            jg.remat(gb, budget=64)


def test_plans_are_kept_on_disk_when_a_directory_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "plan_cache_dir", str(tmp_path))
    gb, loss, params, x = _joint()
    first = jg.remat(gb, budget="75%")
    assert len(list((tmp_path / "plans").glob("*.pickle"))) == 1
    plans.clear()  # a new process: read back from disk, not planned

    def not_planned(*a, **k):
        raise AssertionError("planned again")

    monkeypatch.setattr(remat_module, "_planned", not_planned)
    again = jg.remat(_joint()[0], budget="75%")
    assert again.info["remat"]["cached"] == "disk"
    assert str(again) == str(first)
    _assert_runs_as_jax(again, loss, params, x)
    (path,) = (tmp_path / "plans").glob("*.pickle")
    path.write_bytes(b"not a pickle")  # damaged: planned again
    plans.clear()
    with pytest.raises(AssertionError, match="planned again"):
        jg.remat(_joint()[0], budget="75%")


def test_the_figure_cache_directory_keeps_plans_too(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "figure_cache_dir", str(tmp_path))
    monkeypatch.setattr(config, "plan_cache_dir", None)
    jg.remat(_joint()[0], budget="75%")
    assert len(list((tmp_path / "plans").glob("*.pickle"))) == 1


_RESTARTED = textwrap.dedent("""
    import importlib, sys
    sys.path.insert(0, {tests!r})
    import jgraph as jg
    from test_plan_cache import _model
    compiled = importlib.import_module("jgraph.memory.compiled")
    made, measured = [], compiled._measured
    compiled._measured = lambda *a: made.append(1) or measured(*a)
    loss, params, x = _model()
    step = jg.jit(lambda ps, x: jg.value_and_grad(loss)(ps, x), budget="75%")
    report = step.info(params, x)["remat"]
    print(report.get("cached"), len(made), report["plan"])
""")


def test_a_restarted_job_plans_in_no_time(tmp_path):
    """Two processes run the same `jg.jit(budget=)` step with `JGRAPH_PLAN_CACHE` set: the first
    plans (compiling the unplanned step and the plan), the second compiles nothing to plan."""
    env = {**os.environ, "JGRAPH_PLAN_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    env.pop("JGRAPH_FIGURE_CACHE", None)
    code = _RESTARTED.format(tests=os.path.dirname(__file__))
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(done.stdout.strip().splitlines()[-1].split(" ", 2))
    (cached1, made1, plan1), (cached2, made2, plan2) = runs
    assert cached1 == "None" and int(made1) >= 2, runs
    assert cached2 == "disk" and int(made2) == 0 and plan2 == plan1, runs


def test_a_fresh_jg_jit_step_of_the_same_function_is_not_planned_again(count_compiles):
    loss, params, x = _model()
    tx = optax.adam(1e-3)

    def train_step(ps, state, x):
        value, grads = jg.value_and_grad(loss)(ps, x)
        updates, state = tx.update(grads, state, ps)
        return optax.apply_updates(ps, updates), state, value

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jg.BudgetWarning)
        first = jg.jit(train_step, budget="75%", donate_argnums=(0, 1))
        report = first.info(params, tx.init(params), x)["remat"]
        compiles = count_compiles()
        again = jg.jit(train_step, budget="75%", donate_argnums=(0, 1))
        kept = again.info(params, tx.init(params), x)["remat"]
    assert compiles == [] and kept["cached"] == "process" and kept["plan"] == report["plan"]
