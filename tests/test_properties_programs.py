"""Properties of the tracer over random JAX programs (`jg.testing.programs()`): checkpoint regions
are `jax.checkpoint`s with policies, named values `checkpoint_name`, relu/softplus `custom_jvp`,
and one family a `custom_vjp`.

- `jg.trace` gives, after DCE, exactly the graph `graphs()` builds from the same recipe without the
  tracer (same printed eqns, same region nesting and CSE flags);
- the traced graph computes what the program computes (JAX running the program itself);
- `backward` of the traced graph equals `jax.value_and_grad` of the program (JAX's own rules,
  including the user's custom_jvp/custom_vjp and checkpoints), in float32 and float64.
"""

from __future__ import annotations

import jax
import pytest
from hypothesis import given
from properties import assert_close, examples, jitted, tolerance

import jgraph as jg
from jgraph.passes import dce
from jgraph.testing.build import to_graph


def _without_region_names(text: str) -> str:
    return text.split("\n# region")[0]  # region names differ: span<k> vs the checkpointed fn


@examples(40)
@given(jg.testing.programs())
def test_tracing_a_program_gives_the_graph_built_without_the_tracer(drawn):
    fn, args = drawn
    traced = jg.check(fn.trace(*args))
    built = to_graph(drawn.recipe)
    assert _without_region_names(str(dce(traced))) == _without_region_names(str(dce(built)))
    assert [(r.parent, r.prevent_cse) for r in traced.regions] == \
        [(r.parent, r.prevent_cse) for r in built.regions]
    assert traced.input_roles == built.input_roles and traced.output_roles == built.output_roles
    assert traced.in_tree == built.in_tree and traced.out_tree == built.out_tree


def _traced_equals_jax(drawn):
    fn, args = drawn
    g = fn.trace(*args)
    tol = tolerance(g.inputs[0].aval.dtype)
    assert_close(jg.evaluate(g, *args), jitted(fn, *args)(*args), tol)
    want = jitted(jax.value_and_grad(fn, argnums=fn.param_argnums, has_aux=fn.has_aux),
                  *args)(*args)
    assert_close(jg.compile(jg.backward(g))(*args), want, tol)


@examples(10)
@given(jg.testing.programs())
def test_traced_program_and_its_backward_equal_jax(drawn):
    _traced_equals_jax(drawn)


@pytest.mark.f64  # the float32 test's check in float64: a few examples in the ci run
@examples(2)
@given(jg.testing.programs())
def test_traced_program_and_its_backward_equal_jax_f64(drawn):
    _traced_equals_jax(drawn)
