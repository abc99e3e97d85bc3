"""Scans that keep every k-th carry for their backward: `scan[keep_every=k]`.

A scan's forward stacks, per iteration, what its body's VJP reads (`jgraph.vjp_rules.loops`).
A scan marked `keep_every=k` (the planner's loop mode "scans keeping every k-th carry") derives its
body's VJP with the body keeping only its inputs; when those are all carries, the forward stacks
nothing per iteration. It keeps the carries of iterations 0, k, 2k, ... instead (ceil(L/k) slots,
one buffer per carry, updated in place), and each backward iteration first recomputes its carries
from the nearest kept ones: a scan of k-1 iterations whose body is a `cond` that runs the forward
body while it is short of the iteration and passes the carries through after (so it runs
(k-1)/2 forward iterations on average). Memory: L/k carries instead of L; a 64-layer scan with
k = 16 keeps 4 where nested scans (`scans split in two`) keep at least 16 (8 + 8).

The mark is a hint for the backward only: the scan's forward runs as it is, and a scan whose VJP
reads values other than its carries ignores it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jgraph.builder import Builder
from jgraph.ir import Eqn, Graph, Var


def restartable(forward: Graph, residuals, first_carry: int, nk: int) -> bool:
    """Does the body's backward read carries only (and some)?"""
    carries = set(forward.inputs[first_carry:first_carry + nk])
    return bool(residuals) and all(r in carries for r in residuals)


def _keep(buf, count, h, *, every):
    slot = count // every
    kept = jnp.where(count % every == 0, h, lax.dynamic_index_in_dim(buf, slot, keepdims=False))
    return lax.dynamic_update_index_in_dim(buf, kept, slot, 0)


def _next(count):
    return count + 1


def _steps(*, length, reverse):
    steps = jnp.arange(length, dtype=jnp.int32)
    return steps[::-1] if reverse else steps


def _restart_point(step, *, every):
    slot = step // every
    return slot * every, step - slot * every, slot


def _slot(buf, slot):
    return lax.dynamic_index_in_dim(buf, slot, keepdims=False)


def _iota(*, n):
    return jnp.arange(n, dtype=jnp.int32)


def _at(x, start, j, *, length, reverse):
    """The slice of stacked `x` read by step `start + j` (clamped past the end: unused)."""
    step = start + j
    return lax.dynamic_index_in_dim(x, length - 1 - step if reverse else step, keepdims=False)


def _below(j, n):
    return (j < n).astype(jnp.int32)


