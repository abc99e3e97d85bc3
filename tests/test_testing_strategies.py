"""The strategies themselves: `jg.testing.graphs()`, `programs()` and `recipes()`.

Drawn graphs are well formed, typed by JAX's x64 setting, and structured as `jg.trace` structures
graphs; every op family is drawn, and so are regions (nested, with every policy), names, Python
scalar literals, integer and boolean side computations, unused values, params at every argument
position, aux outputs; shrinking gives small counterexamples; a user's own family is drawn.
(The property-test guide's example, docs/guides/testing.md, runs in tests/test_docs.py.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from properties import examples

import jgraph as jg
from jgraph.errors import JGraphError
from jgraph.ir import Literal
from jgraph.passes import dce
from jgraph.testing import FAMILIES, Family, Proposal
from jgraph.testing.build import POLICIES
from jgraph.testing.families import GROUPS, register

FIND = dict(max_examples=2000, deadline=None, database=None, derandomize=True,
            suppress_health_check=list(HealthCheck))


def _found(condition, shrink=False, **options):
    """A recipe satisfying `condition` (hypothesis's search, derandomized), shrunk with `shrink`."""
    phases = [Phase.generate, Phase.shrink] if shrink else [Phase.generate]
    return find(jg.testing.recipes(**options), condition, settings=settings(phases=phases, **FIND))


@functools.cache
def _drawn(n: int = 400) -> tuple:
    """`n` recipes as `recipes()` draws them (generation only, with a fixed seed)."""
    out = []

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              derandomize=True, suppress_health_check=list(HealthCheck))
    @given(jg.testing.recipes())
    def collect(recipe):
        out.append(recipe)

    collect()
    return tuple(out)


@examples(15)
@given(jg.testing.graphs())
def test_drawn_graphs_are_well_formed_and_typed_by_x64(drawn):
    g, args = drawn
    jg.check(g)
    assert all(v.aval.dtype in (np.float32, np.int32, np.bool_) for v in g.inputs)
    assert "param" in g.input_roles and g.output_roles[0] == "loss"
    assert jax.tree.structure(args) == g.in_tree
    for v, x in zip(g.inputs, jax.tree.leaves(args), strict=True):
        assert np.shape(x) == v.aval.shape
        assert isinstance(x, float) if v.aval.weak_type else np.asarray(x).dtype == v.aval.dtype
    jg.evaluate(g, *args)  # callable with its example arguments
    for e in g.eqns:
        assert e.source.startswith(("step ", "loss"))  # errors name the recipe's step


@pytest.mark.f64
@examples(10)
@given(jg.testing.graphs())
def test_under_x64_graphs_draw_float64(drawn):
    g, _ = drawn
    assert any(v.aval.dtype == np.float64 for v in g.inputs)
    assert not any(v.aval.dtype == np.float32 for v in g.inputs)


def test_every_family_is_drawn():
    drawn = {s.family for r in _drawn() for s in r.steps}
    assert drawn <= set(FAMILIES)
    assert len(drawn) >= len(FAMILIES) - 2, set(FAMILIES) - drawn  # nearly all in a plain draw
    for name in set(FAMILIES) - drawn:  # the rare rest: hypothesis's search finds each
        _found(lambda r, name=name: any(s.family == name for s in r.steps))


def test_regions_of_every_policy_are_drawn_nested():
    spans = [s for r in _drawn() for s in r.spans]
    assert {s.policy for s in spans} == {None, *POLICIES}
    assert any(s.parent is not None and r.spans[s.parent].parent is not None
               for r in _drawn() for s in r.spans)  # three deep
    assert {s.prevent_cse for s in spans} == {True, False}


