"""Reverse mode through `scan` and `cond`: linearize the forward, transpose into a loop or a cond.

A loop's VJP is a loop over its body's VJP. Before the reverse walk, `linearize` replaces each scan
or cond on the gradient path with one that also returns the residuals its backward reads; when
the walk reaches it, `transpose` emits the backward op. Both come from the body's joint graph
`J = jgraph.backward.vjp_graph(body)`, rematerialized by the body's own checkpoint regions (so
`scan(checkpoint(layer))` saves only what the layer's policy saves, per iteration), then cut in
two by `split`:

    F: (consts, carry, x) -> (carry', y, residuals)          the forward body, run by `scan`
    R: (const residuals, residuals, x residuals, cts) -> cts  the backward body

Residuals are classified by where they come from: a const (loop-invariant: passed to the backward
loop as a const, never stacked), an `xs` slice (the backward loop slices the same `xs`), or a value
computed in the body or a carry (stacked by the forward loop, one slice per iteration). Values the
body computes from consts and literals alone are hoisted: computed once before the loop and read
by F and R as consts, instead of being stacked `length` times or recomputed by each iteration.
A checkpoint region around the loop whose policy saves something inside it applies that policy
inside the body (`pushed_policies`), as JAX's policies see through loops.
The backward scan runs in the other direction with the carries' cotangents as its carries, plus
one accumulator per const (their cotangents summed over iterations). A residual that is the
body's carry output while that carry's input is a residual too is not stacked: iteration i's value
is iteration i+1's carry input, so the backward scan carries it from one iteration to the next,
starting from the final carry (`carry_shifts`). A scan marked `keep_every=k` keeps only every k-th
carry, and its backward recomputes the others (`jgraph.vjp_rules.scan_restart`).

`cond`: each branch is linearized alike (a branch runs once: every forward value its R reads is a
residual); the forward cond returns every branch's residual slots (zeros in the slots of the
branches not taken), the backward is a cond over the branches' R.
`while` with a data-dependent trip count has no reverse mode (as in JAX): `NO_VJP_RULE`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jgraph import ops
from jgraph.backward import (
    active_values,
    linearize_rules,
    transpose_rules,
    vjp_graph,
)
from jgraph.builder import Builder
from jgraph.ir import Eqn, Graph, Var, is_float
from jgraph.planner.loops import planned_branch
from jgraph.policies import nothing_saveable
from jgraph.regions import apply_regions, with_whole_forward_region, without_regions
from jgraph.vjp_rules import scan_restart


@dataclasses.dataclass(frozen=True)
class Split:
    """A joint body graph cut into forward F and backward R (see the module docstring)."""

    forward: Graph  # primal inputs (hoisted values after the consts) -> outputs + residuals
    backward: Graph  # const residuals + hoisted + residuals + x residuals + cts -> input cts
    const_res: tuple[int, ...]  # primal input positions R reads directly (consts, operands)
    x_res: tuple[int, ...]  # xs positions (among the primal inputs) R reads per iteration
    residuals: tuple[Var, ...]  # values F returns for R (R's inputs of the same names)
    hoisted: tuple[Eqn, ...] = ()  # loop-invariant eqns R needs, computed once outside the loop
    hoisted_vars: tuple[Var, ...] = ()  # their outputs, read by F (as consts) and by R
    hoisted_read: tuple[Var, ...] = ()  # those R reads (its inputs after the const residuals)


def is_forward(eqn: Eqn) -> bool:
    return not ({"backward", "recompute"} & eqn.tags)


# Ops never moved out of a loop body: a random op run once would not run once per iteration.
NOT_HOISTED = frozenset({"random_bits", "rng_uniform"})


def split(joint: Graph, kinds, n_out: int, hoist: bool = False) -> Split:
    """Cut `joint` (from `vjp_graph`, maybe rematerialized) into F and R. `kinds[k]` says where
    primal input k comes from: "const" (available outside, loop invariant), "x" (a slice of a
    stacked input) or "carry" (changes every iteration: stacked if R reads it).

    With `hoist` (a scan), the forward values R reads that depend on consts and literals alone
    are loop invariant: they are computed once, before the loop (`Split.hoisted`), and both F
    and R read them as consts, instead of being stacked `length` times or recomputed by every
    iteration of R (JAX hoists loop-invariant residuals alike). Without it (a cond's branches,
    which run once) every value R reads is a residual."""
    n_in = len(kinds)
    primal_in, ct_in = joint.inputs[:n_in], joint.inputs[n_in:]
    kind = dict(zip(primal_in, kinds, strict=True))
    fwd = [e for e in joint.eqns if is_forward(e)]
    bwd = [e for e in joint.eqns if not is_forward(e)]
    producer = {v: e for e in fwd for v in e.outputs}
    invariant = {v for v, k in kind.items() if k == "const"}
    if hoist:
        for e in fwd:
            if e.op not in NOT_HOISTED and not ops.has_effects(e) and all(
                    a in invariant for a in e.inputs if isinstance(a, Var)):
                invariant.update(e.outputs)
    hoisted: set[Eqn] = set()
    reads: list[Var] = []
    seen: set = set()

    def need(a):
        if not isinstance(a, Var) or a in seen:
            return
        seen.add(a)
        e = producer.get(a)
        if e is not None and a in invariant:
            if e not in hoisted:
                hoisted.add(e)
                for x in e.inputs:
                    need(x)
        else:
            reads.append(a)

    defined, direct = set(), set()
    for e in bwd:
        for a in e.inputs:
            if a not in defined:
                direct.add(a)
                need(a)
        defined.update(e.outputs)
    for a in joint.outputs[n_out:]:
        if a not in defined:
            direct.add(a)
            need(a)
    hoisted_eqns = tuple(e for e in fwd if e in hoisted)
    kept = [e for e in fwd if e not in hoisted]
    made = {v for e in hoisted_eqns for v in e.outputs}
    read_after = {a for e in kept + bwd for a in e.inputs if isinstance(a, Var)}
    read_after.update(a for a in joint.outputs if isinstance(a, Var))
    hoisted_vars = tuple(v for e in hoisted_eqns for v in e.outputs if v in read_after)
    ct_set = set(ct_in)
    position = {v: k for k, v in enumerate(primal_in)}
    const_res = tuple(position[a] for a in reads if kind.get(a) == "const")
    x_res = tuple(position[a] for a in reads if kind.get(a) == "x")
    residuals = tuple(a for a in reads
                      if a not in ct_set and a not in made and kind.get(a) not in ("const", "x"))
    r_hoisted = tuple(v for v in hoisted_vars if v in direct)
    n_const = sum(k == "const" for k in kinds)
    f_inputs = primal_in[:n_const] + hoisted_vars + primal_in[n_const:]
    forward = joint.replace(
        inputs=f_inputs, eqns=tuple(_without_regions(e) for e in kept),
        outputs=joint.outputs[:n_out] + residuals, input_roles=("data",) * len(f_inputs),
        output_roles=("aux",) * (n_out + len(residuals)), regions=())
    r_inputs = (tuple(primal_in[k] for k in const_res) + r_hoisted + residuals
                + tuple(primal_in[k] for k in x_res) + ct_in)
    backward = Graph(inputs=r_inputs, eqns=tuple(bwd),
                     outputs=joint.outputs[n_out:], input_roles=("data",) * len(r_inputs),
                     output_roles=("aux",) * (len(joint.outputs) - n_out))
    return Split(forward, backward, const_res, x_res, residuals, hoisted_eqns, hoisted_vars,
                 r_hoisted)


def _without_regions(e: Eqn) -> Eqn:
    return dataclasses.replace(e, regions=()) if e.regions else e


def joint_body(body: Graph, wrt, with_ct, policies=()) -> Graph:
    """The body's VJP graph, rematerialized by its recorded regions and by `policies` (each a
    region over the whole body, outermost first)."""
    joint = vjp_graph(body, wrt, with_ct, loop_policies=policies)
    if (body.regions or policies) and any("backward" in e.tags for e in joint.eqns):
        for policy in reversed(policies):
            joint = with_whole_forward_region(joint, policy, loops=True)
        joint = apply_regions(joint, body_outputs=len(body.outputs))
    return joint


# -- linearize: the forward op that returns residuals (`jgraph.backward.linearize` drives)
def _zeros_like(b: Builder, atom):
    return b.call(jnp.zeros_like, atom)[0]


# -- scan --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _ScanVjp:
    split: Split
    wrt: tuple[bool, ...]  # per scan input (hoisted values excluded): its cotangent is computed
    carry_ct: tuple[bool, ...]  # per carry: its cotangent flows through the loop
    y_ct: tuple[bool, ...]  # per y: it has a cotangent
    r_hoisted: tuple  # the hoisted values R reads, as outer atoms
    shifted: tuple = ()  # (residual j, (carry k, residual j2)): see `carry_shifts`
    keep_every: int | None = None  # the forward keeps every k-th carry (`scan_restart`)


def _carry_activity(body: Graph, nc: int, nk: int, active_in) -> list[bool]:
    """Which carries depend on an active input, over any number of iterations (a fixpoint)."""
    active = list(active_in)
    while True:
        reached = active_values(body, [v for v, a in zip(body.inputs, active, strict=True) if a])
        carry_out = [isinstance(o, Var) and o in reached for o in body.outputs[:nk]]
        new = active[:nc] + [a or c for a, c in zip(active[nc:nc + nk], carry_out, strict=True)] \
            + active[nc + nk:]
        if new == active:
            return active[nc:nc + nk]
        active = new


def _hoist(cut: Split, consts) -> tuple[list[Eqn], dict]:
    """Copies of the hoisted body eqns reading the scan's const operands; {body var: outer}."""
    outer = dict(zip(cut.forward.inputs[:len(consts)], consts, strict=True))
    eqns = []
    for e in cut.hoisted:
        outputs = tuple(Var(v.aval) for v in e.outputs)
        outer.update(zip(e.outputs, outputs, strict=True))
        eqns.append(dataclasses.replace(e, inputs=tuple(outer.get(a, a) for a in e.inputs),
                                        outputs=outputs))
    return eqns, outer


