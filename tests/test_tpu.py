"""Memory planned for a TPU, compiled ahead of time on this host (no TPU is needed: libtpu's
compiler runs anywhere, nothing runs on a chip). Skipped without libtpu (`pip install
'jgraph[tpu]'`); `.ci/run` installs it and runs these after the default suite (`-m tpu`).

A TPU compile takes seconds, so the models are few, and as small as can be while their
activations exceed a v5e core's VMEM (128 MiB; smaller ones measure the VMEM, not a plan). Each
figure is the TPU compiler's own: the HBM the donated step needs (the smallest HBM size at which
it compiles, the compiler's own rematerialization off), against JAX's step measured the same
way."""

import dataclasses
import importlib
import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgraph as jg
from jgraph.memory.compiled import lowered_step
from jgraph.memory.hbm import MIB, smallest_size
from jgraph.target import resolve

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                       reason="libtpu is not installed: pip install 'jgraph[tpu]' compiles for "
                              "a TPU ahead of time (no TPU needed)"),
]

F32 = jnp.float32
D, B, LAYERS = 1024, 4096, 8  # activations 8 x (16 MiB + 8 MiB of bfloat16 copies)


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


def jax_need(fn, target, x=X) -> int:
    """The HBM (bytes) JAX's donated SGD step of `fn` needs on `target`, measured as jgraph
    measures its own (`jgraph.memory.hbm`)."""
    def step(ws, x):
        loss, grads = jax.value_and_grad(fn)(ws, x)
        return [w - 1e-3 * g for w, g in zip(ws, grads, strict=True)], loss

    def placed(a, state):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target.sharding(a, state))

    lowered = jax.jit(step, donate_argnums=0).lower([placed(w, True) for w in WS],
                                                     placed(x, False))
    return smallest_size(lowered, target.compile_options)[0] * MIB


def compiles_at(lowered, size_mib: int) -> bool:
    """Whether the TPU compiler fits `lowered` in `size_mib` MiB of HBM (its remat off)."""
    target, lowered = lowered
    try:
        lowered.compile(compiler_options={**target.compile_options,
                                          "xla_tpu_max_hbm_size_mib": size_mib})
        return True
    except Exception as e:
        assert "RESOURCE_EXHAUSTED" in str(e) or "hbm" in str(e).lower(), e
        return False


@pytest.fixture(scope="module")
def gb():
    return jg.backward(jg.trace(chain, WS, X, param_argnums=0))


def test_a_tpu_steps_figure_is_the_smallest_hbm_it_compiles_in(topology, gb):
    chip = topology.devices[0]
    mine = jg.compiled_memory(gb, target=chip)
    assert mine.platform == "tpu" and mine.figure == "hbm_bytes" and mine.hbm_mode == "exact"
    assert mine.budget_bytes == mine.hbm_bytes and mine.hbm_bytes % MIB == 0 and mine.exact
    assert mine.dots >= 3 * LAYERS - 1  # TPU writes its matrix products as convolutions
    # against a bisection's two ends: it compiles at its figure, not a MiB below
    size = mine.hbm_bytes // MIB
    lowered = lowered_step(gb, resolve(chip))
    assert compiles_at(lowered, size) and not compiles_at(lowered, size - 1)
    assert mine.hbm_bytes > mine.argument_bytes  # the arguments count, in full
    # one compile's estimate never falls below it; the peak is not it (VMEM, no code)
    estimate = jg.compiled_memory(gb, target=chip, exact=False)
    assert estimate.hbm_mode == "estimate" and not estimate.exact
    assert mine.hbm_bytes <= estimate.hbm_bytes <= 1.25 * mine.hbm_bytes
    assert mine.peak_bytes != mine.hbm_bytes
    assert mine.hbm_bytes <= 1.02 * jax_need(chain, resolve(chip))


