"""Issue 19's bar: a fresh bad-input sweep of its surface (0 silent, 0 lost, 0 raw errors).

Each probe is a bad or edge input a user might give, with what must happen: a jgraph error whose
message matches a pattern (good), `(ExceptionType, pattern)` for an error JAX raises as well, or
a check of the result (JAX's or optax's behaviour, a value compared with JAX). Any other
exception escaping from jgraph is "raw"; no error where one is due, or a failed check, is
"silent"; a trained state that cannot be recovered is "lost" (the save-failure probe checks
that `.state`, `.params` and `.history` are attached).

The surface: `jg.remat(graph, budget=..., planner=...)` (bytes and "NN%", bad strings, negative,
NaN, bool, huge, numpy and JAX scalars; planner names; forward-only graphs, accumulators,
optimizer steps, scans, conds, while loops); `MemoryReport.plot` and `jg.to_dot`;
`jg.check`/`str`/`evaluate`/`compile`/`backward`/`remat` of hand-built malformed graphs; state
fingerprints and `strict=`; another Optimizer's state; class ids outside [0, classes); bad
checkpoint paths and a save failing mid-run; custom_jvp/custom_vjp at higher orders, bf16
cotangents, `optimize_remat`, `jax_remat3`/`jax_custom_vjp3`, `jax.debug.print` in scans;
`jg.testing.graphs()/programs()` options and `check_grads` arguments. The probes live in
`tests/sweep19_*.py`; those that compile XLA plans or train are `slow`.
`PYTHONPATH=. python tests/test_sweep_issue19.py` prints the tally of every group.
"""

import re
import traceback
import warnings

import pytest
from sweep19_graphs import custom_testing_probes, graphs_probes
from sweep19_remat import pictures_probes, planner_probes
from sweep19_training import training_probes

import jgraph as jg

GROUPS = {"planner": planner_probes, "pictures": pictures_probes, "graphs": graphs_probes,
          "training": training_probes, "custom_testing": custom_testing_probes}


def classify(call, expect) -> tuple[str, str]:
    """("good" | "raw" | "silent", what happened)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = call()
    except jg.JGraphError as e:
        if isinstance(expect, str) and re.search(expect, str(e), re.S):
            return "good", ""
        return "raw", f"{type(e).__name__}: {str(e)[:300]}"
    except Exception as e:  # noqa: BLE001 - classifying is the point
        if isinstance(expect, tuple) and isinstance(e, expect[0]) and re.search(expect[1], str(e)):
            return "good", ""
        where = "".join(traceback.format_tb(e.__traceback__)[-2:])
        return "raw", f"{type(e).__name__}: {str(e)[:300]}\n{where}"
    if isinstance(expect, str | tuple):
        return "silent", f"no error; returned {str(out)[:100]}"
    return ("good", "") if expect(out) else ("silent", f"the check failed on {str(out)[:200]}")


def sweep(group: str, slow: bool | None) -> dict:
    """{probe: outcome} of the group's probes that are not good (`slow`: the heavy ones only,
    the light ones only, or None: all)."""
    probes, heavy = GROUPS[group]()
    outcomes = {}
    for name, call, expect, *_ in probes:
        if slow is None or (name in heavy) == slow:
            outcomes[name] = classify(call, expect)
    return outcomes


def _bad(outcomes):
    return {name: f"[{kind}] {detail}" for name, (kind, detail) in outcomes.items()
            if kind != "good"}


@pytest.mark.parametrize("group", [pytest.param(g, marks=pytest.mark.extended) if g == "training"
                                   else g for g in GROUPS])
def test_sweep(group):
    bad = _bad(sweep(group, slow=False))
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize("group", ["planner", "training"])
def test_sweep_heavy(group):
    bad = _bad(sweep(group, slow=True))
    assert not bad, bad


if __name__ == "__main__":
    total = {}
    for group in GROUPS:
        outcomes = sweep(group, slow=None)
        kinds = {}
        for kind, _ in outcomes.values():
            kinds[kind] = kinds.get(kind, 0) + 1
            total[kind] = total.get(kind, 0) + 1
        for name, text in _bad(outcomes).items():
            print(f"{group}: {name}: {text}")
        print(f"{group}: {len(outcomes)} probes, {kinds}")
    print(f"all: {sum(total.values())} probes, {total}")