def forward(eqn: Eqn, body: Graph, first_carry: int, nk: int, every: int, inputs):
    """(eqns before the scan, the scan): `eqn` running `body` (consts, carries, xs -> carries,
    ys), with a step counter and one buffer per carry as extra carries, keeping the carries of
    every `every`-th step. `inputs` are the scan's operands (consts and hoisted values first)."""
    length = eqn.params["length"]
    slots = -(-length // every)
    carry_in = body.inputs[first_carry:first_carry + nk]
    init = Builder(tags=eqn.tags, regions=eqn.regions, source=eqn.source)
    count0 = init.call(jnp.zeros, shape=(), dtype=jnp.int32)[0]
    bufs0 = [init.call(jnp.zeros, shape=(slots, *v.aval.shape), dtype=v.aval.dtype)[0]
             for v in carry_in]
    count = Var(count0.aval)
    bufs = tuple(Var(b.aval) for b in bufs0)
    inner = Builder()
    kept = [inner.call(_keep, buf, count, h, every=every)[0]
            for buf, h in zip(bufs, carry_in, strict=True)]
    count1 = inner.call(_next, count)[0]
    cut = first_carry + nk
    new_body = Graph(
        inputs=body.inputs[:cut] + (count,) + bufs + body.inputs[cut:],
        eqns=body.eqns + tuple(inner.eqns),
        outputs=body.outputs[:nk] + (count1, *kept) + body.outputs[nk:],
        input_roles=("data",) * (len(body.inputs) + 1 + nk),
        output_roles=("aux",) * (len(body.outputs) + 1 + nk))
    outputs = (eqn.outputs[:nk] + (Var(count0.aval),) + tuple(Var(b.aval) for b in bufs0)
               + eqn.outputs[nk:])
    new = dataclasses.replace(
        eqn, inputs=tuple(inputs[:cut]) + (count0, *bufs0) + tuple(inputs[cut:]),
        outputs=outputs, params={**eqn.params, "body": new_body, "num_consts": first_carry,
                                 "num_carry": 2 * nk + 1})
    return init.eqns, new


def _carries_only(body: Graph, nk: int) -> Graph:
    """`body` computing its carries only: no ys, and no print (it printed in the forward)."""
    live = {a for a in body.outputs[:nk] if isinstance(a, Var)}
    kept = []
    for eqn in reversed(body.eqns):
        if any(v in live for v in eqn.outputs):
            kept.append(eqn)
            live.update(a for a in eqn.inputs if isinstance(a, Var))
    return body.replace(eqns=tuple(reversed(kept)), outputs=body.outputs[:nk],
                        output_roles=("aux",) * nk)


@dataclasses.dataclass(frozen=True)
class Recompute:
    """What the backward scan's body needs to recompute its carries (see `recompute`)."""

    consts: tuple  # body inputs, after the backward's own consts
    const_atoms: tuple  # the outer atoms bound to them
    step: Var  # body input: this iteration's step (an xs, before the x residuals)
    steps: object  # its outer atom (built by the outer builder)
    eqns: tuple  # the body's first eqns: the carries its VJP reads, recomputed


def recompute(b: Builder, eqn: Eqn, body: Graph, first_carry: int, nk: int, every: int,
              residuals) -> Recompute:
    """The eqns of a backward body recomputing `residuals` (forward carry inputs, the same Vars
    its R reads) from the kept carries of linearized scan `eqn` (see `forward`)."""
    p = eqn.params
    length, reverse = p["length"], p["reverse"]
    n_x = len(body.inputs) - first_carry - nk
    outer_consts = eqn.inputs[:first_carry]
    outer_bufs = eqn.outputs[nk + 1:2 * nk + 1]
    outer_xs = eqn.inputs[len(eqn.inputs) - n_x:]
    consts = tuple(Var(a.aval) for a in outer_consts)
    bufs = tuple(Var(a.aval) for a in outer_bufs)
    xs = tuple(Var(a.aval) for a in outer_xs)
    steps = b.call(_steps, length=length, reverse=reverse)[0]
    step = Var(steps.aval.update(shape=()))
    inner = Builder(tags={"backward", "recompute"})
    start, n, slot = inner.call(_restart_point, step, every=every)
    h0 = [inner.call(_slot, buf, slot)[0] for buf in bufs]
    js = inner.call(_iota, n=every - 1)[0]
    # The loop body: consts (the forward's consts, xs, start, n), carries, j -> carries.
    c_in, x_in = tuple(Var(a.aval) for a in consts), tuple(Var(a.aval) for a in xs)
    start_in, n_in, j_in = Var(start.aval), Var(n.aval), Var(js.aval.update(shape=()))
    h_in = tuple(Var(v.aval) for v in body.inputs[first_carry:first_carry + nk])
    loop = Builder(tags={"backward", "recompute"})
    x_j = [loop.call(_at, x, start_in, j_in, length=length, reverse=reverse)[0] for x in x_in]
    index = loop.call(_below, j_in, n_in)[0]
    keep_in = tuple(Var(v.aval) for v in body.inputs)
    keep = Graph(inputs=keep_in, eqns=(), outputs=keep_in[first_carry:first_carry + nk],
                 input_roles=("data",) * len(keep_in), output_roles=("aux",) * nk)
    run = _carries_only(body, nk)
    h_out = loop.bind("cond", index, *c_in, *h_in, *x_j, branches=(keep, run))
    loop_in = c_in + x_in + (start_in, n_in) + h_in + (j_in,)
    loop_body = Graph(inputs=loop_in, eqns=tuple(loop.eqns), outputs=tuple(h_out),
                      input_roles=("data",) * len(loop_in), output_roles=("aux",) * nk)
    by_carry = dict(zip(body.inputs[first_carry:first_carry + nk], range(nk), strict=True))
    outs = [Var(v.aval) for v in h_in]
    for r in residuals:
        outs[by_carry[r]] = r
    params = {"body": loop_body, "length": every - 1, "reverse": False,
              "num_consts": len(loop_in) - nk - 1, "num_carry": nk, "unroll": 1,
              "mean_runs": (every - 1) / 2}  # bodies run on average (`jgraph.planner.cost`)
    inner.eqns.append(Eqn("scan", consts + xs + (start, n) + tuple(h0) + (js,), params,
                          tuple(outs), inner.tags, (), eqn.source))
    return Recompute(consts + bufs + xs, tuple(outer_consts) + tuple(outer_bufs)
                     + tuple(outer_xs), step, steps, tuple(inner.eqns))