def _linearize_scan(eqn: Eqn, needs: set, policies=()):
    p = eqn.params
    body, nc, nk = p["body"], p["num_consts"], p["num_carry"]
    ins = eqn.inputs
    floating = [is_float(v.aval) for v in body.inputs]
    wants = [isinstance(a, Var) and a in needs and f for a, f in zip(ins, floating, strict=True)]
    carry_ct = _carry_activity(body, nc, nk, wants)
    carry_ct = [c and f for c, f in zip(carry_ct, floating[nc:nc + nk], strict=True)]
    wrt = wants[:nc] + carry_ct + wants[nc + nk:]
    y_ct = [v in needs and is_float(v.aval) for v in eqn.outputs[nk:]]
    every = p.get("keep_every")
    if every:
        policies = tuple(policies) + (nothing_saveable,)  # the body keeps its inputs
    joint = joint_body(body, wrt, carry_ct + y_ct, policies)
    kinds = ["const"] * nc + ["carry"] * nk + ["x"] * (len(ins) - nc - nk)
    cut = split(joint, kinds, len(body.outputs), hoist=True)
    hoisted, outer = _hoist(cut, ins[:nc])
    r_hoisted = tuple(outer[v] for v in cut.hoisted_read)
    n_out, first_carry = len(body.outputs), nc + len(cut.hoisted_vars)
    if every and scan_restart.restartable(cut.forward, cut.residuals, first_carry, nk):
        forward = cut.forward.replace(outputs=cut.forward.outputs[:n_out],
                                      output_roles=("aux",) * n_out)
        init, new = scan_restart.forward(
            eqn, forward, first_carry, nk, every,
            ins[:nc] + tuple(outer[v] for v in cut.hoisted_vars) + ins[nc:])
        return hoisted + init, new, _ScanVjp(cut, tuple(wrt), tuple(carry_ct), tuple(y_ct),
                                             r_hoisted, (), every)
    length = p["length"]
    shifted = carry_shifts(cut, nc, nk)
    kept = tuple(r for j, r in enumerate(cut.residuals) if j not in shifted)
    stacked = tuple(Var(r.aval.update(shape=(length, *r.aval.shape))) for r in kept)
    forward = cut.forward.replace(outputs=cut.forward.outputs[:n_out] + kept,
                                  output_roles=("aux",) * (n_out + len(kept)))
    new = dataclasses.replace(
        eqn, inputs=ins[:nc] + tuple(outer[v] for v in cut.hoisted_vars) + ins[nc:],
        outputs=eqn.outputs + stacked,
        params={**p, "body": forward, "num_consts": nc + len(cut.hoisted_vars)})
    return hoisted, new, _ScanVjp(cut, tuple(wrt), tuple(carry_ct), tuple(y_ct), r_hoisted,
                                  tuple(sorted(shifted.items())))


