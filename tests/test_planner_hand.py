"""The planner's floor: the arrangements a user writes by hand (`jgraph.planner.hand`).

A U-Net-shaped MLP (each encoder level's output read again by its decoder level: long skips
cross every cut of the chain) checkpointed per layer with `jax.checkpoint` is what a user writes;
the planner's plan space holds that arrangement (a segment per layer, found from the graph's
own structure), so a byte budget it meets is met, and the least temp a plan reaches (what
`TransformError` reports) is not above it. Checked on XLA's compiled temp of the donated step,
gradients against `jax.value_and_grad`.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgraph as jg
from benchmarks.bench_planner import KEEP_BARRIERS, unet
from benchmarks.bench_planner import unet_args as bench_unet_args
from jgraph.planner import hand
from jgraph.planner.search import problems, xla_temp


def unet_args(levels, width=128, batch=128):
    return bench_unet_args(levels, width, batch)


def chain(params, x):
    for p in params:
        x = jnp.tanh(jax.nn.gelu(x @ p["w1"]) @ p["w2"])
    return jnp.mean(x**2)


def by_hand(loss_of, args, policy=None) -> int:
    """XLA's temp of the step with `jax.checkpoint(policy=...)` around each layer, as jgraph
    compiles it."""
    ckpt = loss_of(lambda f: jax.checkpoint(f, policy=policy))
    return xla_temp(jg.remat(jg.backward(jg.trace(ckpt, *args, param_argnums=0))))


def test_a_chain_of_layers_is_cut_into_one_segment_per_layer():
    layers = 6
    args = ([unet_args(1)[0]["enc"][0]] * layers, unet_args(1)[1])
    gb = jg.backward(jg.trace(chain, *args, param_argnums=0))
    problem = problems(gb)["loops as traced"]
    cuts = hand.layer_segments(problem)
    assert cuts, "no per-layer segmentation found"
    # each layer's two contractions lie in one segment; the loss may have one of its own
    stage_of = {e: k for k, s in enumerate(problem.stage_eqns) for e in s}
    dots = [stage_of[e] for e in problem.forward.eqns if e.op == "dot_general"]
    for segments in cuts:
        seg_of = [next(i for i, s in enumerate(segments) if s.start <= k < s.stop) for k in dots]
        assert [seg_of[2 * i] == seg_of[2 * i + 1] for i in range(layers)] == [True] * layers
        assert len(set(seg_of)) == layers


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_saveable],
                         ids=["nothing_saveable", "dots_saveable"])
def test_a_budget_a_per_layer_checkpoint_meets_is_met(policy, monkeypatch):
    """Met, or missed by the bytes of a conditional's tuples: with `nothing_saveable` at this
    small width the least plan reaches 1,835,080 bytes against the per-layer checkpoint's
    1,835,008 as jgraph compiles it (the taint of the innermost decoder's input `h + h` is a
    conditional, `jgraph.lower.read_through_cond`; as a select it kept `h` until the backward:
    one 64 KiB activation more)."""
    from jgraph.planner import search

    monkeypatch.setattr(search, "AUTO_TIME_LIMIT", 2.0)  # "auto"'s MILP: not what is tested
    args = unet_args(4)
    temp = by_hand(unet, args, policy)
    gb = jg.backward(jg.trace(unet(), *args, param_argnums=0))
    try:
        gr = jg.remat(gb, budget=temp)
    except jg.TransformError as e:
        least = int(re.search(r"reaches is (\d+) bytes", str(e)).group(1))
        assert least <= temp + 1024, (least, temp)
        temp = least
        gr = jg.remat(gb, budget=temp)
    assert gr.info["remat"]["xla_temp"] <= temp and xla_temp(gr) <= temp
    want = jax.value_and_grad(unet())(*args)
    got = jg.compile(gr)(*args)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def _dots_per_segment(problem, segments) -> list[int]:
    stage_of = {e: k for k, s in enumerate(problem.stage_eqns) for e in s}
    dots = [stage_of[e] for e in problem.forward.eqns if e.op == "dot_general"]
    return [sum(s.start <= k < s.stop for k in dots) for s in segments]


def test_a_u_net_is_cut_into_one_segment_per_layer():
    """In the middle levels of a U-Net every boundary is wide (the long skips cross them all):
    a layer's boundary is still where the new bytes crossing narrow."""
    levels = 8
    gb = jg.backward(jg.trace(unet(), *unet_args(levels, 32, 8), param_argnums=0))
    problem = problems(gb)["loops as traced"]
    per_layer = hand.layer_segments(problem)[0]
    counts = _dots_per_segment(problem, per_layer)
    assert [c for c in counts if c] == [2] * (2 * levels), counts


