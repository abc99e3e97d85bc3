"""Building a recipe: as a forward `Graph` (no tracer), as a JAX function, and its example inputs.

`to_graph(recipe)` emits each step's family function with `Builder.call` (so eqns are exactly the
IR that jgraph's own transforms emit), stamps each eqn with its checkpoint spans as regions and
with `step k (family)` as its source (so `check` and transform errors name the step), and fills
in the roles, the pytree structures, `param_argnums` and `has_aux` as `jg.trace` would.
`Program(recipe)` is the same computation as a plain JAX function: spans become `jax.checkpoint`
calls (with their policies) and names `checkpoint_name`, so tracing it exercises the tracer too.
`example_args(recipe)`: floats uniform in [-1, 1] (Python floats for weakly typed scalars), ints
in [0, INT_HIGH), random booleans.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from jgraph import policies
from jgraph.builder import Builder
from jgraph.ir import Graph, Region, Var
from jgraph.testing.families import FAMILIES, loss_of, named
from jgraph.testing.recipe import FLOAT, INT, INT_HIGH, Recipe, dtype_of
from jgraph.trace import trace

# Policy names a span may carry, and how each becomes a policy given the span's names.
POLICIES = {
    "nothing_saveable": lambda names: policies.nothing_saveable,
    "everything_saveable": lambda names: policies.everything_saveable,
    "dots_saveable": lambda names: policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": lambda names: policies.dots_with_no_batch_dims_saveable,
    "save_only_these_names": lambda names: policies.save_only_these_names(*names),
    "save_any_names_but_these": lambda names: policies.save_any_names_but_these(*names),
    "save_anything_except_these_names":
        lambda names: policies.save_anything_except_these_names(*names),
}


def policy_of(name: str | None, names=()):
    """The policy object of a policy name (None: `jax.checkpoint`'s default, saves nothing)."""
    return None if name is None else POLICIES[name](tuple(names))


def example_args(recipe: Recipe, seed: int | None = None) -> tuple:
    """Example call arguments of the recipe (numpy values; `seed` overrides the recipe's)."""
    rng = np.random.default_rng(recipe.seed if seed is None else seed)

    def value(slot_index):
        slot = recipe.slots[slot_index]
        dtype = dtype_of(recipe.dtype, slot.kind)
        if slot.kind == FLOAT:
            value = rng.uniform(-1.0, 1.0, slot.shape).astype(dtype)
            return float(value) if slot.weak else value
        if slot.kind == INT:
            return rng.integers(0, INT_HIGH, slot.shape).astype(dtype)
        return rng.random(slot.shape) < 0.5

    return tuple(value(a) if isinstance(a, int) else {k: value(j) for k, j in a}
                 for a in recipe.arguments)


def _call_structure(recipe: Recipe):
    """Treedefs of the call arguments and of the result."""
    args = tuple(0 if isinstance(a, int) else {k: 0 for k, _ in a} for a in recipe.arguments)
    result = (0, (0,) * len(recipe.aux)) if recipe.has_aux else 0
    return jax.tree.structure(args), jax.tree.structure(result)


def _roles(recipe: Recipe) -> tuple[str, ...]:
    argnums = recipe.param_argnums
    argnums = (argnums,) if isinstance(argnums, int) else argnums
    roles = []
    for i, a in enumerate(recipe.arguments):
        roles += ["param" if i in argnums else "data"] * (1 if isinstance(a, int) else len(a))
    return tuple(roles)


def to_graph(recipe: Recipe) -> Graph:
    """The recipe as a forward graph, built without the tracer."""
    slots = recipe.slots[:recipe.leaves()]
    inputs = tuple(Var(ShapedArray(s.shape, dtype_of(recipe.dtype, s.kind), weak_type=s.weak))
                   for s in slots)
    env = dict(enumerate(inputs))
    b = Builder()
    for i, step in enumerate(recipe.steps):
        b.regions = recipe.spans_of(i)
        b.source = f"step {i} ({step.family})"
        outs = b.call(FAMILIES[step.family].apply, *(env[j] for j in step.operands),
                      **dict(step.static))
        if step.name is not None:
            outs[0] = b.call(named, outs[0], name=step.name)[0]
        env.update(zip(step.outputs, outs, strict=True))
    b.regions, b.source = (), "loss"
    (loss,) = b.call(loss_of, *(env[j] for j in recipe.loss_terms))
    in_tree, out_tree = _call_structure(recipe)
    regions = tuple(Region(k, s.parent, policy_of(s.policy, s.names), s.prevent_cse, f"span{k}")
                    for k, s in enumerate(recipe.spans))
    return Graph(
        inputs=inputs,
        eqns=tuple(b.eqns),
        outputs=(loss,) + tuple(env[j] for j in recipe.aux),
        input_roles=_roles(recipe),
        output_roles=("loss",) + ("aux",) * len(recipe.aux),
        in_tree=in_tree,
        out_tree=out_tree,
        regions=regions,
        param_argnums=recipe.param_argnums,
        has_aux=recipe.has_aux,
    )


class Program:
    """The recipe as a JAX function; `param_argnums` and `has_aux` say how to trace it."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.param_argnums = recipe.param_argnums
        self.has_aux = recipe.has_aux
        self.__name__ = "program"

    def __call__(self, *args):
        leaves = jax.tree.leaves(args)
        # The program is generic in its floating dtype: called on float64 arguments (as
        # `check_grads` calls it) the values it makes from integers are float64 too, so a loop's
        # carry never mixes the drawn dtype with the arguments'.
        self.float_dtype = next((x.dtype for x in leaves
                                 if jnp.issubdtype(jnp.result_type(x), jnp.floating)),
                                np.dtype(self.recipe.dtype))
        env = dict(enumerate(leaves))
        self._run(env, 0, len(self.recipe.steps), None)
        loss = loss_of(*(env[j] for j in self.recipe.loss_terms))
        if self.has_aux:
            return loss, tuple(env[j] for j in self.recipe.aux)
        return loss

    def _run(self, env, start, stop, parent):
        i = start
        while i < stop:
            span = next((k for k, s in enumerate(self.recipe.spans)
                         if s.parent == parent and s.start == i), None)
            if span is None:
                self._step(env, i)
                i += 1
                continue
            s = self.recipe.spans[span]
            steps = self.recipe.steps[s.start:s.stop]
            defined = {j for step in steps for j in step.outputs}
            reads = sorted({j for step in steps for j in step.operands} - defined)
            writes = sorted(defined)
            body = functools.partial(self._region, span=span, reads=reads, writes=writes)
            region = jax.checkpoint(body, policy=policy_of(s.policy, s.names),
                                    prevent_cse=s.prevent_cse)
            env.update(zip(writes, region(*(env[j] for j in reads)), strict=True))
            i = s.stop

    def _region(self, *values, span, reads, writes):
        env = dict(zip(reads, values, strict=True))
        s = self.recipe.spans[span]
        self._run(env, s.start, s.stop, span)
        return [env[j] for j in writes]

    def _step(self, env, i):
        step = self.recipe.steps[i]
        static = dict(step.static)
        if static.get("dtype") == self.recipe.dtype:  # a float made from ints or from nothing
            static["dtype"] = self.float_dtype
        out = FAMILIES[step.family].apply(*(env[j] for j in step.operands), **static)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if step.name is not None:
            outs[0] = named(outs[0], name=step.name)
        env.update(zip(step.outputs, outs, strict=True))

    def trace(self, *args):
        """`jg.trace` of this program on `args` (its example arguments if none are given)."""
        args = args or example_args(self.recipe)
        return trace(self, *args, param_argnums=self.param_argnums, has_aux=self.has_aux)

    def __repr__(self):
        return str(self.recipe)