def carry_shifts(cut: Split, nc: int, nk: int) -> dict[int, tuple[int, int]]:
    """{residual j: (carry k, residual j2)} for each residual that is the body's carry output k
    while the carry's input is residual j2: iteration i's value of j is iteration i+1's of j2
    (the loop's final carry k for the last iteration), which the loop stacks already. The
    backward loop carries it from one iteration to the next instead of the forward loop
    stacking it again (a scanned `tanh` layer's output, which its VJP reads, is the next
    layer's input: half of what no remat stacks)."""
    position = {r: j for j, r in enumerate(cut.residuals)}
    inputs = set(cut.forward.inputs)
    carry_in = cut.forward.inputs[nc + len(cut.hoisted_vars):][:nk]
    shifted = {}
    for k, (out, into) in enumerate(zip(cut.forward.outputs[:nk], carry_in, strict=True)):
        j, j2 = position.get(out), position.get(into)
        if j is not None and j2 is not None and out not in inputs and j not in shifted \
                and out.aval == into.aval:
            shifted[j] = (k, j2)
    return shifted


def _transpose_scan(b: Builder, eqn: Eqn, how: _ScanVjp, out_cts, needed):
    p, cut = eqn.params, how.split
    n_h = len(cut.hoisted_vars)
    nc, nk, n_y = p["num_consts"] - n_h, p["num_carry"], len(how.y_ct)
    n_kept = 0  # a scan keeping every k-th carry: a step counter and a buffer per carry
    if how.keep_every:
        nk = (nk - 1) // 2
        n_kept = nk + 1
    # the scan's own operands, as linearized
    ins = eqn.inputs[:nc] + eqn.inputs[nc + n_h:nc + n_h + nk] + eqn.inputs[nc + n_h + nk + n_kept:]
    R = cut.backward
    n_const_res = len(cut.const_res) + len(how.r_hoisted)
    n_res, n_x_res = len(cut.residuals), len(cut.x_res)
    n_carry_ct = sum(how.carry_ct)
    r_const = R.inputs[:n_const_res]
    r_res = R.inputs[n_const_res:n_const_res + n_res]
    r_x = R.inputs[n_const_res + n_res:n_const_res + n_res + n_x_res]
    r_ct_carry = R.inputs[n_const_res + n_res + n_x_res:][:n_carry_ct]
    r_ct_y = R.inputs[n_const_res + n_res + n_x_res + n_carry_ct:]
    wrt_consts = [k for k in range(nc) if how.wrt[k]]
    wrt_xs = [k for k in range(nc + nk, len(ins)) if how.wrt[k]]
    ct_consts = R.outputs[:len(wrt_consts)]
    ct_carry = R.outputs[len(wrt_consts):len(wrt_consts) + n_carry_ct]
    ct_xs = R.outputs[len(wrt_consts) + n_carry_ct:]
    # The backward body: consts, carry = (carry cts, const accumulators, shifted residuals),
    # xs = (residuals, x residuals, y cts) -> (carry cts of the previous iteration,
    # accumulators, the shifted residuals' values for the previous iteration; x cts).
    inner = Builder(tags={"backward"})
    accs = tuple(Var(ins[k].aval.update(weak_type=False)) for k in wrt_consts)
    new_accs = [inner.call(jnp.add, acc, ct)[0] for acc, ct in zip(accs, ct_consts, strict=True)]
    shifted = dict(how.shifted)
    r_shift = tuple(r_res[j] for j in shifted)
    next_shift = tuple(r_res[j2] for _, j2 in shifted.values())
    r_stacked = tuple(r for j, r in enumerate(r_res) if j not in shifted)
    n_carry = n_carry_ct + len(accs) + len(r_shift)
    kept = None
    if how.keep_every:  # the residuals (carries) are recomputed from the kept ones
        kept = scan_restart.recompute(b, eqn, cut.forward, nc + n_h, nk, how.keep_every, r_res)
        r_stacked = ()
    kept_consts, kept_eqns = (kept.consts, kept.eqns) if kept else ((), ())
    body_inputs = (tuple(r_const) + kept_consts + tuple(r_ct_carry) + accs + r_shift
                   + r_stacked + ((kept.step,) if kept else ()) + tuple(r_x) + tuple(r_ct_y))
    body = Graph(inputs=body_inputs, eqns=kept_eqns + R.eqns + tuple(inner.eqns),
                 outputs=tuple(ct_carry) + tuple(new_accs) + next_shift + tuple(ct_xs),
                 input_roles=("data",) * len(body_inputs),
                 output_roles=("aux",) * (n_carry + len(ct_xs)))
    carry_outs = [k for k in range(nk) if how.carry_ct[k]]
    init = [out_cts[k] if out_cts[k] is not None else _zeros_like(b, eqn.outputs[k])
            for k in carry_outs]
    init += [_zeros_like(b, acc) for acc in accs]
    init += [eqn.outputs[k] for k, _ in shifted.values()]  # the last iteration's: final carry
    first_y = nk + n_kept
    y_cts = [out_cts[first_y + j] if out_cts[first_y + j] is not None else
             _zeros_like(b, eqn.outputs[first_y + j]) for j in range(n_y) if how.y_ct[j]]
    xs = (list(eqn.outputs[first_y + n_y:]) + ([kept.steps] if kept else [])
          + [ins[k] for k in cut.x_res] + y_cts)
    consts = [ins[k] for k in cut.const_res] + list(how.r_hoisted) + list(
        kept.const_atoms if kept else ())
    outs = b.bind("scan", *consts, *init, *xs, body=body,
                  length=p["length"], reverse=not p["reverse"],
                  num_consts=n_const_res + len(kept_consts), num_carry=n_carry,
                  unroll=p.get("unroll", 1))
    cts = [None] * len(ins)
    for k, ct in zip(carry_outs, outs[:n_carry_ct], strict=True):
        cts[nc + k] = ct
    for k, ct in zip(wrt_consts, outs[n_carry_ct:n_carry_ct + len(accs)], strict=True):
        cts[k] = ct
    for k, ct in zip(wrt_xs, outs[n_carry:], strict=True):
        cts[k] = ct
    # hoisted values: computed from consts; a step counter and kept carries: no ct
    cts = cts[:nc] + [None] * n_h + cts[nc:nc + nk] + [None] * n_kept + cts[nc + nk:]
    return [ct if use else None for ct, use in zip(cts, needed, strict=True)]