@pytest.mark.parametrize("levels", [4, pytest.param(8, marks=pytest.mark.slow)])  # 8: -m slow
def test_the_least_temp_reported_is_below_the_hand_arrangement(levels):
    """The least plan on the U-Nets is not above the per-layer checkpoint as jgraph compiles it
    (which keeps each region's output, DESIGN 4.2) and within 1.02x of JAX's own compilation of
    it with XLA's barrier expander off: at the benchmark's width, 256, 9.0 MiB against 9.0 on
    8 levels, 7.0 against 7.0 on 4; at this test's, 128, 2.25 against 2.25 and 1.75 against
    1.75. It was 9.25 MiB (1.03x) and 7.25 (1.04x) while the taint of the innermost decoder's
    input `h + h` was a select (`jgraph.lower.read_through_cond`), 1.58x before the hand
    arrangements."""
    args = unet_args(levels)
    temp = by_hand(unet, args)
    by_jax = jax.jit(lambda p, x: jax.value_and_grad(unet(jax.checkpoint))(p, x),
                     donate_argnums=0, compiler_options=KEEP_BARRIERS)
    jax_temp = by_jax.lower(*args).compile().memory_analysis().temp_size_in_bytes
    gb = jg.backward(jg.trace(unet(), *args, param_argnums=0))
    with pytest.raises(jg.TransformError, match="no plan fits") as caught:
        jg.remat(gb, budget=1024)
    least = int(re.search(r"reaches is (\d+) bytes", str(caught.value)).group(1))
    assert least <= temp + 1024, (least, temp)  # a conditional's tuples (see above)
    assert least <= 1.02 * jax_temp, (least, jax_temp)
    gr = jg.remat(gb, budget=least)  # the least it reports is a plan it returns
    assert xla_temp(gr) <= least


def test_scan_modes_take_no_more_than_jaxs_scan_arrangements():
    """A scanned MLP's loop modes against the scans a user writes, compiled by JAX with its
    barriers kept (`KEEP_BARRIERS`): a body keeping its inputs is `scan(checkpoint(body))`, the
    scans split in three are 2 x 2 x 2 nested scans with a checkpointed body. A recompute at the
    start of a backward iteration has no twin in its body and waits for nothing: it is not
    tainted (`jgraph.lower`); when it was, each iteration copied its 64 KiB weight slice and
    the modes took 64 KiB and 640 bytes more than JAX's."""
    from benchmarks.bench_planner import scanned, scanned_args
    from benchmarks.bench_remat import jax_step

    args = scanned_args(layers=8, width=128, batch=256)
    by_mode = problems(jg.backward(jg.trace(scanned(), *args, param_argnums=0)))

    def jax_temp(fn):
        step = jax_step(fn, KEEP_BARRIERS)
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

    pairs = {"loop bodies keep their inputs": scanned(jax.checkpoint),
             "scans split in three, bodies keeping their inputs": scanned(
                 split=(4, 2), inner=jax.checkpoint)}
    for mode, fn in pairs.items():
        assert xla_temp(by_mode[mode].finished()) <= jax_temp(fn), mode


@pytest.mark.extended  # about 8-10 s: the default suite keeps its margin under 10 minutes
def test_concatenated_skips_least_plan_holds_per_layer_checkpoint():
    """Issue 42: a decoder reading its skip through `jnp.concatenate` keeps no narrowing
    boundary; the layers are found from the user's function calls (`chain.call_starts`), so
    the least plan is not above `jax.checkpoint` per layer, and at its temp a plan fits."""
    from benchmarks.unet_concat import unet as unet_concat

    fn, params, x = unet_concat(8, 64, 32)
    gb = jg.backward(jg.trace(fn, params, x, param_argnums=0))
    fh, _, _ = unet_concat(8, 64, 32, jax.checkpoint_policies.nothing_saveable)
    per_layer = xla_temp(jg.remat(jg.backward(jg.trace(fh, params, x, param_argnums=0))))
    with pytest.warns(jg.BudgetWarning):
        least = jg.remat(gb, budget="1%").info["remat"]["xla_temp"]
    assert least <= 1.02 * per_layer
    assert xla_temp(jg.remat(gb, budget=per_layer)) <= per_layer
