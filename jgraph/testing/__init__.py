"""Testing helpers for users' own test suites: `check_grads` and hypothesis strategies.

- `check_grads(fn, args, order)`: jgraph's derivatives of `fn` against central finite differences
  in float64 (`jgraph.testing.grads`).
- `graphs()`: a hypothesis strategy drawing `(graph, args)`, random well-formed forward graphs
  built directly as IR, with example arguments; `programs()`: drawing `(fn, args)`, random JAX
  functions of the same kind, so that `jg.trace` is exercised too. Both are built from a `Recipe`
  (`jgraph.testing.recipe`) of op families (`jgraph.testing.families`), to which users can add
  their own with `register`. hypothesis is imported only when a strategy is asked for.
"""

from __future__ import annotations

from jgraph.testing.families import FAMILIES, Family, Proposal, register
from jgraph.testing.grads import check_grads
from jgraph.testing.options import TestingOptionError
from jgraph.testing.recipe import Chooser, Recipe, Slot

__all__ = ["FAMILIES", "Chooser", "Family", "Proposal", "Recipe", "Slot", "TestingOptionError",
           "check_grads", "graphs", "programs", "recipes", "register"]


def graphs(**options):
    """Hypothesis strategy of `(graph, args)` (see `jgraph.testing.strategies.graphs`)."""
    from jgraph.testing import strategies

    return strategies.graphs(**options)


def programs(**options):
    """Hypothesis strategy of `(fn, args)` (see `jgraph.testing.strategies.programs`)."""
    from jgraph.testing import strategies

    return strategies.programs(**options)


def recipes(**options):
    """Hypothesis strategy of `Recipe`s (see `jgraph.testing.strategies.recipes`)."""
    from jgraph.testing import strategies
    from jgraph.testing.options import known_options

    known_options(options, "jg.testing.recipes")
    return strategies.recipes(**options)
