"""Structured control flow: `scan`, `cond` and `while` as ops whose params hold sub-graphs.

    scan[body, length, reverse, num_consts, num_carry, unroll]  consts... carry... xs...
        body: (consts, carry, x slices) -> (new carry, y slices); outputs (final carry, stacked ys)
    cond[branches]  index operands...
        each branch: operands -> outputs; the int32 index picks one (clamped, as lax.switch does)
    while[cond_graph, body, cond_nconsts, body_nconsts]  cond_consts... body_consts... carry...
        cond_graph: (cond_consts, carry) -> bool[]; body: (body_consts, carry) -> carry

The tracer turns JAX's `scan`, `cond` and `while` into these ops (`lax.fori_loop` with static bounds
and `lax.map` are scans, as JAX binds them), with their jaxprs traced into `Graph`s by the same
builder, so every transform can recurse into them. A sub-graph's inputs have the role `data` and
its outputs `aux`: roles are a top-level notion. Lowering runs the same interpreter loop on a body
inside `lax.scan` / `lax.switch` / `lax.while_loop` (`interpret(graph, *values) -> outputs`), so a
loop stays a loop in XLA. VJP rules: `jgraph.vjp_rules.loops`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jgraph import _jax_internals as internals
from jgraph import ops
from jgraph.builder import Builder, handler
from jgraph.errors import TraceError
from jgraph.ir import Graph, ShapedArray, Var, short_aval

HIGHER_ORDER = frozenset({"scan", "cond", "while"})  # ops whose lowering takes `interpret`


def sub_graph(b: Builder, closed_jaxpr) -> Graph:
    """A sub-jaxpr (a loop body, a branch) as a Graph, traced by a builder like `b`."""
    jaxpr, consts = internals.call_body({"jaxpr": closed_jaxpr})
    inner = Builder(source=b.source)
    inner.enclosing_policies = b.remat_policies()  # a remat around the loop applies inside it
    inputs = tuple(Var(v.aval) for v in jaxpr.invars)
    outputs = tuple(inner.inline(jaxpr, consts, inputs))
    return Graph(inputs=inputs, eqns=tuple(inner.eqns), outputs=outputs,
                 input_roles=("data",) * len(inputs), output_roles=("aux",) * len(outputs),
                 regions=tuple(inner.new_regions))


def _types(avals) -> list[str]:
    return [short_aval(a) for a in avals]


def _expect(what: str, got, want) -> str | None:
    got, want = _types(got), _types(want)
    return None if got == want else f"{what}: {got}, expected {want}"


def signature_problem(eqn) -> str | None:
    """What is wrong with how a control-flow eqn's sub-graphs fit its operands (None: fine)."""
    p, avals = eqn.params, [a.aval for a in eqn.inputs]
    if eqn.op == "scan":
        body, nc, nk = p["body"], p["num_consts"], p["num_carry"]
        xs = [a.update(shape=a.shape[1:]) for a in avals[nc + nk:]]
        if any(a.shape[:1] != (p["length"],) for a in avals[nc + nk:]):
            return f"scan of length {p['length']} over xs {_types(avals[nc + nk:])}"
        return (_expect("body inputs", [v.aval for v in body.inputs], avals[:nc + nk] + xs)
                or _expect("body carry outputs", [a.aval for a in body.outputs[:nk]],
                           avals[nc:nc + nk]))
    if eqn.op == "cond":
        if avals[0].shape != () or avals[0].dtype != np.int32:
            return f"cond index is {short_aval(avals[0])}, expected i32[]"
        outs = [a.aval for a in p["branches"][0].outputs]
        for k, branch in enumerate(p["branches"]):
            problem = (_expect(f"branch {k} inputs", [v.aval for v in branch.inputs], avals[1:])
                       or _expect(f"branch {k} outputs", [a.aval for a in branch.outputs], outs))
            if problem:
                return problem
        return None
    if eqn.op == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        carry = avals[nc + nb:]
        preds = [a.aval for a in p["cond_graph"].outputs]
        # A batched predicate (jax.vmap of a while_loop) is bool[B...], a prefix of every carry's
        # shape: the loop runs while any is true, and updates only the carries whose is.
        batch = preds[0].shape if len(preds) == 1 else ()
        if batch and any(a.shape[:len(batch)] != batch for a in carry):
            batch = ()
        return (_expect("cond_graph inputs", [v.aval for v in p["cond_graph"].inputs],
                        avals[:nc] + carry)
                or _expect("cond_graph outputs", preds, [ShapedArray(batch, np.dtype(bool))])
                or _expect("body inputs", [v.aval for v in p["body"].inputs],
                           avals[nc:nc + nb] + carry)
                or _expect("body outputs", [a.aval for a in p["body"].outputs], carry))
    return None


