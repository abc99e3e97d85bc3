"""Testing helpers for users' own test suites: `check_grads` and hypothesis strategies.

- `check_grads(fn, args, order)`: jgraph's derivatives of `fn` against central finite differences
  in float64 (`jgraph.testing.grads`).
- `graphs()`: a hypothesis strategy drawing `(graph, args)`, random well-formed forward graphs
  built directly as IR, with example arguments; `programs()`: drawing `(fn, args)`, random JAX
  functions of the same kind, so that `jg.trace` is exercised too. Both are built from a `Recipe`
  (`jgraph.testing.recipe`) of op families (`jgraph.testing.families`), to which users can add
  their own with `register`. hypothesis is imported only when a strategy is asked for.

The families (`family_*`) register into the registry (`families`) when this package imports them.
"""

from __future__ import annotations

from jgraph.testing import (  # registration into FAMILIES, by group
    family_integer,
    family_loops,
    family_math,
    family_shapes,
    strategies,
)
from jgraph.testing.families import FAMILIES, Family, Proposal, register
from jgraph.testing.grads import check_grads
from jgraph.testing.options import TestingOptionError, known_options
from jgraph.testing.recipe import Chooser, Recipe, Slot

__all__ = ["FAMILIES", "Chooser", "Family", "Proposal", "Recipe", "Slot", "TestingOptionError",
           "check_grads", "family_integer", "family_loops", "family_math", "family_shapes",
           "graphs", "programs", "recipes", "register", "strategies"]


def graphs(**options):
    """Hypothesis strategy of `(graph, args)` (see `jgraph.testing.strategies.graphs`)."""
    return strategies.graphs(**options)


def programs(**options):
    """Hypothesis strategy of `(fn, args)` (see `jgraph.testing.strategies.programs`)."""
    return strategies.programs(**options)


def recipes(**options):
    """Hypothesis strategy of `Recipe`s (see `jgraph.testing.strategies.recipes`)."""
    known_options(options, "jg.testing.recipes")
    return strategies.recipes(**options)
