"""`target=`: the chip a graph is compiled for, measured on and planned for (`jgraph.target`), on
this host's CPU. The TPU figures, compiled ahead of time, are `tests/test_tpu.py`'s."""

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

import jgraph as jg
from jgraph.memory.compiled import CompiledMemory
from jgraph.target import Target, TargetError, resolve

F32 = jnp.float32
CPU = jax.devices("cpu")[0]


def chain(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


WS = [jnp.linspace(-0.1, 0.1, 64 * 64, dtype=F32).reshape(64, 64) * (k + 1) for k in range(4)]
X = jnp.linspace(-1, 1, 256 * 64, dtype=F32).reshape(256, 64)
GB = jg.backward(jg.trace(chain, WS, X, param_argnums=0))


@pytest.mark.parametrize("given", [None, CPU, "cpu", "CPU", SingleDeviceSharding(CPU),
                                   Mesh(np.array([CPU]), ("data",)),
                                   NamedSharding(Mesh(np.array([CPU]), ("batch",)),
                                                 PartitionSpec())])
def test_every_form_of_a_cpu_target_names_this_host(given):
    target = resolve(given)
    assert target.platform == "cpu" and target.devices[0] == CPU
    assert target.figure == "temp_size_in_bytes" and resolve(target) is target
    if isinstance(given, (Mesh, NamedSharding)):
        assert target.data_axis == ("data" if isinstance(given, Mesh) else "batch")


@pytest.mark.parametrize("given, says", [
    ("tpuu", "a platform name is one of"),
    (3, "give a jax.Device"),
    (object(), "give a jax.Device"),
])
def test_a_bad_target_is_a_clear_error(given, says):
    with pytest.raises(TargetError, match=says):
        resolve(given)
    with pytest.raises(TargetError, match=says):
        jg.compiled_memory(GB, target=given)
    with pytest.raises(TargetError, match=says):
        jg.remat(GB, target=given)


@pytest.mark.skipif(bool(jax.devices()[0].platform == "tpu"), reason="this host has a TPU")
def test_a_platform_this_host_lacks_says_how_to_compile_for_it_ahead_of_time():
    with pytest.raises(TargetError, match="get_topology_desc"):
        resolve("tpu")


def test_the_default_target_is_the_default_device_and_its_figures_add_up():
    here = jg.compiled_memory(GB, *([WS, X]))
    there = jg.compiled_memory(GB, WS, X, target=CPU)
    avals = jg.compiled_memory(GB, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                                [WS, X])[0], jax.ShapeDtypeStruct(X.shape, F32))
    bare = jg.compiled_memory(GB, target="cpu")
    assert here == there == avals == bare
    assert isinstance(here, CompiledMemory) and here.platform == "cpu"
    # XLA:CPU's own peak counts the arguments alone: jgraph's adds what the step allocates
    assert here.peak_bytes == (here.argument_bytes + here.output_bytes - here.alias_bytes
                               + here.temp_bytes) > here.temp_bytes > 0
    assert here.budget_bytes == here.temp_bytes and here.figure == "temp_size_in_bytes"
    assert "peak" in str(here) and "(cpu)" in str(here)


def test_measuring_checks_the_arguments_against_the_graph():
    with pytest.raises(jg.JGraphError if hasattr(jg, "JGraphError") else Exception,
                       match="traced"):
        jg.compiled_memory(GB, WS, jnp.ones((3, 64)), target=CPU)


def test_compile_places_the_arguments_on_the_target():
    f = jg.compile(GB, target=CPU)
    value, grads = f(WS, X)
    want_value, want_grads = jax.value_and_grad(chain)(WS, X)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for a, b in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    with pytest.raises(TargetError, match="not both"):
        jg.compile(GB, target=CPU, in_shardings=SingleDeviceSharding(CPU))


def test_a_budget_planned_for_a_target_is_the_same_plan_and_says_where():
    plain = jg.remat(GB, budget="80%")
    there = jg.remat(GB, budget="80%", target=CPU)
    info = there.info["remat"]
    assert info["target"].endswith("(cpu)") and info["figure"] == "temp_size_in_bytes"
    assert str(there) == str(plain) and info["xla_temp"] == plain.info["remat"]["xla_temp"]
    assert jg.compiled_memory(there, WS, X, target=CPU).budget_bytes <= info["budget"]


def test_the_memory_model_is_calibrated_on_a_target_and_says_so_for_a_gpu():
    # calibrated on the graph itself (no plan of another), the model gives its compiled figure
    assert jg.memory(GB, target=CPU).peak_bytes == jg.compiled_memory(GB).temp_bytes > 0
    assert "one compile" in jg.memory(GB, target=CPU).model
    elsewhere = Target("gpu", (types.SimpleNamespace(platform="gpu", device_kind="H100"),))
    with pytest.raises(TargetError, match="compiled_memory"):
        jg.memory(GB, target=elsewhere)


def test_the_dropins_and_the_optimizer_plan_for_a_target():
    vg = jg.value_and_grad(chain, budget="80%", target=CPU)
    value, grads = vg(WS, X)
    want_value, want_grads = jax.value_and_grad(chain)(WS, X)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for a, b in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert vg.graph(WS, X).info["remat"]["target"].endswith("(cpu)")

    def model(ws, x):
        return chain(ws, x)

    opt = jg.Optimizer(model, optax.sgd(0.1), loss="sum", remat={"budget": "80%", "target": CPU})
    state = opt.init([jnp.copy(w) for w in WS], X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jg.BudgetWarning)
        state, out = opt.step(state, X)
    ws = [w - 0.1 * g for w, g in zip(WS, jax.grad(chain)(WS, X), strict=True)]
    for a, b in zip(state.params, ws, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert opt.graphs["opt"].info["remat"]["target"].endswith("(cpu)")  # planned whole


def test_a_mesh_target_splits_the_batch_and_refuses_one_it_does_not_divide():
    target = resolve(Mesh(np.array([CPU]), ("data",)))
    state, data = target.sharding(WS[0], True), target.sharding(X, False)
    assert state.spec == PartitionSpec() and data.spec == PartitionSpec("data")
    fake = Target("cpu", (CPU, CPU), types.SimpleNamespace(shape={"data": 2}), "data")
    with pytest.raises(TargetError, match="does not divide"):
        fake.sharding(jax.ShapeDtypeStruct((3, 4), F32), False, "input 4 (data)")
