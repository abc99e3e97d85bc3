"""The drop-in examples: the four tutorial loops (`examples/flax_linen.py`, `flax_nnx.py`,
`haiku.py`, `equinox.py`), the flax `nn.scan` LM (`flax_scan_lm.py`), and their `jg.jit` twins.

Each is a library's training loop with one line changed to a jgraph transform. The test undoes
that line (the library's own transform again), checks the two sources differ in that line only,
runs both for 20 steps (the digits, the LM's synthetic tokens) and compares the trained
parameters: relative error <= 1e-5 per leaf. It also checks that the jgraph version did trace
through jgraph and that the training moved the parameters (the comparison is not of two untrained
models). The twins change two lines (`jg.jit`, and the transform) and are compared bitwise.
"""

from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from flax import nnx

from jgraph.dropin.transform import ValueAndGrad

EXAMPLES = Path(__file__).parent.parent / "examples"
STEPS = 20

# example -> (the jgraph call in it, the library's call it replaces, the trained params)
CASES = {
    "flax_linen": ("jg.value_and_grad(", "jax.value_and_grad(", lambda out: out[0].params),
    "flax_scan_lm": ("jg.value_and_grad(", "jax.value_and_grad(", lambda out: out[0].params),
    "flax_nnx": ("jg.value_and_grad(", "nnx.value_and_grad(",
                 lambda out: nnx.state(out[0], nnx.Param)),
    "haiku": ("jg.grad(", "jax.grad(", lambda out: out[0]),
    "equinox": ("jg.filter_value_and_grad(", "eqx.filter_value_and_grad(",
                lambda out: eqx.filter(out[0], eqx.is_array)),
}


def load(path: Path, source: str):
    """Execute an example's source as a fresh module (its own jitted functions and caches)."""
    namespace = {"__name__": f"example_{path.stem}", "__file__": str(path)}
    exec(compile(source, str(path), "exec"), namespace)
    return namespace


def rel_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# the heaviest cases run in `.ci/run`'s extended stage (`-m extended`), after the default suite
HEAVY = {"flax_scan_lm", "flax_scan_lm_jit", "equinox_jit"}


def _cases(names):
    return [pytest.param(n, marks=pytest.mark.extended) if n in HEAVY else n for n in sorted(names)]


@pytest.mark.parametrize("name", _cases(CASES))
def test_example_trains_like_its_library(name, monkeypatch):
    ours_call, theirs_call, params_of = CASES[name]
    path = EXAMPLES / f"{name}.py"
    ours = path.read_text()
    theirs = ours.replace(ours_call, theirs_call)
    changed = [(a, b) for a, b in zip(ours.splitlines(), theirs.splitlines(), strict=True)
               if a != b]
    assert len(changed) == 1, changed  # one line, and it calls the transform

    traces = []
    original = ValueAndGrad._trace
    monkeypatch.setattr(ValueAndGrad, "_trace",
                        lambda self, call: traces.append(1) or original(self, call))
    jg_params = params_of(load(path, ours)["train"](steps=STEPS))
    assert traces, "the example did not differentiate through jgraph"
    n_traces = len(traces)
    lib_params = params_of(load(path, theirs)["train"](steps=STEPS))
    assert len(traces) == n_traces  # the library's version did not use jgraph
    initial = params_of(load(path, theirs)["train"](steps=0))

    got, want, start = (jax.tree.leaves(t) for t in (jg_params, lib_params, initial))
    assert len(got) == len(want) == len(start) > 0
    errors = [rel_error(a, b) for a, b in zip(got, want, strict=True)]
    assert max(errors) <= 1e-5, errors
    moved = [rel_error(b, s) for b, s in zip(want, start, strict=True)]
    assert min(moved) > 1e-3, moved  # every leaf trained


# twin example -> (its jgraph lines, the library's lines they replace, the trained params)
JIT_CASES = {
    "flax_linen_jit": ((('@jg.jit(budget="95%", donate_argnums=0)', "@jax.jit"),
                        ("jg.value_and_grad(", "jax.value_and_grad(")),
                       lambda out: out[0].params),
    "flax_scan_lm_jit": ((('@jg.jit(budget="99%", donate_argnums=0)', "@jax.jit"),
                          ("jg.value_and_grad(", "jax.value_and_grad(")),
                         lambda out: out[0].params),
    "flax_nnx_jit": ((('@jg.jit(budget="95%", donate_argnums=(0, 1, 2))', "@nnx.jit"),
                      ("jg.value_and_grad(", "nnx.value_and_grad(")),
                     lambda out: nnx.state(out[0], nnx.Param)),
    "haiku_jit": ((('@jg.jit(budget="95%", donate_argnums=(0, 1))', "@jax.jit"),
                   ("jg.grad(", "jax.grad(")), lambda out: out[0]),
    "equinox_jit": ((('@jg.jit(budget="95%", donate_argnums=(0, 1))', "@eqx.filter_jit"),
                     ("jg.filter_value_and_grad(", "eqx.filter_value_and_grad(")),
                    lambda out: eqx.filter(out[0], eqx.is_array)),
}


# twin -> what its plan must do, read from `info["remat"]` of each signature it traced, so the
# bitwise comparison is not of a step the budget left as it was
PLANS = {
    # adam's update of every param (20 leaves) moved into the backward scan, nothing
    # recomputed: no sum changes (recomputing the block's muls and exps would, on XLA:CPU)
    "flax_scan_lm_jit": lambda report: (len(report.get("fused", ())) == 20
                                        and report["recompute_flops"] == 0),
}


@pytest.mark.parametrize("name", _cases(JIT_CASES))
def test_whole_step_twin_trains_like_its_library(name, monkeypatch):
    """The budgeted twins (`jg.jit` over the whole step): two lines undone, 20 steps each, the
    same parameters bitwise (recomputation changes no sum)."""
    from jgraph.dropin.jit import Jit

    lines, params_of = JIT_CASES[name]
    path = EXAMPLES / f"{name}.py"
    ours = theirs = path.read_text()
    for mine, library in lines:
        theirs = theirs.replace(mine, library)
    changed = [(a, b) for a, b in zip(ours.splitlines(), theirs.splitlines(), strict=True)
               if a != b and not a.lstrip().startswith(("`", '"""'))]
    changed = [(a, b) for a, b in changed if "where it has" not in a]
    assert len(changed) == 2, changed

    traces = []
    original = Jit._trace
    monkeypatch.setattr(Jit, "_trace",
                        lambda self, args: traces.append(original(self, args)) or traces[-1])
    jg_params = params_of(load(path, ours)["train"](steps=STEPS))
    assert traces, "the example did not run its step through jg.jit"
    if name in PLANS:
        reports = [t.graph.info["remat"] for t in traces]
        assert all(PLANS[name](r) for r in reports), reports
    lib_params = params_of(load(path, theirs)["train"](steps=STEPS))
    initial = params_of(load(path, theirs)["train"](steps=0))
    got, want, start = (jax.tree.leaves(t) for t in (jg_params, lib_params, initial))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert min(rel_error(b, s) for b, s in zip(want, start, strict=True)) > 1e-3
