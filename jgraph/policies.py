"""Remat policies: which values a checkpoint region saves for its backward, by the producing eqn.

A policy is a callable `policy(prim, *in_avals, **params)`, exactly as `jax.checkpoint(policy=...)`
takes, so the policies here work in `jax.checkpoint` too, and JAX's own policy objects recorded by
the tracer work in `jgraph.regions`. `prim` is the JAX primitive of the eqn's op (a stand-in with a
`name` for jgraph's own ops). A policy answers True (save) or False (recompute), or one of JAX's
`Saveable` / `Recompute` / `Offloadable` markers; offloading is treated as saving.

Every name of `jax.checkpoint_policies` is here. `save_anything_except_these_names` really excludes
its names (JAX 0.10.2's version ignores them): `jgraph.regions` also refuses to save the value under
the excluded name through its unnamed producer, which is the same array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from jax import ad_checkpoint as _jax_ad_checkpoint

from jgraph import ops
from jgraph.errors import TransformError
from jgraph.ir import sub_graphs

_JAX = _jax_ad_checkpoint.checkpoint_policies

# The policies whose meaning is the same in JAX and jgraph are JAX's own objects.
everything_saveable = _JAX.everything_saveable
nothing_saveable = _JAX.nothing_saveable
dots_saveable = checkpoint_dots = _JAX.dots_saveable
dots_with_no_batch_dims_saveable = _JAX.dots_with_no_batch_dims_saveable
checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable
offload_dot_with_no_batch_dims = _JAX.offload_dot_with_no_batch_dims
save_only_these_names = _JAX.save_only_these_names
save_any_names_but_these = _JAX.save_any_names_but_these
save_from_both_policies = _JAX.save_from_both_policies
save_and_offload_only_these_names = _JAX.save_and_offload_only_these_names


@dataclass(frozen=True)
class SaveAnythingExceptTheseNames:
    """Save every value except those named (by `checkpoint_name`) with one of `excluded_names`."""

    excluded_names: frozenset[str]

    def __call__(self, prim, *_, **params):
        return not (prim.name == "name" and params.get("name") in self.excluded_names)


def save_anything_except_these_names(*names):
    """Save any values (not only named ones) except the values named with one of `names`."""
    return SaveAnythingExceptTheseNames(frozenset(names))


def excluded_names(policy) -> frozenset[str]:
    """Names whose values `policy` refuses to save under any alias (empty for most policies)."""
    return getattr(policy, "excluded_names", frozenset())


@dataclass(frozen=True, eq=False)
class SaveValues:
    """The remat planner's policy: save exactly the values in `values` (variables of the graph
    being planned, by identity), whatever their op. It names values, not ops, so it only means
    something to `jg.remat` on that graph; `jax.checkpoint` cannot use it."""

    values: frozenset  # of jgraph.ir.Var
    label: str = "planned"  # how reports and printed regions name it

    def __call__(self, prim, *_, **params):
        raise TransformError("a planner's SaveValues policy chooses variables of one jgraph "
                             "graph; it cannot answer for a JAX primitive")

    @property
    def __name__(self):
        return f"{self.label}({len(self.values)} values saved)"


@dataclass(frozen=True)
class _OpStandIn:
    """What a policy sees as `prim` for jgraph's own ops, which are not JAX primitives."""

    name: str


def saves_inside(policy, eqn) -> bool:
    """Does `policy` save some eqn of `eqn`'s bodies (nested bodies included)?"""
    if policy is None:
        return False
    return any(saves(policy, e) or saves_inside(policy, e)
               for sub in sub_graphs(eqn) for e in sub.eqns)


def saves(policy, eqn) -> bool:
    """Does `policy` save the outputs of `eqn`? (None saves nothing, as in `jax.checkpoint`.)

    A policy answers a bool or one of JAX's markers; `Offloadable` is treated as saving (on the
    device). Any other answer (None, 0, a string) is an error, as in JAX, never read as 'save'."""
    if policy is None:
        return False
    if isinstance(policy, SaveValues):
        return any(v in policy.values for v in eqn.outputs)
    if not callable(policy):
        raise TransformError(f"remat policy {policy!r} is not callable; use one of "
                             "jg.policies (or a function (prim, *avals, **params) -> bool)")
    prim = ops.primitives.get(eqn.op) or _OpStandIn(eqn.op)
    try:
        answer = policy(prim, *(a.aval for a in eqn.inputs), **eqn.params)
    except TypeError as e:
        raise TransformError(f"remat policy {policy_name(policy)} cannot be called as "
                             f"policy(prim, *avals, **params): {e}") from e
    if isinstance(answer, (bool, np.bool_)):
        return bool(answer)
    if answer is _jax_ad_checkpoint.Recompute:
        return False
    if answer is _jax_ad_checkpoint.Saveable or isinstance(answer,
                                                           _jax_ad_checkpoint.Offloadable):
        return True
    raise TransformError(f"remat policy {policy_name(policy)} answered {answer!r} for op "
                         f"{eqn.op!r}; a policy must answer True/False or a "
                         "jax.ad_checkpoint marker (Saveable, Recompute, Offloadable)")


def policy_name(policy) -> str:
    if policy is None:
        return "nothing_saveable"
    return getattr(policy, "__name__", type(policy).__name__)