# -- cond --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _CondVjp:
    splits: tuple[Split, ...]  # per branch
    slots: tuple[tuple[int, ...], ...]  # per branch: the slot of each of its residuals
    wrt: tuple[bool, ...]  # per operand: its cotangent is computed
    with_ct: tuple[bool, ...]  # per output: it has a cotangent


def _linearize_cond(eqn: Eqn, needs: set, policies=()):
    branches = eqn.params["branches"]
    operands = eqn.inputs[1:]
    wrt = [isinstance(a, Var) and a in needs and is_float(a.aval) for a in operands]
    with_ct = [v in needs and is_float(v.aval) for v in eqn.outputs]
    n_out = len(eqn.outputs)
    fraction = eqn.params.get("plan_fraction")
    if fraction is None:
        joints = [joint_body(g, wrt, with_ct, policies) for g in branches]
    else:  # each branch's forward and backward planned like straight-line code, the plan
        joints = [planned_branch(joint_body(without_regions(g), wrt, with_ct, policies),
                                 fraction) for g in branches]
    splits = [split(j, ["const"] * len(operands), n_out) for j in joints]
    slots, slot_avals = cond_slots(splits)
    forwards = []
    for s, mine in zip(splits, slots, strict=True):
        fill = Builder()  # the slots the branch does not use hold zeros
        held = dict(zip(mine, s.forward.outputs[n_out:], strict=True))
        outs = [held[k] if k in held else
                fill.call(jnp.zeros, shape=a.shape, dtype=a.dtype)[0]
                for k, a in enumerate(slot_avals)]
        forwards.append(s.forward.replace(
            eqns=s.forward.eqns + tuple(fill.eqns),
            outputs=s.forward.outputs[:n_out] + tuple(outs),
            output_roles=("aux",) * (n_out + len(slot_avals))))
    res = tuple(Var(a) for a in slot_avals)
    new = dataclasses.replace(eqn, outputs=eqn.outputs + res,
                              params={**eqn.params, "branches": tuple(forwards)})
    return [], new, _CondVjp(tuple(splits), tuple(slots), tuple(wrt), tuple(with_ct))


