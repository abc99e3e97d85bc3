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
user's own jit and under vmap (tests count the recomputed dots in the compiled HLO). An eqn is
left untainted where neither is at stake: its group's anchor is one of the graph's inputs (it
waits for nothing: a loop body's recompute at the start of an iteration) and no other eqn of the
graph is its twin for CSE (the forward original is in another body). A taint there only copied a
value (a scanned MLP's 64 KiB weight slice per backward iteration).

Where the tainted value is one XLA writes anyway (a forward contraction reads it) and its producer
is an elementwise op that XLA:CPU would duplicate into the select, reading a value nothing after
the forward reads (a U-Net's innermost level: its decoder's input `h + h`), the select would keep
that value alive from the forward until the backward reaches the taint, beside the tainted one.
There the taint on CPU is the conditional of the fusion cuts below (`read_through_cond`), which
XLA cannot fuse into; it costs a few bytes of tuples, so it is used only there.

Fusion cuts. XLA:CPU fuses a cheap elementwise producer into every reader, duplicating it, and
does so transitively. In a backward, the cotangent of a residual stream is a chain of such adds
over every layer, read by several loop fusions and by the transposed copies XLA makes of
weight-gradient dot operands: each of them recomputes the whole chain, with strided reads (a
6-layer transformer's step spends half its time there, in jgraph and in JAX alike). So on CPU
the lowering materialises a backward value where that pays (`fusion_cuts`: the chain's work times
the fusions that would recompute it, against a buffer and the cut itself), not where its readers
are dots and reductions that read a buffer XLA writes anyway (an MLP's backward). A cut passes
the value through `lax.cond(c < -|c|, zeros, identity)`, with `c` its own first element, which is
the identity bit for bit (see above) and which XLA cannot fuse into: a conditional is a kernel
boundary that no XLA pass removes. (An `optimization_barrier` is deleted before fusion on CPU; a
division by a runtime one is rewritten as a multiply by its reciprocal, which fuses; a `while`
of one trip whose body passes the value on is simplified away: of what stays, the conditional
costs least.) Other platforms fuse by cost and get the value as it is (`lax.platform_dependent`).
`jg.memory` counts the cut values as buffers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jgraph import opkinds
from jgraph.check import validate
from jgraph.interpreter import Interpreter, flatten_args, unflatten_outputs
from jgraph.ir import Eqn, Graph, Var, is_float
from jgraph.roles import donated_buffers, updated_inputs
from jgraph.target import STATE_ROLES, TargetError, resolve


def _taintable(aval) -> bool:
    return not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key)


def _anchorable(aval) -> bool:
    return is_float(aval) and not jnp.issubdtype(aval.dtype, jnp.complexfloating) \
        and aval.size > 0


def protection_plan(graph: Graph):
    """For each `no_cse` eqn: (its group, the input position to taint, or None if it reads a value
    the group already protects or needs no taint: the module docstring); for each group, the
    anchor variable it waits for (or None)."""
    plan, anchors = {}, []
    params = set(graph.inputs_with_role("param"))
    originals: set = set()  # what CSE compares of the other eqns, once a group needs it
    inputs = set(graph.inputs)
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
        waits = anchors[-1] not in inputs  # the anchor is computed: the group waits for it
        if not waits and not originals:
            originals = {_cse_key(e) for e in graph.eqns if "no_cse" not in e.tags} | {None}
        if (latest is not None and candidates and not any(a in protected for a in eqn.inputs)
                and (waits or _cse_key(eqn) in originals)):
            position = min(candidates)[2]  # the cheapest input to copy: the smallest non-param
        plan[eqn] = (len(anchors) - 1, position)
        protected.update(eqn.outputs)
    return plan, anchors


def _cse_key(eqn: Eqn):
    """What CSE compares of an eqn (its op, params and inputs), or None when its params do not
    hash (then it is taken to have a twin)."""
    key = (eqn.op, tuple(sorted(eqn.params.items())),
           tuple(a if isinstance(a, Var) else ("literal", repr(a)) for a in eqn.inputs))
    try:
        hash(key)
    except TypeError:
        return None
    return key


BUFFER_READERS = frozenset({"dot", "loop", "opaque"})  # `opkinds` kinds: read buffers, not fused


def read_through_cond(graph: Graph, plan: dict) -> set[Var]:
    """The tainted inputs of `plan` (`protection_plan`) that the taint reads through a
    conditional on CPU (module docstring): values XLA writes anyway (a forward contraction, loop
    or opaque op reads them) whose producer it would duplicate into a select (an elementwise op
    that does not read more than it writes, `opkinds.shrinks`; bitcasts looked through), when
    that producer reads a value nothing after the forward reads: the select would keep it
    alive until the backward reaches the taint."""
    producer = {v: e for e in graph.eqns for v in e.outputs}
    inputs = set(graph.inputs)
    later = {a for e in graph.eqns if {"backward", "recompute"} & e.tags for a in e.inputs
             if isinstance(a, Var)} | {a for a in graph.outputs if isinstance(a, Var)}
    buffered = {a for e in graph.eqns if not {"backward", "recompute"} & e.tags
                and opkinds.kind(e) in BUFFER_READERS for a in e.inputs if isinstance(a, Var)}

    def broadcast(a) -> bool:
        return not isinstance(a, Var) or (
            a in producer and producer[a].op in ("broadcast_in_dim", "iota"))

    def duplicated_over_dead(v) -> bool:
        while v in producer:
            eqn = producer[v]
            src = opkinds.aliases(eqn)
            if src is None:
                read = [a for a in eqn.inputs if isinstance(a, Var)]
                return (opkinds.kind(eqn) == "cheap" and not opkinds.shrinks(eqn, broadcast)
                        and any(a.aval.size == v.aval.size and not broadcast(a) for a in read)
                        and any(a not in later and a not in inputs for a in read))
            v = eqn.inputs[src[eqn.outputs.index(v)]]
            if not isinstance(v, Var):
                return False
        return False

    tainted = {eqn.inputs[k] for eqn, (_, k) in plan.items() if k is not None}
    return {v for v in tainted if v in buffered and duplicated_over_dead(v)}


CUT_MIN_BYTES = 1 << 16  # below this a cut's fixed cost (a conditional thunk) outweighs any gain
# The cost rule (`fusion_cuts`), per element of the value, in units of one cheap elementwise op:
EXPENSIVE_OP = 4  # a fused transcendental or divide costs about four cheap ops
BUFFER = 2  # writing a value that XLA would not otherwise materialise, and reading it back
CUT = 2  # the conditional around a cut: it moves the value once more (read and write)
FUSIONS_SEEN = 64  # more reading fusions than this all count as this many (bounds the sets)
FUSION_CUTS = True  # False: lower (and model memory) without cuts, to compare (bench_cuts)


def fusion_cuts(graph: Graph) -> set[Var]:
    """The backward values the lowering materialises on CPU (module docstring): a value written
    by a cheap op, of at least `CUT_MIN_BYTES`, where

        chain x (fusions - 1)  >  CUT + (BUFFER unless XLA materialises it anyway)

    `chain` is the work XLA fuses into the value (cheap ops 1, expensive ones `EXPENSIVE_OP`,
    back to the nearest buffers and cuts), `fusions` the number of XLA fusions that would each
    compute it (`reading_fusions`): every fusion but one recomputes the chain; the cut computes
    it once, at the price of the conditional and, unless a dot or another kernel that reads
    buffers already makes XLA write it, of a buffer. A value is a candidate only where the
    fusions part (no single reader leads to all of them): a cut at the end of a chain that the
    same fusions read saves what a cut anywhere before it would, and more. Cuts are decided in
    schedule order (a cut resets the chains after it), with the fusions counted as if no value
    were cut, then once more with the fusions counted around the cuts found (a cut downstream
    leaves fewer fusions to recompute a value upstream), so that only cuts that still pay stay.
    Sub-graphs have their own."""
    if not FUSION_CUTS:
        return set()
    cuts = _decide(graph, *reading_fusions(graph, set()))
    return _decide(graph, *reading_fusions(graph, cuts)) if cuts else cuts


def _decide(graph: Graph, fusions: dict, fans_out: set) -> set[Var]:
    """The cuts the rule of `fusion_cuts` makes, given each value's reading fusions."""
    chain: dict[Var, float] = {}  # the work of a value's fusion, in cheap ops per element
    cuts = set()
    for eqn in graph.eqns:
        kind = opkinds.kind(eqn)
        if len(eqn.outputs) != 1 or kind not in ("cheap", "expensive", "alias"):
            continue
        out = eqn.outputs[0]
        upstream = sum(chain.get(a, 0) for a in eqn.inputs if isinstance(a, Var))
        if kind == "alias":
            chain[out] = upstream
            continue
        chain[out] = (1 if kind == "cheap" else EXPENSIVE_OP) + upstream
        found = fusions.get(out, ())
        if found == {out}:
            chain[out] = 0  # materialised once: every reader reads the buffer
        if len(found) <= 1:
            continue
        cost = CUT + (0 if out in found else BUFFER)
        if (
            kind == "cheap"
            and "backward" in eqn.tags
            and out in fans_out
            and _cuttable(out.aval)
            and chain[out] * (len(found) - 1) > cost
        ):
            cuts.add(out)
            chain[out] = 0
    return cuts


def reading_fusions(graph: Graph, cuts: set[Var]) -> tuple[dict[Var, frozenset], set[Var]]:
    """For each value an elementwise op writes: the XLA:CPU fusions that would compute it (after
    `opkinds`), each named by what it writes. A reader that fuses the value (a loop fusion, a
    YNNPACK reduction of a value nothing else reads) computes it in the fusion that writes the
    reader's own result, or, where XLA duplicates that result into its readers in turn, in each
    of theirs; a reader that reads buffers (a dot, a loop, an opaque op), a graph output and a
    cut make XLA write the value itself. A value XLA does not duplicate (an expensive op; one
    that reads more than it writes, when it is written anyway) is written once, and its readers
    read that; but a dot's transposed copy of its operand (`_transposed_copy`) recomputes the
    value whatever it is, with strided reads. Also returns the values where the fusions part:
    those no single reader passes all of them on from (the last value of a chain that one
    fusion reads is where a cut saves the most)."""
    readers: dict[Var, list] = {}
    producer = {}
    for eqn in graph.eqns:
        for k, a in enumerate(eqn.inputs):
            if isinstance(a, Var):
                readers.setdefault(a, []).append((eqn, k))
        for v in eqn.outputs:
            producer[v] = eqn
    outputs = {a for a in graph.outputs if isinstance(a, Var)}

    def broadcast(a):
        return a in producer and producer[a].op in ("broadcast_in_dim", "iota")

    fusions: dict[Var, frozenset] = {}
    fans_out = set()
    for eqn in reversed(graph.eqns):
        kind = opkinds.kind(eqn)
        if len(eqn.outputs) != 1 or kind not in ("cheap", "expensive", "alias"):
            continue
        out = eqn.outputs[0]
        found, copies, written, branches = set(), set(), out in outputs, []
        for reader, k in readers.get(out, ()):
            into = _fuses(reader, k, eqn, readers[out])
            if into is None:
                written = True
            elif isinstance(into, tuple):
                copies.add(into)
            else:
                branches.append({into} if into in cuts else fusions.get(into, {into}))
                found |= branches[-1]
        duplicable = kind in ("cheap", "alias") or opkinds.always_duplicated(eqn)
        if (not duplicable and len(found) > 1) or (written and opkinds.shrinks(eqn, broadcast)):
            found, branches = set(), []
            written = True
        found = frozenset(list(found | copies | ({out} if written else set()))[:FUSIONS_SEEN])
        fusions[out] = found
        if all(b != found for b in branches):
            fans_out.add(out)
    return fusions, fans_out


def _fuses(reader: Eqn, k: int, producer: Eqn, readers: list) -> Var | tuple | None:
    """The value whose fusion computes the producer's result for `reader`'s input `k`, or
    `(reader, k)` for a transposed copy of a dot operand (None: the reader reads a buffer)."""
    kind = opkinds.kind(reader)
    if len(reader.outputs) != 1:
        return None
    out = reader.outputs[0]
    if kind in ("cheap", "alias") or (
        kind in ("expensive", "reduce")
        and not (opkinds.kind(producer) == "expensive" and opkinds.reuses(reader, k))
    ):
        return out
    if kind == "dot" and k < 2 and _transposed_copy(reader, k):
        return (reader, k)  # XLA's transposed copy of the operand: a fusion of its own
    if kind == "library" and len(readers) == 1:
        return out
    return None


def _transposed_copy(dot: Eqn, k: int) -> bool:
    """Whether XLA:CPU copies operand `k` of a dot into another layout (`opkinds`)."""
    return opkinds.dot_operand_layout(dot, k) is not None


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

    scoped = False  # each of the graph's own eqns lowered under the name scope `e<index>`

    def __init__(self, scoped: bool = False):
        self.scoped = scoped

    def run(self, graph: Graph, *args):
        self.index = {e: i for i, e in enumerate(graph.eqns)} if self.scoped else {}
        self.plan, self.anchors = protection_plan(graph)
        self.anchor_set = {v for v in self.anchors if v is not None}
        self.anchor_values, self.preds, self.tainted = {}, {}, {}
        self.cuts = fusion_cuts(graph)
        self.through_cond = read_through_cond(graph, self.plan) if self.plan else set()
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
        if eqn in self.index:  # XLA's metadata names the eqn each instruction comes from
            with jax.named_scope(f"e{self.index[eqn]}"):
                outs = super().eval_eqn(eqn, values)
        else:
            outs = super().eval_eqn(eqn, values)
        if eqn.outputs and eqn.outputs[0] in self.cuts:
            outs = [_materialise(outs[0])]
        for v, x in zip(eqn.outputs, outs, strict=True):
            self._remember_anchor(v, x)
        return outs

    def _taint(self, group, var, x):
        if (group, var) not in self.tainted:
            anchor = self.anchor_values[self.anchors[group]]
            if group not in self.preds:
                first = jnp.reshape(anchor, (-1,))[0]
                self.preds[group] = lax.lt(first, lax.neg(lax.abs(first)))
            taint = _taint_through_cond if var in self.through_cond else _taint_by_select
            self.tainted[(group, var)] = taint(x, self.preds[group], anchor)
        return self.tainted[(group, var)]


def _taint_by_select(x, pred, anchor):
    return lax.platform_dependent(x, pred, anchor, tpu=_tied_by_barrier, default=_select)


def _select(x, pred, anchor):
    return jnp.where(pred, jnp.zeros_like(x), x)


def _tied_by_barrier(x, pred, anchor):
    """`x` tied to the whole anchor, as JAX's remat ties its recompute to the cotangent: TPU's
    simplifier computes one element of a product alone (`slice(dot)` becomes a product of the
    slice), so a tie to the anchor's first element lets the recompute start in the forward."""
    return lax.optimization_barrier((anchor, x))[1]


def _taint_through_cond(x, pred, anchor):
    """`x`, tainted by `pred`, as a buffer XLA:CPU cannot fuse `x`'s producer into (module
    docstring); a select elsewhere."""
    def on_cpu(y, pred, anchor):
        return lax.cond(pred, jnp.zeros_like, lambda z: z, y)

    return lax.platform_dependent(x, pred, anchor, cpu=on_cpu, default=_taint_by_select)


def as_function(graph: Graph):
    """A plain (un-jitted) JAX function running `graph`, with its pytree signature."""
    lowering = Lowering()

    def fn(*args):
        return unflatten_outputs(graph, lowering.run(graph, *flatten_args(graph, args)))

    fn.__name__ = "jgraph_graph"
    return fn


def donation_order(graph: Graph, donated) -> tuple[int, ...]:
    """The graph's output positions in the order to hand them to `jax.jit`, so that each donated
    input's new value is written into that input's buffer: new values first, in their inputs'
    order, then the other outputs in theirs; the graph's own order where it pairs them so. JAX
    aliases each result to the first unused donated argument of its shape and dtype, results in
    order; in the graph's own order a step's accumulators (or its gradients) may come before its
    params and take their buffers, and XLA then copies each crossed state in and out of a loop
    that updates it (`donated`: per input)."""
    index = {v: k for k, v in enumerate(graph.inputs)}
    updated = updated_inputs(graph)
    own = list(range(len(graph.outputs)))
    if _aliased_as_updated(graph, donated, own, updated):
        return tuple(own)  # (the program XLA compiles stays as the graph has it)
    paired = sorted((index[v], k) for k, v in enumerate(updated)
                    if v is not None and donated[index[v]])
    first = [k for _, k in paired]
    taken = set(first)
    return tuple(first + [k for k in own if k not in taken])


def _aliased_as_updated(graph: Graph, donated, order, updated) -> bool:
    """Whether JAX, given the outputs in `order`, aliases each donated input's new value to it."""
    buffers = donated_buffers([v for v, d in zip(graph.inputs, donated, strict=True) if d],
                              [graph.outputs[k] for k in order])
    return all(b is None or updated[k] is None or b is updated[k]
               for k, b in zip(order, buffers, strict=True))


class InDonationOrder:
    """A jitted function returning flat results in `order` (`donation_order`); called, it
    returns them in their own order, as `restore(list)` makes them (the graph's pytree). Its
    other attributes (`lower`, ...) are the jitted function's: results in donation order."""

    __slots__ = ("jitted", "order", "restore")

    def __init__(self, jitted, order, restore=list):
        self.jitted, self.order, self.restore = jitted, order, restore

    def __call__(self, *args):
        flat = [None] * len(self.order)
        for k, out in zip(self.order, self.jitted(*args), strict=True):
            flat[k] = out
        return self.restore(flat)

    def __getattr__(self, name):  # `lower`, `trace`, `_cache_size`: the jitted function's
        return getattr(self.jitted, name)


def jit_donated(graph: Graph, donate_argnums=(), out_shardings=None, **jit_kwargs):
    """`jax.jit(as_function(graph), donate_argnums=..., ...)` with each donated input's new value
    aliased to that input (`donation_order`), called as that jit is."""
    donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else donate_argnums
    if graph.in_tree is None:
        sizes = [1] * len(graph.inputs)
    else:
        sizes = [t.num_leaves for t in graph.in_tree.children()]
    donated = [i in donate_argnums for i, n in enumerate(sizes) for _ in range(n)]
    order = donation_order(graph, donated)
    lowering = Lowering()

    def fn(*args):
        outs = lowering.run(graph, *flatten_args(graph, args))
        return tuple(outs[k] for k in order)

    fn.__name__ = "jgraph_graph"
    if out_shardings is not None:  # a prefix of the graph's results: one per flat output
        unset = object()  # None there leaves a subtree's shardings to JAX; a leaf here
        marked = jax.tree.map(lambda s: unset if s is None else s, out_shardings,
                              is_leaf=lambda s: s is None)
        skeleton = unflatten_outputs(graph, list(range(len(graph.outputs))))
        flat = [None if s is unset else s
                for s in jax.tree.leaves(jax.tree.broadcast(marked, skeleton))]
        jit_kwargs["out_shardings"] = tuple(flat[k] for k in order)
    return InDonationOrder(jax.jit(fn, donate_argnums=donate_argnums, **jit_kwargs), order,
                           lambda flat: unflatten_outputs(graph, flat))


def compile(graph: Graph, *, in_shardings=None, out_shardings=None,  # noqa: A001 - fixed name
            donate_argnums=(), target=None):
    """`jax.jit` of the graph; arguments and results are pytrees as in the traced function.

    Args:
        graph: any graph (forward, joint, rematerialized, a training step).
        in_shardings: passed to `jax.jit` as it is (a pytree prefix of the arguments, e.g.
            `NamedSharding`s of a `jax.sharding.Mesh`); None leaves the choice to JAX.
        out_shardings: passed to `jax.jit` as it is (a pytree prefix of the results).
        donate_argnums: passed to `jax.jit` as it is.
        target: `jgraph.target`: a device, a Sharding, a Mesh or a platform name. It places the
            arguments there, as `in_shardings` would: on a mesh the data split along its data axis
            and the state (params, optimizer state, accumulators) replicated. A topology's device
            (ahead of time) compiles, through `.lower(...)`, without running.

    Returns:
        A `jax.jit`-wrapped callable with `fn`'s pytree signature (plus the state arguments, if
        the graph has them). It composes: it runs inside the user's own `jax.jit`, `vmap`,
        donated steps. Sharding constraints met while tracing
        (`jax.lax.with_sharding_constraint`) are ops of the graph and are lowered as such."""
    validate(graph, "jg.compile")
    if target is not None:
        if in_shardings is not None:
            raise TargetError("jg.compile: give target= or in_shardings=, not both (a target "
                              "places every argument)")
        in_shardings = _placed(graph, resolve(target))
    shardings = {"in_shardings": in_shardings, "out_shardings": out_shardings}
    return Compiled(graph, jax.jit(as_function(graph), donate_argnums=donate_argnums,
                                   **{k: v for k, v in shardings.items() if v is not None}))


def _placed(graph: Graph, target) -> tuple:
    """The graph's arguments' shardings on `target`, as a pytree of its call arguments."""
    state = [r in STATE_ROLES for r in graph.input_roles]
    names = [f"input {k} ({r})" for k, r in enumerate(graph.input_roles)]
    leaves = [target.sharding(v.aval, s, n) for v, s, n in zip(graph.inputs, state, names,
                                                                 strict=True)]
    if graph.in_tree is None:
        return tuple(leaves)
    return jax.tree.unflatten(graph.in_tree, leaves)


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
