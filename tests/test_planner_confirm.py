"""`jg.remat(budget=)` on CPU plans on the calibrated model (`jgraph.memory.model`) and compiles
only the plan it returns, to confirm it; a miss corrects the model (`jgraph.planner.search
._confirmed`). On TPU the same loop is checked in `tests/test_tpu.py`."""

import dataclasses
import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgraph as jg
from jgraph.memory import compiled as compiled_module

F32 = jnp.float32
search = importlib.import_module("jgraph.planner.search")


def block(p, x):
    return x + jnp.tanh(jax.nn.gelu(x @ p["up"]) @ p["down"])


def loss(ps, x):
    for p in ps:
        x = block(p, x)
    return jnp.mean(x**2)


@pytest.fixture(scope="module")
def gb():
    rng = np.random.default_rng(3)
    ps = [{"up": jnp.asarray(rng.standard_normal((128, 512)) / 12, F32),
           "down": jnp.asarray(rng.standard_normal((512, 128)) / 22, F32)} for _ in range(8)]
    x = jnp.asarray(rng.standard_normal((256, 128)), F32)
    return jg.backward(jg.trace(loss, ps, x, param_argnums=0))


def _counting(monkeypatch):
    compiles = []
    measured = compiled_module._measured
    monkeypatch.setattr(compiled_module, "_measured",
                        lambda *a: compiles.append(a) or measured(*a))
    monkeypatch.setattr(compiled_module, "_CACHE", {})
    return compiles


@pytest.mark.parametrize("budget", ["60%", "35%"])
def test_a_plan_is_made_on_the_model_and_confirmed_by_one_compile(gb, budget, monkeypatch):
    compiles = _counting(monkeypatch)
    lowered = []
    lower = compiled_module._lowered

    def recorded(*args):
        made = lower(*args)
        lowered.append(made[1].as_text())
        return made

    monkeypatch.setattr(compiled_module, "_lowered", recorded)
    monkeypatch.setattr(compiled_module, "_LOWERED", compiled_module.collections.OrderedDict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", jg.BudgetWarning)
        plan = jg.remat(gb, budget=budget)
    info = plan.info["remat"]
    assert info["confirmed"] == "compiled" and info["plan"] != "no remat"
    # the unplanned step's compile (the percentage and the calibration) and the plan's
    assert len(compiles) == 2
    assert len(lowered) == len(set(lowered)) == 2  # each program lowered once (0.3 s a time)
    assert info["xla_temp"] <= info["budget"]
    assert jg.compiled_memory(plan).temp_bytes == info["xla_temp"]
    assert info["model_temp"] <= info["budget"]  # the model's own figure of it


def test_a_model_that_misses_is_corrected_by_its_confirming_compile(gb, monkeypatch):
    """A model predicting 30 % too little: its first plan misses the budget when compiled; the
    miss corrects the model's scale and the plan returned fits."""
    real = search.calibration

    def optimistic(unplanned, target):
        fitted = real(unplanned, target)
        return dataclasses.replace(fitted, figure=int(fitted.figure * 0.7))

    monkeypatch.setattr(search, "calibration", optimistic)
    compiled = []
    figures = search.validate.xla_figures
    monkeypatch.setattr(search.validate, "xla_figures",
                        lambda graph: compiled.append(graph) or figures(graph))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jg.BudgetWarning)
        plan = jg.remat(gb, budget="45%")
    info = plan.info["remat"]
    assert len(compiled) >= 2  # the first plan missed: the model was corrected, then confirmed
    assert info["xla_temp"] <= info["budget"]
    assert jg.compiled_memory(plan).temp_bytes <= info["budget"]


def test_the_corrected_model_predicts_the_plan_it_missed_exactly(gb):
    from jgraph.memory.model import calibration
    from jgraph.target import resolve

    fitted = calibration(jg.remat(gb).info["unplanned"], resolve("cpu"))
    plan = jg.remat(gb, policy=jg.policies.nothing_saveable)
    predicted = fitted.predict(plan)
    actual = jg.compiled_memory(plan).temp_bytes
    corrected = fitted.corrected(predicted, actual)
    assert abs(corrected.predict(plan) - actual) <= 0.001 * actual


def test_a_byte_budget_far_below_every_plan_compiles_only_the_models_least(gb, count_compiles):
    """No plan meets the model far below its least (`NEAR_MISS`): the error names the least
    plan's compiled figure after one compile of it, not after compiling every candidate; that
    figure is reachable (a plan meets it as a byte budget)."""
    compiles = count_compiles()
    with pytest.raises(jg.TransformError, match="no plan fits") as error:
        jg.remat(gb, budget=4096, chunks=None)
    assert len(compiles) == 2  # the unplanned step's and the least plan's
    least = error.value.least_temp
    assert f"the smallest compiled temp a plan reaches is {least} bytes, with the plan" in str(
        error.value)
    gr = jg.remat(gb, budget=least, chunks=None)
    assert jg.compiled_memory(gr).temp_bytes <= least