def cond_slots(splits) -> tuple[list[tuple[int, ...]], list]:
    """(per branch, the slot of each residual; the slots' avals). Only one branch runs, so
    branches share slots: a residual takes a slot of its aval that an earlier branch uses and
    its own branch does not yet, or a new one (two branches of the same layers need one set)."""
    slot_avals, slots = [], []
    for s in splits:
        mine = []
        for r in s.residuals:
            k = next((k for k, a in enumerate(slot_avals) if a == r.aval and k not in mine),
                     None)
            if k is None:
                k = len(slot_avals)
                slot_avals.append(r.aval)
            mine.append(k)
        slots.append(tuple(mine))
    return slots, slot_avals


def _transpose_cond(b: Builder, eqn: Eqn, how: _CondVjp, out_cts, needed):
    """cond(index, R_0, R_1, ...) over (operands, all residual slots, output cotangents)."""
    operands = eqn.inputs[1:]
    n_out = len(how.with_ct)
    slot_vars = eqn.outputs[n_out:]
    ct_outs = [k for k in range(n_out) if how.with_ct[k]]
    branches = []
    for s, mine in zip(how.splits, how.slots, strict=True):
        R = s.backward  # inputs: const residuals (operands), own residuals, cts
        op_vars = [Var(a.aval) for a in operands]
        for i, k in enumerate(s.const_res):
            op_vars[k] = R.inputs[i]
        slots = [Var(v.aval) for v in slot_vars]
        for i, k in enumerate(mine):
            slots[k] = R.inputs[len(s.const_res) + i]
        ct_vars = R.inputs[len(s.const_res) + len(mine):]
        inputs = tuple(op_vars) + tuple(slots) + tuple(ct_vars)
        branches.append(Graph(inputs=inputs, eqns=R.eqns, outputs=R.outputs,
                              input_roles=("data",) * len(inputs),
                              output_roles=("aux",) * len(R.outputs)))
    cts_in = [out_cts[k] if out_cts[k] is not None else _zeros_like(b, eqn.outputs[k])
              for k in ct_outs]
    outs = iter(b.bind("cond", eqn.inputs[0], *operands, *slot_vars, *cts_in,
                       branches=tuple(branches)))
    cts = [None] + [next(outs) if w else None for w in how.wrt]
    return [ct if use else None for ct, use in zip(cts, needed, strict=True)]


linearize_rules["scan"], transpose_rules["scan"] = _linearize_scan, _transpose_scan
linearize_rules["cond"], transpose_rules["cond"] = _linearize_cond, _transpose_cond

# Ops whose VJP is built here (from their bodies), not by a rule in `vjp_rules`.
TRANSPOSED = frozenset({"scan", "cond"})