def test_a_budget_is_met_on_the_tpus_figure_and_its_recompute_survives(topology, gb):
    chip = topology.devices[0]
    no_remat = jg.compiled_memory(gb, target=chip)
    budget = int(0.8 * no_remat.hbm_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jg.BudgetWarning)
        plan = jg.remat(gb, budget=budget, target=chip)
    info = plan.info["remat"]
    assert info["figure"] == "hbm_bytes" and "TPU" in info["target"]
    assert info["plan"] != "no remat" and info["xla_temp"] <= budget
    # planned on the model, its plan compiled once at the budget's size to confirm it
    assert info["confirmed"] == f"at {budget // MIB} MiB" and info["model_temp"] <= budget
    there = jg.compiled_memory(plan, target=chip)
    assert there.hbm_bytes <= budget
    recomputed = sum(e.op == "dot_general" for e in plan.eqns if "recompute" in e.tags)
    assert recomputed > 0 and there.dots > no_remat.dots
    # the plan computes what the graph computes (run on this host's CPU)
    ws = [jnp.linspace(-0.05, 0.05, D * D, dtype=F32).reshape(D, D) * (k + 1) / 8
          for k in range(LAYERS)]
    x = jnp.linspace(-1, 1, B * D, dtype=F32).reshape(B, D)
    got, want = jg.compile(plan)(ws, x), jax.value_and_grad(chain)(ws, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_a_model_that_misses_is_corrected_by_its_confirming_compile(topology, gb, monkeypatch):
    """A model 40 MiB too low: the plan it picks misses when compiled at the budget's size; the
    miss corrects the model, and the plan returned fits."""
    chip = topology.devices[0]
    search = importlib.import_module("jgraph.planner.search")
    real = search.calibration

    def optimistic(unplanned, target):
        fitted = real(unplanned, target)
        return dataclasses.replace(fitted, figure=fitted.figure - 40 * MIB)

    monkeypatch.setattr(search, "calibration", optimistic)
    compiled = []
    figures = search.validate.xla_figures
    monkeypatch.setattr(search.validate, "xla_figures",
                        lambda graph: compiled.append(graph) or figures(graph))
    budget = int(0.7 * jg.compiled_memory(gb, target=chip).hbm_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jg.BudgetWarning)
        plan = jg.remat(gb, budget=budget, target=chip)
    assert len(compiled) >= 2  # the first plan missed: the model was corrected, then confirmed
    assert plan.info["remat"]["xla_temp"] <= budget
    assert jg.compiled_memory(plan, target=chip).hbm_bytes <= budget


def test_recompute_survives_tpus_compiler(topology, gb):
    """Each checkpointed layer's recomputed product is still in TPU's compiled step: no CSE
    merged it with the forward's."""
    def layered(ws, x, layer):
        h = x
        for w in ws:
            h = layer(h, w)
        return jnp.mean(h**2)

    def layer(h, w):  # sin's derivative reads the product: a checkpoint recomputes it
        return jnp.tanh(jnp.sin(h @ w))

    chip = topology.devices[0]
    plain = jg.backward(jg.trace(lambda ws, x: layered(ws, x, layer), WS, X, param_argnums=0))
    regions = jg.remat(jg.backward(jg.trace(
        lambda ws, x: layered(ws, x, jax.checkpoint(layer)), WS, X, param_argnums=0)))
    recomputed = sum(e.op == "dot_general" for e in regions.eqns if "recompute" in e.tags)
    assert recomputed == LAYERS
    there = jg.compiled_memory(regions, target=chip, exact=False)
    assert there.dots == jg.compiled_memory(plain, target=chip, exact=False).dots + recomputed


def test_the_least_plan_reaches_jaxs_per_layer_checkpoint_on_tpu(topology, gb):
    """TPU's compiler stores a value that only matrix products read in bfloat16 (default
    precision): JAX's per-layer checkpoint keeps layer inputs that only recomputed products
    read. A plan made for a TPU reads recomputed outputs in its backward as JAX's does."""
    chip = topology.devices[0]
    hand = jax_need(checkpointed, resolve(chip))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jg.BudgetWarning)
        least = jg.remat(gb, budget="1%", target=chip)
    exact = jg.compiled_memory(least, target=chip).hbm_bytes
    assert exact <= 1.02 * hand
    # the figure it reports is its fit figure, code included (a compile at 1 % of the step's
    # size fails at buffer assignment and names the buffers alone, laid out for that size)
    assert exact - MIB <= least.info["remat"]["xla_temp"] <= 1.10 * exact


def test_the_model_predicts_a_plans_hbm_from_one_compile(topology, gb):
    """`jg.memory(plan, target=chip)`: the compiler's buffer assignment run to its first HBM
    check, plus the code the unplanned step's one full compile showed, within 10 % of the
    plan's exact figure."""
    chip = topology.devices[0]
    plans = [jg.remat(jg.backward(jg.trace(checkpointed, WS, X, param_argnums=0))),
             jg.remat(gb, policy=jg.policies.nothing_saveable)]
    for plan in plans:
        report = jg.memory(plan, target=chip, unplanned=gb)
        assert "TPU's buffer assignment" in report.model
        exact = jg.compiled_memory(plan, target=chip).hbm_bytes
        assert abs(report.peak_bytes / exact - 1) <= 0.10, (report.peak_bytes, exact)


def test_a_mesh_of_four_chips_is_measured_per_device(topology):
    mesh = jax.sharding.Mesh(np.array(topology.devices), ("data",))
    x = jax.ShapeDtypeStruct((4 * B, D), F32)  # each chip gets B rows, as one chip above
    gb = jg.backward(jg.trace(chain, WS, x, param_argnums=0))
    per_device = jg.compiled_memory(gb, target=mesh)
    assert per_device.argument_bytes == LAYERS * D * D * 4 + B * D * 4  # its share of the batch
    assert per_device.hbm_bytes <= 1.02 * jax_need(chain, resolve(mesh), x)
    one = jg.compiled_memory(jg.backward(jg.trace(chain, WS, X, param_argnums=0)),
                             target=topology.devices[0])
    assert per_device.hbm_bytes >= one.hbm_bytes  # the same share, and the collectives


def test_the_compilers_own_remat_is_measured_as_the_peer(topology):
    """`bench_accelerators.compiler_remat`: JAX's 8-layer MLP step (98 MiB of HBM with the
    compiler's rematerialization off) compiles at 60 MiB with it on, recomputing (more flops
    than the step with it off), and not at 60 MiB with it off."""
    from benchmarks.bench_accelerators import compiled_flops, compiler_remat, jax_lowered

    chip = resolve(topology.devices[0])
    lowered = jax_lowered(chain, (WS, X), "sgd", chip)
    fits, extra = compiler_remat(lowered, chip, 60 * MIB, compiled_flops(lowered, chip))
    assert fits and extra > 0
    assert not compiles_at((chip, lowered), 60)