# -- scan --------------------------------------------------------------------------------------
def _scan_shape(*avals, body, length, num_consts, num_carry, **_):
    outs = [a.aval for a in body.outputs]
    return outs[:num_carry] + [a.update(shape=(length, *a.shape)) for a in outs[num_carry:]]


def _scan_lowering(*values, interpret, body, length, reverse, num_consts, num_carry, unroll=1,
                   **_):  # keep_every: a hint to the scan's VJP (`jgraph.vjp_rules.scan_restart`)
    consts, carry = list(values[:num_consts]), list(values[num_consts:num_consts + num_carry])
    xs = list(values[num_consts + num_carry:])

    def step(carry, x):
        outs = interpret(body, *consts, *carry, *x)
        return outs[:num_carry], outs[num_carry:]

    carry, ys = lax.scan(step, carry, xs, length=length, reverse=reverse, unroll=unroll)
    return [*carry, *ys]


ops.defop("scan", _scan_shape, _scan_lowering)


@handler("scan")
def _scan(b: Builder, eqn, inputs):
    p = eqn.params
    return b.bind("scan", *inputs, body=sub_graph(b, p["jaxpr"]), length=p["length"],
                  reverse=p["reverse"], num_consts=p["num_consts"], num_carry=p["num_carry"],
                  unroll=p.get("unroll", 1))


# -- cond --------------------------------------------------------------------------------------
def branch_for(branches_platforms, platform: str) -> int:
    """`lax.platform_dependent` stages a `cond` with one branch per group of platforms (None: the
    default). jgraph compiles for the default backend, so the tracer picks that branch and the
    graph holds ordinary, differentiable ops (`jnp.diagonal`, `jnp.trace` bind such a cond)."""
    default = None
    for k, group in enumerate(branches_platforms):
        if group is None:
            default = k
        elif platform in group:
            return k
    if default is None:
        raise TraceError(f"platform-dependent code has no branch for platform {platform!r} "
                         f"(branches: {branches_platforms})")
    return default


def _cond_shape(*avals, branches, **_):
    return [a.aval for a in branches[0].outputs]


def _cond_lowering(index, *operands, interpret, branches,
                   **_):  # plan_fraction: a hint to the cond's VJP (`jgraph.planner.loops`)
    fns = [lambda *xs, g=g: interpret(g, *xs) for g in branches]
    return list(lax.switch(index, fns, *operands))


ops.defop("cond", _cond_shape, _cond_lowering)


@handler("cond")
def _cond(b: Builder, eqn, inputs):
    platforms = eqn.params.get("branches_platforms")
    if platforms is not None:  # `lax.platform_dependent`: the default backend's branch
        branch = eqn.params["branches"][branch_for(platforms, internals.compile_platform())]
        return b.inline(branch.jaxpr, branch.consts, inputs[1:])
    branches = tuple(sub_graph(b, br) for br in eqn.params["branches"])
    return b.bind("cond", *inputs, branches=branches)


# -- while -------------------------------------------------------------------------------------
def _while_shape(*avals, cond_graph, body, cond_nconsts, body_nconsts):
    return list(avals[cond_nconsts + body_nconsts:])


def _while_lowering(*values, interpret, cond_graph, body, cond_nconsts, body_nconsts):
    cond_consts = values[:cond_nconsts]
    body_consts = values[cond_nconsts:cond_nconsts + body_nconsts]
    init = list(values[cond_nconsts + body_nconsts:])
    if not cond_graph.outputs[0].aval.shape:
        return list(lax.while_loop(lambda c: interpret(cond_graph, *cond_consts, *c)[0],
                                   lambda c: interpret(body, *body_consts, *c), init))

    def step(c):  # a batched predicate: only the carries whose predicate holds move on
        pred = interpret(cond_graph, *cond_consts, *c)[0]
        new = interpret(body, *body_consts, *c)
        return [lax.select(lax.broadcast_in_dim(pred, x.shape, tuple(range(pred.ndim))), y, x)
                for x, y in zip(c, new, strict=True)]

    return list(lax.while_loop(lambda c: jnp.any(interpret(cond_graph, *cond_consts, *c)[0]),
                               step, init))


ops.defop("while", _while_shape, _while_lowering)


@handler("while")
def _while(b: Builder, eqn, inputs):
    p = eqn.params
    return b.bind("while", *inputs, cond_graph=sub_graph(b, p["cond_jaxpr"]),
                  body=sub_graph(b, p["body_jaxpr"]), cond_nconsts=p["cond_nconsts"],
                  body_nconsts=p["body_nconsts"])
