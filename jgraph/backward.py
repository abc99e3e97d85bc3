"""`backward`: a forward graph -> the joint forward + backward graph (ggml_build_backward_expand).

A value needs a gradient iff it is floating and lies on a path from a `param` input to the `loss`
output. Walking the schedule in reverse, each eqn with a cotangent on an output and an input that
needs a gradient emits the eqns of its VJP rule (`jgraph.vjp_rules`), tagged `backward`. Fan-out
cotangents are summed. The loss cotangent (the seed) is 1, or the `loss_seed` input when the graph
has one; the result records it as `info["loss_seed"]`, so that `jgraph.training.accumulate` scales
the gradients by scaling the seed (the backward pass is linear in it). Accumulating gradients over
micro-steps is `accumulate`'s job, not this pass's.
Outputs are arranged as `jax.value_and_grad(fn, argnums=param_argnums, has_aux=has_aux)` returns.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jgraph import _jax_internals as internals
from jgraph.builder import Builder
from jgraph.check import validate
from jgraph.errors import TransformError
from jgraph.ir import Eqn, Graph, Literal, Var, is_float, short_aval
from jgraph.naming import while_processing
from jgraph.ops import CUTS_GRADIENT, EFFECTFUL, NON_DIFFERENTIABLE
from jgraph.passes import dce
from jgraph.policies import saves_inside

# -- the rule tables: filled by `jgraph.vjp_rules` (one module per op family), read here -----------
# op -> rule(cts, ins, outs, **params) -> cotangent per input (or None); see `jgraph.vjp_rules`.
vjp_rules: dict[str, Callable] = {}
# op -> fn(n_inputs, params) -> input positions the rule never differentiates (error if needed).
undifferentiable_inputs: dict[str, Callable] = {}
# Control flow (`jgraph.vjp_rules.loops`): op -> rule(eqn, needs, policies) -> (hoisted eqns, the
# eqn that also returns its residuals, how to transpose it); op -> rule(b, eqn, how, out_cts,
# needed) -> cotangent per input, emitting the backward op.
linearize_rules: dict[str, Callable] = {}
transpose_rules: dict[str, Callable] = {}

# Ops that are registered (they trace, evaluate and compile) but have no VJP rule, and why. On the
# gradient path each is a TransformError naming the op, the reason and the user's line.
NO_VJP_RULE = {
    **dict.fromkeys(("psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all",
                     "ragged_all_to_all", "axis_index"),
                    "a collective over named axes (inside shard_map/pmap): jgraph differentiates "
                    "shard_map's typed collectives only (check_vma=True: pvary and psum)"),
    **dict.fromkeys(("igamma", "igammac", "igamma_grad_a", "random_gamma",
                     "regularized_incomplete_beta", "zeta"),
                    "special function without a jgraph rule yet (jax.scipy.special.gammainc, "
                    "betainc, zeta, jax.random.gamma)"),
    **dict.fromkeys(("hessenberg", "householder_product", "schur", "tridiagonal",
                     "tridiagonal_solve", "approx_top_k"),
                    "no jgraph rule yet (rarely on a training path); JAX differentiates some"),
    "reduce_window": "a windowed reduction with a user computation: only the sum/max/min "
                     "windows (reduce_window_sum/max/min) have rules",
    "select_and_scatter": "XLA's select-and-scatter with a user computation (JAX has no "
                          "VJP for it either)",
    "while": "a loop with a data-dependent trip count has no reverse-mode derivative (as in "
             "JAX); use lax.scan or lax.fori_loop with static bounds",
}


def add_cotangents(a, b):
    return a + b


def unbroadcast(ct, x):
    """Sum `ct` down to the shape of `x` (undoes rank-0 and size-1 broadcasting of nary ops)."""
    if ct.shape == x.shape:
        return ct
    if x.ndim == 0:
        return jnp.sum(ct).astype(ct.dtype)
    dims = tuple(i for i, (a, b) in enumerate(zip(ct.shape, x.shape, strict=True)) if a != b)
    return ct.sum(axis=dims).reshape(x.shape)


def apply_rule(b, eqn, out_cts, needed=None):
    """Emit the eqns of `eqn`'s VJP rule; return one cotangent atom (or None) per input.

    `needed` (one bool per input) says which cotangents the caller will use; the others are
    returned as None and their eqns are not emitted.
    """
    rule = vjp_rules.get(eqn.op)
    if rule is None:
        if eqn.op in NON_DIFFERENTIABLE or not any(is_float(v.aval) for v in eqn.outputs):
            return [None] * len(eqn.inputs)
        why = f": {NO_VJP_RULE[eqn.op]}" if eqn.op in NO_VJP_RULE else ""
        raise TransformError(
            f"no VJP rule for op {eqn.op!r}{why}; it is on the gradient path"
            + (f" at {eqn.source}" if eqn.source else "")
            + " (jgraph never substitutes a zero gradient)"
        )
    n_in, n_out = len(eqn.inputs), len(eqn.outputs)
    positions = undifferentiable_inputs.get(eqn.op)
    if positions is not None and needed is not None:
        for k in positions(n_in, eqn.params):
            if needed[k]:
                raise TransformError(
                    f"op {eqn.op!r} gives its input {k} no cotangent, but that input needs a "
                    f"gradient" + (f" at {eqn.source}" if eqn.source else "")
                    + " (for custom_jvp/custom_vjp: a closed-over value on the gradient path; "
                    "pass it as an argument or use jax.closure_convert)")
    cts = list(out_cts)
    for k, ct in enumerate(cts):
        if ct is None:  # an output nobody differentiates through: a zero cotangent
            cts[k] = b.call(jnp.zeros_like, eqn.outputs[k])[0]
    needed = (True,) * n_in if needed is None else tuple(needed)
    start = len(b.eqns)
    outs = b.call(_run_rule, *eqn.inputs, *eqn.outputs, *cts, rule=rule, n_in=n_in, n_out=n_out,
                  params=_freeze(eqn.params), needed=needed)
    if getattr(rule, "replays_forward", False):  # its prints ran in the forward already
        b.eqns[start:] = [e for e in b.eqns[start:] if e.op not in EFFECTFUL]
    return outs + [None] * (n_in - len(outs))


def _run_rule(*arrays, rule, n_in, n_out, params, needed):
    ins, outs, cts = arrays[:n_in], arrays[n_in:n_in + n_out], arrays[n_in + n_out:]
    # A rule that can skip work for unneeded cotangents says so (`wants_needed`): the custom_jvp
    # rule, whose tangents are then symbolic zeros (a closed-over value's must be).
    extra = {"needed": needed} if getattr(rule, "wants_needed", False) else {}
    result = list(rule(cts, ins, outs, **dict(params), **extra))
    # Cotangents of integer inputs (indices, exponents) are dropped, whatever the rule said, and
    # so are those the caller does not need (the call's template drops the eqns computing them).
    return [None if ct is None or not use or not jnp.issubdtype(x.dtype, jnp.inexact) else ct
            for ct, x, use in zip(result, ins, needed, strict=False)]


def _freeze(params):
    return tuple(sorted(params.items()))


def defvjp(op: str, rule: Callable) -> None:
    vjp_rules[op] = rule


def defunary(op: str, fn: Callable) -> None:
    """Rule for a one-input op from `fn(ct, x, y) -> ct_x` (y is the op's output)."""
    vjp_rules[op] = lambda cts, ins, outs, **p: [fn(cts[0], ins[0], outs[0])]


def defbinary(op: str, fn: Callable) -> None:
    """Rule for a two-input op from `fn(ct, x, y, z) -> (ct_x, ct_y)`, unbroadcast after."""
    def rule(cts, ins, outs, **p):
        cx, cy = fn(cts[0], ins[0], ins[1], outs[0])
        return [unbroadcast(cx, ins[0]), unbroadcast(cy, ins[1])]

    vjp_rules[op] = rule


def deflinear(op: str, fn: Callable) -> None:
    """Rule for an op linear in its first input: `fn(ct, x, **params) -> ct_x`."""
    vjp_rules[op] = lambda cts, ins, outs, **p: [fn(cts[0], ins[0], **p)]


# -- the pass ----------------------------------------------------------------------------------
def active_values(graph: Graph, active_inputs) -> set[Var]:
    """Floating variables that depend on one of `active_inputs` (a forward sweep)."""
    active = {v for v in active_inputs if _floating(v.aval.dtype)}
    for eqn in graph.eqns:
        if eqn.op in CUTS_GRADIENT:
            continue
        if any(type(a) is Var and a in active for a in eqn.inputs):
            active.update(v for v in eqn.outputs if _floating(v.aval.dtype))
    return active


def useful_values(graph: Graph, targets) -> set[Var]:
    """Variables some of `targets` depend on (a backward sweep)."""
    useful = {a for a in targets if type(a) is Var}
    for eqn in reversed(graph.eqns):
        if eqn.op not in CUTS_GRADIENT and any(v in useful for v in eqn.outputs):
            useful.update(a for a in eqn.inputs if type(a) is Var)
    return useful


def needs_gradient(graph: Graph, loss: Var) -> set[Var]:
    """Floating variables on a path from a param input to `loss`."""
    params = [v for v, r in zip(graph.inputs, graph.input_roles, strict=True) if r == "param"]
    return active_values(graph, params) & useful_values(graph, [loss])


@functools.lru_cache(maxsize=None)
def _floating(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _loss_output(graph: Graph):
    losses = [k for k, r in enumerate(graph.output_roles) if r == "loss"]
    if len(losses) != 1:
        outs = ", ".join(f"{short_aval(a.aval)}@{r}"
                         for a, r in zip(graph.outputs, graph.output_roles, strict=True))
        raise TransformError(
            "backward needs exactly one output with role 'loss', and a loss must be a floating "
            f"scalar; this graph returns ({outs}){_computed_at(graph, graph.outputs[:1])}. Trace a "
            "function returning a floating scalar loss (or (loss, aux) with has_aux=True)."
        )
    loss = graph.outputs[losses[0]]
    if loss.aval.shape != () or not _floating(loss.aval.dtype):
        raise TransformError(f"backward: the loss must be a floating scalar, got "
                             f"{short_aval(loss.aval)}{_computed_at(graph, [loss])}")
    return loss


def _computed_at(graph: Graph, atoms) -> str:
    """", computed at <the user's line>" for the first of `atoms`, when an eqn with a source line
    computed it."""
    for eqn in reversed(graph.eqns):
        if atoms and any(o is atoms[0] for o in eqn.outputs) and eqn.source:
            return f", computed at {eqn.source}"
    return ""


def backward(graph: Graph, *, loop_policy=None) -> Graph:
    """The joint graph computing (loss[, aux]) and the gradients of the loss w.r.t. the params.

    Args:
        graph: a forward graph from `jg.trace` with `param` inputs and a scalar `loss` output.
        loop_policy: a remat policy, or a tuple of them (outermost first), applied inside the
            bodies of loops and conds, on top of their own checkpoint regions. `jg.remat(gb,
            policy=...)` re-derives `gb` with it, so that a policy sees through loops.

    Returns:
        The joint `Graph`: the forward eqns, then the backward eqns (tagged `backward`); its
        outputs are the loss (and aux) and one `grad` per param. `jg.compile` of it equals
        `jax.value_and_grad(fn, param_argnums, has_aux)`. It records its forward graph as
        `info["backward_of"]` (and a `loop_policy` as `info["loop_policy"]`).

    Raises:
        TransformError: no params, a loss that is not a floating scalar, or an op without a VJP
            rule (naming the op)."""
    validate(graph, "jg.backward")
    if "grad" in graph.output_roles:
        raise TransformError("backward: the graph already has grad outputs")
    loss = _loss_output(graph)
    params = graph.grad_params()
    if not params:
        raise TransformError("backward: the graph has no 'param' input; pass param_argnums= to "
                             "jg.trace")
    _check_param_dtypes(graph, params)
    if "accumulator" in graph.input_roles:
        raise TransformError("backward: the graph has accumulator inputs; accumulate gradients "
                             "with jg.accumulate(jg.backward(forward_graph), period)")
    seeds = graph.inputs_with_role("loss_seed")
    if len(seeds) > 1:
        raise TransformError(f"backward: {len(seeds)} loss_seed inputs; a graph has at most one")
    seed, seed_eqns = _seed(loss, seeds)
    loop_policies = loop_policy if isinstance(loop_policy, tuple) else (
        () if loop_policy is None else (loop_policy,))
    grads, forward, eqns = _backward_eqns(graph, loss, params, seed, loop_policies)
    eqns = seed_eqns + eqns
    joint = dce(graph.replace(
        eqns=forward + eqns,
        outputs=graph.outputs + tuple(grads),
        output_roles=graph.output_roles + ("grad",) * len(grads),
        out_tree=_value_and_grad_tree(graph),
        info={**graph.info, "loss_seed": seed},
    ))
    # What remat needs to re-derive this graph with a policy inside its loops (valid while the
    # eqns are these), and the policy it was derived with (a rewrite of the forward, such as
    # `jg.chunk_rows`'s, derives it again with the same).
    info = {**joint.info, "backward_of": (graph, joint.eqns)}
    info.pop("loop_policy", None)
    if loop_policies:
        info["loop_policy"] = loop_policies
    return joint.replace(info=info)


def _seed(loss, seeds):
    """The loss cotangent (the `loss_seed` input, or 1) and the eqns computing it, if any."""
    if seeds:
        return seeds[0], ()
    if internals.shard_map_typed(loss.aval) is None:
        return Literal(np.ones((), loss.aval.dtype), loss.aval), ()
    # Inside shard_map a per-device loss varies over mesh axes, and so must its seed (a literal
    # does not): JAX's own backward casts it with `pvary` too.
    b = Builder(tags={"backward"})
    return b.call(jnp.ones_like, loss)[0], tuple(b.eqns)


def rederived(graph: Graph, loop_policy, forward: Graph | None = None) -> Graph | None:
    """`graph` (a result of `backward`) derived again with `loop_policy` in its loops (from
    `forward`, a rewrite of its forward graph, when given), or None when `graph` is no longer
    what `backward` returned."""
    original, eqns = graph.info.get("backward_of", (None, None))
    if original is None or eqns is not graph.eqns:
        return None
    return backward(original if forward is None else forward, loop_policy=loop_policy)


def forward_of(graph: Graph) -> Graph | None:
    """The forward graph `graph` was derived from by `backward` (None if it was changed since)."""
    original, eqns = graph.info.get("backward_of", (None, None))
    return original if original is not None and eqns is graph.eqns else None


def _check_param_dtypes(graph: Graph, params) -> None:
    """Params must be floating (real or complex), as `jax.grad` requires: an integer param would
    otherwise get a silent zero gradient."""
    paths = dict(zip(graph.inputs, graph.input_paths(), strict=True))
    for p in params:
        if not _floating(p.aval.dtype):
            raise TransformError(
                f"backward: param args{paths[p]} is {short_aval(p.aval)}; gradients need floating "
                "params (as jax.grad requires). Pass integer, boolean or key values as data, not "
                "in the param arguments.")


def _backward_eqns(graph, loss, params, seed, loop_policies):
    """(grad atoms, forward eqns, backward eqns) of the loss w.r.t. `params`."""
    needs = needs_gradient(graph, loss)
    cts, forward, eqns = reverse_pass(graph, needs, [(loss, seed)] if loss in needs else [],
                                      loop_policies)
    b = Builder(tags={"backward"})
    grads = [cts.get(p) or b.call(jnp.zeros_like, p)[0] for p in params]  # unused: zeros
    return grads, forward, eqns + tuple(b.eqns)


# -- control flow: linearized before the reverse walk (rules: `jgraph.vjp_rules.loops`) -----------
def linearize(graph: Graph, needs: set, policies=()):
    """(forward eqns, {new eqn: how to transpose it}) with each scan/cond on the gradient path
    replaced by one that also returns its residuals (preceded by the loop-invariant eqns hoisted
    out of a scan), by `linearize_rules`; the reverse walk emits its backward op by
    `transpose_rules`. `policies` (outermost first) apply inside every loop body, with those of the
    checkpoint regions around the loop that see through it (`pushed_policies`)."""
    eqns, linearized = [], {}
    for eqn in graph.eqns:
        rule = linearize_rules.get(eqn.op)
        on_path = any(v in needs for v in eqn.outputs) and any(
            isinstance(a, Var) and a in needs for a in eqn.inputs)
        if rule is None or not on_path:
            eqns.append(eqn)
            continue
        pushed, regions = pushed_policies(graph, eqn)
        hoisted, new, how = rule(eqn, needs, tuple(policies) + pushed)
        eqns += [dataclasses.replace(e, regions=regions, tags=eqn.tags, source=eqn.source)
                 for e in hoisted]
        new = dataclasses.replace(new, regions=regions)
        eqns.append(new)
        linearized[new] = how
    return eqns, linearized


def pushed_policies(graph: Graph, eqn: Eqn) -> tuple[tuple, tuple[int, ...]]:
    """(policies applied inside `eqn`'s bodies, outermost first; the regions it stays in).

    A checkpoint region around a loop or a cond whose policy saves something inside it applies
    that policy inside the bodies (JAX's policies see through `scan` and `cond`): the loop then
    leaves the region, whose recompute would otherwise redo the whole loop, saved dots
    included. Regions are pushed from the innermost outwards, up to the first one whose policy
    saves nothing inside (which recomputes the loop whole: keeping only its inputs)."""
    regions = {r.id: r for r in graph.regions}
    n = len(eqn.regions)
    while n and eqn.regions[n - 1] in regions and saves_inside(
            regions[eqn.regions[n - 1]].policy, eqn):
        n -= 1
    pushed = tuple(regions[r].policy for r in eqn.regions[n:])
    return pushed, eqn.regions[:n]


def reverse_pass(graph: Graph, needs: set[Var], seeds, loop_policies=()):
    """The core of every backward: seed cotangents at some values (`(var, ct atom)` pairs, summed
    when a var has several, as an output listed twice has), walk the
    schedule in reverse and emit each eqn's VJP rule; return (cotangents of the graph's inputs and
    of whatever they reached, {var: ct atom}; the forward eqns; the backward eqns).

    Control flow is first linearized (`linearize`): a loop or a cond on
    the gradient path is replaced in the forward by one that also returns the residuals its
    backward reads, so the forward eqns returned may differ from `graph.eqns`."""
    forward, linearized = linearize(graph, needs, loop_policies)
    b = Builder(tags={"backward"})
    cts: dict[Var, object] = {}

    def add_ct(v, ct):
        cts[v] = ct if v not in cts else b.call(add_cotangents, cts[v], ct)[0]

    for v, ct in seeds:
        add_ct(v, ct)
    for eqn in reversed(forward):
        if not any(v in cts for v in eqn.outputs):
            continue
        if not any(type(a) is Var and a in needs for a in eqn.inputs):
            continue
        b.source = eqn.source
        out_cts = [cts.pop(v, None) for v in eqn.outputs]
        needed = [type(x) is Var and x in needs for x in eqn.inputs]
        with while_processing("differentiating", eqn, graph):
            if eqn in linearized:
                in_cts = transpose_rules[eqn.op](b, eqn, linearized[eqn], out_cts, needed)
            else:
                in_cts = apply_rule(b, eqn, out_cts, needed)
        for ct, x in zip(in_cts, eqn.inputs, strict=True):
            if ct is not None and type(x) is Var and x in needs:
                add_ct(x, ct)
    return cts, tuple(forward), tuple(b.eqns)


def vjp_graph(graph: Graph, wrt, with_ct, loop_policies=()) -> Graph:
    """The joint graph of `graph`'s VJP (for loop bodies and branches).

    Inputs: `graph`'s inputs, then one cotangent per output marked in `with_ct`. Outputs:
    `graph`'s outputs, then the cotangent of each input marked in `wrt` (zeros where none flows).
    Forward eqns keep their checkpoint regions (`graph.regions`), backward eqns are tagged
    `backward`, as in `backward`'s result, so `jgraph.regions` applies to it."""
    ct_inputs = tuple(Var(a.aval) for a, w in zip(graph.outputs, with_ct, strict=True) if w)
    targets = [a for a, w in zip(graph.outputs, with_ct, strict=True) if w]
    sources = [v for v, w in zip(graph.inputs, wrt, strict=True) if w]
    needs = active_values(graph, sources) & useful_values(graph, targets)
    seeds = [(a, ct) for a, ct in zip(targets, ct_inputs, strict=True) if a in needs]
    cts, forward, eqns = reverse_pass(graph, needs, seeds, loop_policies)
    b = Builder(tags={"backward"})
    grads = [cts.get(v) or b.call(jnp.zeros_like, v)[0] for v in sources]
    return graph.replace(
        inputs=graph.inputs + ct_inputs, eqns=forward + eqns + tuple(b.eqns),
        outputs=graph.outputs + tuple(grads),
        input_roles=graph.input_roles + ("data",) * len(ct_inputs),
        output_roles=graph.output_roles + ("aux",) * len(grads), in_tree=None, out_tree=None)


def _value_and_grad_tree(graph: Graph):
    """Treedef of `(value, grads)` with grads shaped like the param arguments."""
    value_tree = graph.out_tree or jax.tree.structure((0,) * len(graph.outputs))
    argnums = graph.param_argnums
    if argnums is None or graph.in_tree is None:
        n = len(graph.inputs_with_role("param"))
        grads_tree = jax.tree.structure((0,) * n)
    elif isinstance(argnums, int):
        grads_tree = graph.in_tree.children()[argnums]
    else:
        arg_trees = graph.in_tree.children()
        grads_tree = jax.tree.structure(
            tuple(jax.tree.unflatten(arg_trees[i], [0] * arg_trees[i].num_leaves) for i in argnums)
        )
    value = jax.tree.unflatten(value_tree, [0] * value_tree.num_leaves)
    grads = jax.tree.unflatten(grads_tree, [0] * grads_tree.num_leaves)
    return jax.tree.structure((value, grads))
