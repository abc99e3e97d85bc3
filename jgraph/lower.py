"""Lowering: a graph -> a `jax.jit` callable with the traced function's pytree signature.

The lowered function is the interpreter loop run on JAX tracers: each eqn binds its op's lowering.
The result composes with the user's own `jax.jit`, `vmap` and donated steps like any JAX function.

Recompute protection. A recomputed eqn is the same op on the same values as its forward original,
so XLA's CSE would merge the two and keep the forward value alive: the remat would save nothing.
`optimization_barrier` does not prevent that on XLA:CPU, whose `cse_barrier_expander` deletes
barriers before CSE (jax-ml/jax#19822). So the lowering makes each group of consecutive `no_cse`
eqns data dependent on the anchor: the latest value computed from the graph's inputs before the
group (a backward cotangent, or the loss; never a constant, which XLA would fold). In each eqn of
the group that reads no value the group already protects, one input x (the smallest non-param)
is read as

    select(c < -|c|, zeros, x)    with c = the first element of the anchor,

which is `x` bit for bit: `c < -|c|` is false for every float (c >= 0: c < -c fails; c < 0:
c < c fails; NaN and -0.0 compare false). It is not an identity of one value (such as `c < c`,
which a simplifier may legally fold to false) but a fact about two different values that only
reasoning about the sign of `abs` proves, which XLA's simplifier does not do. The recompute
therefore differs from the forward for CSE, and it cannot start before the anchor exists, i.e.
before the backward has reached it. This holds with default flags, on every backend, inside a
user's own jit and under vmap (tests count the recomputed dots in the compiled HLO).

Fusion cuts. XLA:CPU fuses a cheap elementwise producer into every reader, duplicating it, and
does so transitively. In a backward, the cotangent of a residual stream is a chain of such adds
over every layer, read by several transposing fusions (the operands of weight-gradient dots): each
of them recomputes the whole chain, with strided reads (a 6-layer transformer's step spends half
its time there, in jgraph and in JAX alike). So on CPU the lowering materialises each backward
value that a cheap op writes at the end of a chain of at least `CUT_MIN_OPS` cheap ops, that two
or more readers read, and that is at least `CUT_MIN_BYTES` (`fusion_cuts`): it passes through
`lax.cond(c < -|c|, zeros, identity)`, with `c` its own first element, which is the identity bit
for bit (see above) and which XLA cannot fuse into. Other platforms fuse by cost and get the
value as it is (`lax.platform_dependent`). `jg.memory` counts the cut values as buffers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jgraph import opkinds
from jgraph.check import validate
from jgraph.interpreter import Interpreter, flatten_args, unflatten_outputs
from jgraph.ir import Graph, Var, is_float


def _taintable(aval) -> bool:
    return not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key)


def _anchorable(aval) -> bool:
    return is_float(aval) and not jnp.issubdtype(aval.dtype, jnp.complexfloating) \
        and aval.size > 0


def protection_plan(graph: Graph):
    """For each `no_cse` eqn: (its group, the input position to taint, or None if it reads a value
    the group already protects); for each group, the anchor variable it waits for (or None)."""
    plan, anchors = {}, []
    params = set(graph.inputs_with_role("param"))
    protected: set[Var] = set()  # outputs of no_cse eqns: already distinct from the forward
    latest = next((v for v in graph.inputs if _anchorable(v.aval)), None)
    varying = set(graph.inputs)  # values XLA cannot fold to constants
    in_group = False
    for eqn in graph.eqns:
        if "no_cse" not in eqn.tags:
            in_group = False
            if any(a in varying for a in eqn.inputs if isinstance(a, Var)):
                varying.update(eqn.outputs)
                if "recompute" not in eqn.tags:
                    latest = next((v for v in reversed(eqn.outputs) if _anchorable(v.aval)),
                                  latest)
            continue
        varying.update(eqn.outputs)
        if not in_group:
            anchors.append(latest)
            in_group = True
        candidates = [(a in params, a.aval.size * a.aval.dtype.itemsize, k)
                      for k, a in enumerate(eqn.inputs) if isinstance(a, Var)]
        candidates = [c for c in candidates if _taintable(eqn.inputs[c[2]].aval)]
        position = None
        if latest is not None and candidates and not any(a in protected for a in eqn.inputs):
            position = min(candidates)[2]  # the cheapest input to copy: the smallest non-param
        plan[eqn] = (len(anchors) - 1, position)
        protected.update(eqn.outputs)
    return plan, anchors


CUT_MIN_BYTES = 1 << 16  # a duplicated chain of smaller values costs less than a buffer
CUT_MIN_OPS = 8  # a shorter chain recomputed in each reader costs less than a buffer
FUSION_CUTS = True  # False: lower (and model memory) without cuts, to compare (bench_cuts)


def fusion_cuts(graph: Graph) -> set[Var]:
    """The backward values the lowering materialises on CPU (module docstring): real floats of at
    least `CUT_MIN_BYTES`, read by two or more eqns of `graph`, and written by a `cheap` op at the
    end of a chain of at least `CUT_MIN_OPS` cheap ops that XLA:CPU would fuse into each of those
    readers (a cut ends a chain). Sub-graphs have their own."""
    if not FUSION_CUTS:
        return set()
    readers: dict[Var, int] = {}
    for eqn in graph.eqns:
        for a in {a for a in eqn.inputs if isinstance(a, Var)}:
            readers[a] = readers.get(a, 0) + 1
    chain: dict[Var, int] = {}  # the cheap ops a fusion reading the value recomputes
    cuts = set()
    for eqn in graph.eqns:
        if len(eqn.outputs) != 1 or opkinds.kind(eqn) != "cheap":
            continue
        out = eqn.outputs[0]
        chain[out] = 1 + sum(chain.get(a, 0) for a in eqn.inputs if isinstance(a, Var))
        if "backward" in eqn.tags and chain[out] >= CUT_MIN_OPS and readers.get(out, 0) >= 2 \
                and _cuttable(out.aval):
            cuts.add(out)
            chain[out] = 0
    return cuts


def _cuttable(aval) -> bool:
    return _anchorable(aval) and aval.size * aval.dtype.itemsize >= CUT_MIN_BYTES


def _materialise(x):
    """`x` as a buffer XLA:CPU cannot fuse its producer through (module docstring)."""
    def on_cpu(x):
        c = jnp.reshape(x, (-1,))[0]
        return lax.cond(lax.lt(c, lax.neg(lax.abs(c))), jnp.zeros_like, lambda y: y, x)

    return lax.platform_dependent(x, cpu=on_cpu, default=lambda y: y)


class Lowering(Interpreter):
    """The interpreter used for lowering; it protects recompute eqns from XLA's CSE.

    Each eqn of a group reads the group's tainted copy of a value once the group has made one.
    Only one input per eqn is tainted, the smallest that is not a param, so the copies are small
    and short-lived: they die within their group (the backward keeps reading the original).
    """

    def run(self, graph: Graph, *args):
        self.plan, self.anchors = protection_plan(graph)
        self.anchor_set = {v for v in self.anchors if v is not None}
        self.anchor_values, self.preds, self.tainted = {}, {}, {}
        self.cuts = fusion_cuts(graph)
        for v, x in zip(graph.inputs, args, strict=True):
            self._remember_anchor(v, x)
        return super().run(graph, *args)

    def _remember_anchor(self, v, x):
        if v in self.anchor_set:
            self.anchor_values[v] = x

    def eval_eqn(self, eqn, values):
        step = self.plan.get(eqn)
        if step is not None:
            group, k = step
            values = [self.tainted.get((group, a), x) if isinstance(a, Var) else x
                      for a, x in zip(eqn.inputs, values, strict=True)]
            if k is not None:
                values[k] = self._taint(group, eqn.inputs[k], values[k])
        outs = super().eval_eqn(eqn, values)
        if eqn.outputs and eqn.outputs[0] in self.cuts:
            outs = [_materialise(outs[0])]
        for v, x in zip(eqn.outputs, outs, strict=True):
            self._remember_anchor(v, x)
        return outs

    def _taint(self, group, var, x):
        if (group, var) not in self.tainted:
            if group not in self.preds:
                anchor = jnp.reshape(self.anchor_values[self.anchors[group]], (-1,))[0]
                self.preds[group] = lax.lt(anchor, lax.neg(lax.abs(anchor)))
            self.tainted[(group, var)] = jnp.where(self.preds[group], jnp.zeros_like(x), x)
        return self.tainted[(group, var)]


def as_function(graph: Graph):
    """A plain (un-jitted) JAX function running `graph`, with its pytree signature."""
    lowering = Lowering()

    def fn(*args):
        return unflatten_outputs(graph, lowering.run(graph, *flatten_args(graph, args)))

    fn.__name__ = "jgraph_graph"
    return fn


def compile(graph: Graph, *, in_shardings=None, out_shardings=None,  # noqa: A001 - fixed name
            donate_argnums=()):
    """`jax.jit` of the graph; arguments and results are pytrees as in the traced function.

    `in_shardings`, `out_shardings` and `donate_argnums` are passed to `jax.jit` as they are
    (shardings as pytree prefixes of the arguments and results, e.g. `NamedSharding`s of a
    `jax.sharding.Mesh`); None leaves the choice to JAX, as when they are not given. Sharding
    constraints met while tracing (`jax.lax.with_sharding_constraint`) are ops of the graph and
    are lowered as such."""
    validate(graph, "jg.compile")
    shardings = {"in_shardings": in_shardings, "out_shardings": out_shardings}
    return Compiled(graph, jax.jit(as_function(graph), donate_argnums=donate_argnums,
                                   **{k: v for k, v in shardings.items() if v is not None}))


class Compiled:
    """What `jg.compile` returns: the graph's `jax.jit`, called as it is, with its own `lower`,
    `trace`, `eval_shape`, ... (attributes are the jitted function's).

    `jax.jit` abstracts the arguments before the graph's own argument check runs, so a string, an
    object or a Python int beyond int32 would fail with JAX's message, which does not say what
    the graph expected there. Only when the jitted call raises is the check run: it names the
    argument and the traced signature (a JGraphError), or, for a Python scalar that the input's
    dtype holds (an int beyond int32 for a float input), converts it and calls again."""

    __slots__ = ("graph", "jitted")

    def __init__(self, graph: Graph, jitted):
        self.graph, self.jitted = graph, jitted

    def __call__(self, *args):
        try:
            return self.jitted(*args)
        except (TypeError, OverflowError):
            leaves = flatten_args(self.graph, args)  # raises the JGraphError naming the argument
            if self.graph.in_tree is None or all(
                    a is b for a, b in zip(leaves, jax.tree.leaves(tuple(args)), strict=True)):
                raise
        return self.jitted(*jax.tree.unflatten(self.graph.in_tree, leaves))

    def __getattr__(self, name):
        return getattr(self.jitted, name)

    def __repr__(self):
        return f"jg.compile({self.jitted!r})"
