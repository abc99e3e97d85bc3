"""Regression tests for what the issue 19 sweep found (tests/test_sweep_issue19.py has the probes).

Each was a raw error or a silent acceptance before: numpy/JAX scalar remat budgets refused as
"not a number" and `10**400` an OverflowError; `MemoryReport.plot(labels=3)` a TypeError and an
unwritable plot path an OSError; `jg.to_dot` of a malformed graph an AttributeError; `jg.check`
accepting two loss outputs and a region policy that is not callable; `Optimizer.grad_acc` of a
state of another period answering None; class-id labels of another batch a broadcasting
TypeError; a checkpoint or state path too long for the file system an OSError.
"""

import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jgraph as jg
from jgraph.ir import Region
from jgraph.planner.validate import parse_budget
from jgraph.training import ArgumentError

X = jnp.linspace(0.5, 1.0, 3)


def traced():
    return jg.trace(lambda p, x: jnp.sum(jnp.tanh(x * p) * x), X, X, param_argnums=0)


@pytest.mark.parametrize("budget, want", [(np.int64(2**30), 2**30), (np.float32(1e6), 1e6),
                                          (jnp.asarray(4096), 4096), (np.uint8(7), 7)])
def test_numpy_and_jax_scalar_budgets_are_bytes(budget, want):
    assert parse_budget(budget) == ("bytes", want)


@pytest.mark.parametrize("budget", [10**400, np.bool_(True), jnp.ones(2), jnp.asarray(True)])
def test_other_budgets_are_named(budget):
    with pytest.raises(jg.TransformError, match="finite, non-negative number of bytes"):
        parse_budget(budget)


def test_plot_labels_and_unwritable_paths(tmp_path):
    report = jg.memory(jg.backward(traced()))
    with pytest.raises(jg.JGraphError, match="one label per report"):
        report.plot(tmp_path / "m.png", labels=3)
    with pytest.raises(jg.JGraphError, match="cannot write .*too long"):
        report.plot(tmp_path / ("m" * 300 + ".png"))
    assert not os.listdir(tmp_path)


def test_to_dot_names_malformed_fields():
    g = traced()
    with pytest.raises(jg.GraphError, match=r"`outputs\[0\]` must be a Var or Literal"):
        jg.to_dot(g.replace(outputs=(3,)))


def test_check_refuses_two_losses_and_non_callable_policies():
    g = traced()
    with pytest.raises(jg.GraphError, match="2 outputs have role 'loss'"):
        jg.check(g.replace(outputs=g.outputs * 2, output_roles=("loss", "loss"), out_tree=None))
    import dataclasses

    eqns = (dataclasses.replace(g.eqns[0], regions=(0,)),) + g.eqns[1:]
    bad = g.replace(eqns=eqns, regions=(Region(0, None, "dots_saveable"),))
    with pytest.raises(jg.GraphError, match="policy 'dots_saveable'.*callable"):
        jg.check(bad)
    jg.check(g.replace(eqns=eqns, regions=(Region(0, None, jg.policies.dots_saveable),)))


def _model(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


P0 = {"w": np.full((5, 6), 0.1, np.float32), "v": np.full((6, 3), 0.2, np.float32)}
XS = np.linspace(-1, 1, 40, dtype=np.float32).reshape(8, 5)
YS = np.array([0, 1, 2, 0, 1, 2, 0, 1], np.int32)


def test_grad_acc_of_another_periods_state_and_labels_of_another_batch():
    one = jg.Optimizer(_model, optax.sgd(0.1), loss="cross_entropy")
    state = one.init(P0, XS, YS)
    two = jg.Optimizer(_model, optax.sgd(0.1), loss="cross_entropy", period=2)
    two.init(P0, XS, YS)
    with pytest.raises(ArgumentError, match="state of a different Optimizer"):
        two.grad_acc(state)
    with pytest.raises(jg.JGraphError, match=r"class-id labels \(4,\) do not match model "
                                             r"outputs \(8, 3\)"):
        jg.Optimizer(_model, optax.sgd(0.1), loss="cross_entropy").init(P0, XS, YS[:4])


def test_too_long_paths_are_argument_errors(tmp_path):
    opt = jg.Optimizer(_model, optax.sgd(0.1), loss="cross_entropy")
    state = opt.init(P0, XS, YS)
    long = tmp_path / ("s" * 300)
    with pytest.raises(ArgumentError, match="too long"):
        opt.save(state, long)
    with pytest.raises(ArgumentError, match="checkpoint_path .* too long"):
        jg.fit(_model, P0, jg.Dataset(XS, YS), loss="cross_entropy", tx=optax.sgd(0.1),
               batch_size=8, progress=False, checkpoint_path=long)
