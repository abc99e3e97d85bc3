"""VJP rules: for each differentiable op, the cotangents of its inputs, emitted as IR eqns.

A rule is a JAX function `rule(cts, ins, outs, **params) -> cotangent per input (or None)`, where
`cts`, `ins` and `outs` are tuples of arrays. The backward pass traces it once per (rule, params,
avals) and replays it as eqns (`jgraph.builder.Builder.call`), so rules read like JAX code and
what they emit is ordinary IR. Families share helpers (`defunary`, `defbinary`, `unbroadcast`).
Where cheap, a rule uses the same formula as JAX's, so that gradients agree bitwise.

The tables and their helpers belong to `jgraph.backward`, which reads them and knows no op (as
JAX's `ad.py`). The rules live by op family in the submodules (`elementwise`, `structural`,
`indexing`, `contractions`, `reductions`, `linalg`, `fft`, `linear_solve`, `collectives`,
`custom`, and `loops` for scan and cond); each registers into `jgraph.backward`'s tables, and
importing this package registers them all.

Ops in NON_DIFFERENTIABLE (`jgraph.ops`) have no floating outputs that depend differentiably on
their inputs (their gradient is zero, as in JAX); ops in CUTS_GRADIENT stop gradient flow. Any
other op met on the gradient path without a rule is an error naming the op and the user's source
line (never a silent zero).
"""

from __future__ import annotations

from jgraph.backward import (
    NO_VJP_RULE,
    add_cotangents,
    apply_rule,
    defbinary,
    deflinear,
    defunary,
    defvjp,
    unbroadcast,
    undifferentiable_inputs,
    vjp_rules,
)
from jgraph.ops import CUTS_GRADIENT, NON_DIFFERENTIABLE
from jgraph.vjp_rules import (  # registration, by op family
    collectives,
    contractions,
    custom,
    elementwise,
    fft,
    indexing,
    linalg,
    linear_solve,
    loops,
    reductions,
    structural,
)

__all__ = ["CUTS_GRADIENT", "NON_DIFFERENTIABLE", "NO_VJP_RULE", "add_cotangents", "apply_rule",
           "collectives", "contractions", "custom", "defbinary", "deflinear", "defunary", "defvjp",
           "elementwise", "fft", "indexing", "linalg", "linear_solve", "loops", "reductions",
           "structural", "unbroadcast", "undifferentiable_inputs", "vjp_rules"]
