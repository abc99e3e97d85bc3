"""Memory planned for a TPU, compiled ahead of time on this host (no TPU is needed: libtpu's
compiler runs anywhere, nothing runs on a chip). Skipped without libtpu (`pip install
'jgraph[tpu]'`); `.ci/run` installs it and runs these after the default suite (`-m tpu`).

A TPU compile takes seconds, so the models are small and few. Each figure is the TPU compiler's
own (`peak_memory_in_bytes` of the donated step), against JAX's step compiled the same way."""

import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgraph as jg
from jgraph.target import resolve

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                       reason="libtpu is not installed: pip install 'jgraph[tpu]' compiles for "
                              "a TPU ahead of time (no TPU needed)"),
]

F32 = jnp.float32
D, B, LAYERS = 256, 512, 4


@pytest.fixture(scope="module")
def topology():
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")


def chain(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


def checkpointed(ws, x):
    h = x
    for w in ws:
        h = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w)
    return jnp.mean(h**2)


WS = [jax.ShapeDtypeStruct((D, D), F32) for _ in range(LAYERS)]
X = jax.ShapeDtypeStruct((B, D), F32)


def jax_peak(fn, target, x=X) -> int:
    """`peak_memory_in_bytes` of JAX's donated SGD step of `fn`, compiled for `target`."""
    def step(ws, x):
        loss, grads = jax.value_and_grad(fn)(ws, x)
        return [w - 1e-3 * g for w, g in zip(ws, grads, strict=True)], loss

    def placed(a, state):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target.sharding(a, state))

    lowered = jax.jit(step, donate_argnums=0).lower([placed(w, True) for w in WS],
                                                     placed(x, False))
    return int(lowered.compile().memory_analysis().peak_memory_in_bytes)


@pytest.fixture(scope="module")
def gb():
    return jg.backward(jg.trace(chain, WS, X, param_argnums=0))


def test_a_tpu_step_is_measured_by_its_own_compiler(topology, gb):
    chip = topology.devices[0]
    mine = jg.compiled_memory(gb, target=chip)
    assert mine.platform == "tpu" and mine.figure == "peak_memory_in_bytes"
    assert mine.budget_bytes == mine.peak_bytes > mine.argument_bytes > 0
    assert mine.dots >= 3 * LAYERS - 1  # TPU writes its matrix products as convolutions
    assert mine.peak_bytes <= 1.02 * jax_peak(chain, resolve(chip))


def test_a_budget_is_met_on_the_tpus_figure_and_its_recompute_survives(topology, gb):
    chip = topology.devices[0]
    no_remat = jg.compiled_memory(gb, target=chip)
    budget = int(0.95 * no_remat.peak_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jg.BudgetWarning)
        plan = jg.remat(gb, budget=budget, target=chip)
    info = plan.info["remat"]
    assert info["figure"] == "peak_memory_in_bytes" and "TPU" in info["target"]
    assert info["plan"] != "no remat"
    there = jg.compiled_memory(plan, target=chip)
    assert there.peak_bytes <= budget and there.peak_bytes == info["xla_temp"]
    # what is recomputed is still there after TPU's compiler: no CSE merged it away
    recomputed = sum(e.op == "dot_general" for e in plan.eqns if "recompute" in e.tags)
    assert recomputed > 0 and there.dots == no_remat.dots + recomputed
    # the plan computes what the graph computes (run on this host's CPU)
    ws = [jnp.linspace(-0.05, 0.05, D * D, dtype=F32).reshape(D, D) * (k + 1)
          for k in range(LAYERS)]
    x = jnp.linspace(-1, 1, B * D, dtype=F32).reshape(B, D)
    got, want = jg.compile(plan)(ws, x), jax.value_and_grad(chain)(ws, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)


def test_the_least_plan_reaches_jaxs_per_layer_checkpoint_on_tpu(topology, gb):
    """TPU's compiler stores a value that only matrix products read in bfloat16 (default
    precision): JAX's per-layer checkpoint keeps layer inputs that only recomputed products
    read. A plan made for a TPU reads recomputed outputs in its backward as JAX's does; one that
    read the kept tanh outputs in f32 elementwise VJPs reached 4.75 MiB, not JAX's 4.00."""
    chip = topology.devices[0]
    hand = jax_peak(checkpointed, resolve(chip))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jg.BudgetWarning)
        least = jg.remat(gb, budget="1%", target=chip)
    assert least.info["remat"]["xla_temp"] <= 1.02 * hand


def test_a_mesh_of_four_chips_is_planned_per_device(topology):
    mesh = jax.sharding.Mesh(np.array(topology.devices), ("data",))
    target = resolve(mesh)
    x = jax.ShapeDtypeStruct((4 * B, D), F32)  # each chip gets B rows, as one chip above
    gb = jg.backward(jg.trace(chain, WS, x, param_argnums=0))
    per_device = jg.compiled_memory(gb, target=mesh)
    assert per_device.argument_bytes == LAYERS * D * D * 4 + B * D * 4  # its share of the batch
    assert per_device.peak_bytes <= 1.02 * jax_peak(chain, target, x)
    budget = int(0.97 * per_device.peak_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jg.BudgetWarning)
        plan = jg.remat(gb, budget=budget, target=mesh)
    assert "mesh of 4 devices" in plan.info["remat"]["target"]
    assert plan.info["remat"]["plan"] != "no remat"
    assert jg.compiled_memory(plan, target=mesh).peak_bytes == plan.info["remat"]["xla_temp"]
    assert plan.info["remat"]["xla_temp"] <= budget