@pytest.mark.parametrize("what, condition", [
    ("named values", lambda r: any(s.name for s in r.steps)),
    ("unused values", lambda r: any(j not in r.loss_terms and j not in r.aux and
                                    all(j not in t.operands for t in r.steps)
                                    for s in r.steps for j in s.outputs)),
    ("fan-out", lambda r: any(sum(j in s.operands for s in r.steps) >= 2
                              for j in range(len(r.slots)))),
    ("a param after a data argument", lambda r: max(_argnums(r)) > min(
        set(range(len(r.arguments))) - set(_argnums(r)), default=99)),
    ("params in reverse order", lambda r: isinstance(r.param_argnums, tuple) and
     list(r.param_argnums) == sorted(r.param_argnums, reverse=True) and len(r.param_argnums) > 1),
    ("dict arguments", lambda r: any(not isinstance(a, int) for a in r.arguments)),
    ("integer data", lambda r: any(s.kind == "int" for s in r.slots[:r.leaves()])),
    ("boolean data", lambda r: any(s.kind == "bool" for s in r.slots[:r.leaves()])),
    ("aux outputs", lambda r: r.has_aux and len(r.aux) == 2),
    ("ten steps", lambda r: len(r.steps) == 10),
    ("rank-4 values", lambda r: any(len(s.shape) == 4 for s in r.slots)),
])
def test_the_structures_the_issue_asks_for_are_drawn(what, condition):
    assert any(condition(r) for r in _drawn())


def _argnums(recipe):
    n = recipe.param_argnums
    return (n,) if isinstance(n, int) else n


def test_python_scalars_are_weakly_typed_arguments_and_literals():
    graphs = [jg.testing.build.to_graph(r) for r in _drawn() if any(s.weak for s in r.slots)]
    assert any(v.aval.weak_type for g in graphs for v in g.inputs)
    literals = [a for g in graphs for e in g.eqns for a in e.inputs if isinstance(a, Literal)]
    assert any(a.aval.weak_type and a.aval.shape == () for a in literals)
    assert any(not a.aval.weak_type and a.aval.shape == () for a in literals)


def test_shrinking_gives_a_minimal_counterexample():
    # A "bug" that needs a batched dot_general whose result reaches the loss: drawn among graphs of
    # up to ten steps, the shrunk recipe is at most three steps and three arguments (hypothesis
    # shrinks to a local minimum: a step feeding the dot, or an unused argument, can stay).
    def batched_dot_in_loss(r):
        return any(s.family == "dot_general" and s.static[0][1][1][0] and s.outputs[0] in
                   r.loss_terms for s in r.steps)

    recipe = _found(batched_dot_in_loss, shrink=True)
    assert len(recipe.steps) <= 3 and len(recipe.arguments) <= 3 and not recipe.spans, str(recipe)
    assert batched_dot_in_loss(recipe)


def test_options_select_families_and_reject_unknown_ones():
    recipe = _found(lambda r: len(r.steps) >= 3, families=["tanh", "add"], regions=False,
                    integers=False)
    assert {s.family for s in recipe.steps} <= {"tanh", "add"} and not recipe.spans
    with pytest.raises(JGraphError, match="unknown op families"):
        jg.testing.graphs(families=["tanh", "frobnicate"])
    assert "loop" in GROUPS
    looped = _found(lambda r: any(FAMILIES[s.family].group == "loop" for s in r.steps))
    assert any(s.family in ("scan", "fori_loop", "cond", "while_int", "while_float")
               for s in looped.steps)
    unlooped = _found(lambda r: len(r.steps) >= 6, loops=False)
    assert all(FAMILIES[s.family].group != "loop" for s in unlooped.steps)


def test_a_users_own_family_is_drawn_and_built_both_ways():
    def softsign(x):
        return x / (1.0 + jnp.abs(x))

    def draw(chooser, slots):
        floats = [k for k, s in enumerate(slots) if s.kind == "float"]
        return Proposal((chooser.choice(floats),), {}, 1.0)

    register(Family("softsign", softsign, draw, "elementwise"))
    try:
        recipe = _found(lambda r: any(s.family == "softsign" for s in r.steps),
                        families=["softsign"])
        g = jg.testing.build.to_graph(recipe)
        traced = jg.testing.build.Program(recipe).trace()
        assert str(dce(g)).split("\n#")[0] == str(dce(traced)).split("\n#")[0]
        assert "div" in {e.op for e in g.eqns}
    finally:
        del FAMILIES["softsign"]
