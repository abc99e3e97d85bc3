"""`fuse_updates(graph)`: each update applied where its gradient is made.

A step graph (`jg.optimizer_step`, `jg.accumulate`) computes every gradient, then updates the
params, the optimizer state and the accumulators. The update eqns are the untagged eqns after the
backward begins that read nothing the forward made (only graph inputs, the backward's values and
each other's); the values they read from the backward are the gradients. This pass moves them:

- An output (a new param, optimizer state or accumulator) whose update reads one gradient, a
  slice output `ys` of a backward `scan` stacked over its iterations, and acts on each slice
  independently, moves into that scan's body. Iteration i reads slice i of the stacked inputs
  (the param, the moments, the accumulator), computes slice i of the new value and writes it into
  the stack, which the scan carries, in place: the stacked gradient is never made (unless the
  graph returns it: `keep_grads=False` drops the `grad` outputs, which a training step does not
  need). Slice-wise is decided on the IR by a rule table (`SLICE_RULES`): elementwise ops,
  reductions over axes other than the stacked one, broadcasts, reshapes and transposes that keep
  it. What such an eqn reads whole (the step count, a schedule's learning rate, a constant) must
  not depend on the scan: it is computed before the loop and read as a const.
- Any other update moves to right after the last gradient it reads: each param's update follows
  its gradient, and frees it. An update reading several gradients (a global norm) stays after
  the last of them, unfused.

`graph.info["fuse_updates"]` maps each param's argument path to `{"fused", "where", "reason"}`:
`"scan"`, `"after"` its gradient or at the `"end"`, and the eqn that prevents fusing (with its
source line). Values are the input graph's bit for bit under `jg.evaluate` (same ops, same values).

On XLA:CPU, a fused scan passes the slices it reads and those it writes through a `cond` XLA
cannot fuse into (as `jgraph.lower`'s fusion cuts do): otherwise XLA fuses the reads of every
stack into the writes of the others, and copies whole stacks to write them in place. A scan
keeping every k-th carry (`jgraph.vjp_rules.scan_restart`) also reads the param stack whole, to
recompute earlier iterations; fused, it reads it from the carry the update writes (the slices it
reads are those the backward has not reached), or XLA would copy the stack to write the carry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jgraph.builder import Builder
from jgraph.check import validate
from jgraph.errors import TransformError
from jgraph.fuse.slices import SLICE, STATE_OF, slice_form, sliced
from jgraph.ir import Eqn, Graph, Var, eqn_lines, is_float
from jgraph.naming import format_eqn
from jgraph.passes import dce, without_unused_ys
from jgraph.roles import updated_inputs


# -- the analysis: update eqns, gradients, and what can move into a scan -----------------------
@dataclass(frozen=True)
class Blocked:
    eqn: Eqn | None  # the eqn that prevents fusion (None: no single eqn)
    why: str  # what it does

    def text(self, texts: dict) -> str:
        """The reason, with the eqn as `texts` ({id(eqn): its line in the graph}) prints it."""
        if self.eqn is None:
            return self.why
        where = f" ({self.eqn.source})" if self.eqn.source else ""
        return f"{self.why}: `{texts.get(id(self.eqn)) or format_eqn(self.eqn)}`{where}"


@dataclass
class Step:
    """The update part of a step graph, as the analysis sees it."""

    graph: Graph
    update: set  # indices of the update eqns
    producer: dict  # top-level var -> index of the eqn making it
    sources: dict  # update eqn index -> the gradients (non-update values) its cone reads
    meets: dict  # update eqn index -> the first eqn of its cone reading several gradients


def find_update(graph: Graph) -> Step:
    """The update eqns (module docstring) and the gradients each one's cone reads."""
    producer = {v: i for i, e in enumerate(graph.eqns) for v in e.outputs}
    allowed = set(graph.inputs)  # what an update reads: inputs, the backward's and its own values
    update, began = set(), False
    for i, e in enumerate(graph.eqns):
        if {"backward", "recompute"} & e.tags:
            began = True
            allowed.update(e.outputs)
        elif began and all(a in allowed for a in e.inputs if isinstance(a, Var)):
            update.add(i)
            allowed.update(e.outputs)
    sources, meets = {}, {}
    for i in sorted(update):
        found, met = set(), []
        for a in graph.eqns[i].inputs:
            k = producer.get(a) if isinstance(a, Var) else None
            if k in update:
                found |= sources[k]
                met += [meets[k]] if meets[k] is not None else []
            elif k is not None:
                found.add(a)
        sources[i] = frozenset(found)
        meets[i] = min(met) if met else (i if len(found) > 1 else None)
    return Step(graph, update, producer, sources, meets)


@dataclass
class ScanPlan:
    """What moves into backward scan `index`: the outputs, the eqns run per slice, the stacked
    values they read (a `ys` of the scan, or a value made before it) and the whole ones."""

    index: int
    outputs: list = dataclasses.field(default_factory=list)  # (output var, state input | None)
    eqns: set = dataclasses.field(default_factory=set)  # update eqn indices, run per slice
    stacked: dict = dataclasses.field(default_factory=dict)  # atom -> "y" | "input" | "xs"
    whole: dict = dataclasses.field(default_factory=dict)  # var -> None, in order


def _scan_of(step: Step, grads) -> int | None:
    """The backward scan whose stacked outputs `ys` are all of `grads`, or None."""
    found = {step.producer.get(g) for g in grads}
    if len(found) != 1:
        return None
    (k,) = found
    e = step.graph.eqns[k] if k is not None else None
    if e is None or e.op != "scan" or "backward" not in e.tags:
        return None
    ys = set(e.outputs[e.params["num_carry"]:])
    return k if all(g in ys for g in grads) else None


def slice_cone(step: Step, out: Var, s: int, plan: ScanPlan) -> Blocked | None:
    """Add what computes `out` slice by slice in scan `s` to `plan`, or say what prevents it."""
    scan = step.graph.eqns[s]
    length = scan.params["length"]
    ys = set(scan.outputs[scan.params["num_carry"]:])
    cone, stacked, whole = set(), {}, {}
    todo, seen = [out], set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        k = step.producer.get(v) if isinstance(v, Var) else None
        if v in ys:
            stacked[v] = "y"
        elif k is None or (k not in step.update and k < s):
            stacked[v] = "input" if k is None and isinstance(v, Var) else "xs"
        elif k not in step.update:
            return Blocked(step.graph.eqns[k], "reads a value made after the backward scan")
        else:
            form = slice_form(step.graph.eqns[k], length)
            if form is None:
                return Blocked(step.graph.eqns[k], "acts across the scan's slices")
            cone.add(k)
            for a, mode in zip(step.graph.eqns[k].inputs, form[0], strict=True):
                if mode == SLICE:
                    todo.append(a)
                elif isinstance(a, Var):
                    whole[a] = None
    for w in whole:
        blocked = _whole_problem(step, w, s)
        if blocked is not None:
            return blocked
    plan.eqns |= cone
    plan.stacked.update(stacked)
    plan.whole.update(whole)
    return None


def _whole_problem(step: Step, w: Var, s: int) -> Blocked | None:
    """Why `w`, read whole by every iteration, cannot be computed before scan `s` (or None)."""
    cone, late, todo, seen = set(), set(), [w], set()
    while todo:
        v = todo.pop()
        k = step.producer.get(v) if isinstance(v, Var) else None
        if k is None or v in seen:
            continue
        seen.add(v)
        if k in step.update:
            cone.add(k)
            todo.extend(step.graph.eqns[k].inputs)
        elif k >= s:
            late.add(k)
    if not late:
        return None
    length = step.graph.eqns[s].params["length"]
    after = {v for k in late for v in step.graph.eqns[k].outputs}
    for k in sorted(cone):  # where the slices meet: the first update eqn that is not slice-wise
        e = step.graph.eqns[k]
        if any(a in after for a in e.inputs):
            if slice_form(e, length) is None:
                return Blocked(e, "needs all slices of the gradient first")
            after.update(e.outputs)
    return Blocked(step.graph.eqns[min(late)], "reads a value made after the backward scan")


# -- the rewrite: a backward scan that also writes the updated slices --------------------------
def _slice_at(stack, i):
    return lax.dynamic_index_in_dim(stack, i, 0, keepdims=False, allow_negative_indices=False)


def _write_at(stack, value, i):
    return lax.dynamic_update_slice(stack, value[None], (i,) + (0,) * value.ndim,
                                    allow_negative_indices=False)


def _iota(*, length):
    return lax.iota(np.int32, length)


def _materialised(*values, anchor):
    """`values` unchanged, each a buffer XLA:CPU cannot fuse its producer into: they pass through
    `cond(c < -|c|, zeros, identity)` with `c` an element of `values[anchor]`, which is false for
    every float (`jgraph.lower` explains the trick). Elsewhere they are returned as they are."""
    def on_cpu(*values):
        c = jnp.reshape(values[anchor], (-1,))[0]
        return lax.cond(c < -jnp.abs(c), lambda *v: [jnp.zeros_like(x) for x in v],
                        lambda *v: list(v), *values)

    return lax.platform_dependent(*values, cpu=on_cpu, default=lambda *v: list(v))


def _materialise(b: Builder, values: list) -> list:
    """`values` through `_materialised` (anchored on the first float), or as they are."""
    anchor = next((k for k, v in enumerate(values) if isinstance(v, Var) and is_float(v.aval)
                   and not jnp.issubdtype(v.aval.dtype, jnp.complexfloating) and v.aval.size),
                  None)
    return values if anchor is None else b.call(_materialised, *values, anchor=anchor)


def _renamed(eqn: Eqn, rename: dict) -> Eqn:
    if not any(isinstance(a, Var) and a in rename for a in eqn.inputs):
        return eqn
    return dataclasses.replace(eqn, inputs=tuple(rename.get(a, a) if isinstance(a, Var) else a
                                                 for a in eqn.inputs))


def fused_scan(step: Step, plan: ScanPlan) -> tuple[list[Eqn], Eqn, dict]:
    """(eqns to run before it, the scan running the plan's updates per iteration, {fused output
    var: the scan's output holding it}). Each fused output's state input becomes a carry written
    at slice i (in place); the stacked xs that are such inputs are read from the carry."""
    scan = step.graph.eqns[plan.index]
    p = scan.params
    body, nc, nk, length = p["body"], p["num_consts"], p["num_carry"], p["length"]
    written = list(dict.fromkeys(state for _, state in plan.outputs if state is not None))
    read_only = [a for a, kind in plan.stacked.items() if kind != "y" and a not in written]
    whole = list(plan.whole)
    pre = Builder()
    (iota,) = pre.call(_iota, length=length)
    t_in, w_in = {t: Var(t.aval) for t in written}, [Var(w.aval) for w in whole]
    i_in, r_in = Var(iota.aval.update(shape=())), [Var(sliced(a.aval)) for a in read_only]
    # slice i of the written stacks, read (into buffers of their own) before any is written
    reads = Builder()
    xs = list(zip(scan.inputs[nc + nk:], body.inputs[nc + nk:], strict=True))
    read = [t for t in written if t in plan.stacked or any(x is t for x, _ in xs)]
    slices = dict(zip(read, _materialise(reads, [reads.call(_slice_at, t_in[t], i_in)[0]
                                                 for t in read]), strict=True))
    rename = {bx: slices[x] for x, bx in xs if isinstance(x, Var) and x in t_in}
    kept = [(x, bx) for x, bx in xs if bx not in rename]
    through = _consts_through_carry(body, scan.inputs[:nc], t_in)
    rename.update(through)
    k_consts = [(c, bc) for c, bc in zip(scan.inputs[:nc], body.inputs[:nc], strict=True)
                if bc not in through]
    y_body = dict(zip(scan.outputs[nk:], body.outputs[nk:], strict=True))
    env = {}  # a top-level value read per slice -> its slice i in the body
    for a, kind in plan.stacked.items():
        if kind == "y":
            env[a] = rename.get(y_body[a], y_body[a])
        else:
            env[a] = slices[a] if a in t_in else r_in[read_only.index(a)]
    consts = dict(zip(whole, w_in, strict=True))
    updates = []
    for k in sorted(plan.eqns):
        e = step.graph.eqns[k]
        modes, params, avals = slice_form(e, length)
        ins = tuple(env[a] if m == SLICE else consts.get(a, a)
                    for a, m in zip(e.inputs, modes, strict=True))
        outs = tuple(Var(aval) for aval in avals)
        updates.append(Eqn(e.op, ins, params, outs, e.tags, (), e.source))
        env.update(zip(e.outputs, outs, strict=True))
    finish = Builder()
    new = list(dict.fromkeys(env[o] for o, _ in plan.outputs))
    done = dict(zip(new, _materialise(finish, new), strict=True))
    t_out = []
    for t in written:
        value = next(done[env[o]] for o, state in plan.outputs if state is t)
        t_out.append(finish.call(_write_at, t_in[t], value, i_in)[0])
    extra = [done[env[o]] for o, state in plan.outputs if state is None]
    carry_out = tuple(rename.get(a, a) if isinstance(a, Var) else a for a in body.outputs)
    inputs = (tuple(bc for _, bc in k_consts) + tuple(w_in) + body.inputs[nc:nc + nk]
              + tuple(t_in.values())
              + tuple(bx for _, bx in kept) + (i_in,) + tuple(r_in))
    outputs = carry_out[:nk] + tuple(t_out) + carry_out[nk:] + tuple(extra)
    new_body = body.replace(
        inputs=inputs, outputs=outputs, input_roles=("data",) * len(inputs),
        output_roles=("aux",) * len(outputs),
        eqns=tuple(reads.eqns) + tuple(_renamed(e, rename) for e in body.eqns) + tuple(updates)
        + tuple(finish.eqns))
    stacks = [Var(t.aval) for t in written]
    extra_ys = [Var(v.aval.update(shape=(length, *v.aval.shape))) for v in extra]
    fused = dataclasses.replace(
        scan, inputs=(tuple(c for c, _ in k_consts) + tuple(whole) + scan.inputs[nc:nc + nk]
                      + tuple(written) + tuple(x for x, _ in kept) + (iota,) + tuple(read_only)),
        outputs=scan.outputs[:nk] + tuple(stacks) + scan.outputs[nk:] + tuple(extra_ys),
        params={**p, "body": new_body, "num_consts": len(k_consts) + len(whole),
                "num_carry": nk + len(written)})
    where = dict(zip(written, stacks, strict=True))
    moved = {o: where[state] for o, state in plan.outputs if state is not None}
    moved.update(zip([o for o, state in plan.outputs if state is None], extra_ys, strict=True))
    return pre.eqns, fused, moved


def _consts_through_carry(body: Graph, consts, t_in: dict) -> dict:
    """{body const: the carry it is read from}: a written stack also read whole as a const of
    the scan, only by the recompute loops of a scan keeping every k-th carry
    (`jgraph.vjp_rules.scan_restart`, scans marked `mean_runs`). Those read the stack at forward
    iterations before the current one, which the backward has not reached, so the carry still
    holds their old slices there; read from the carry, the stack is not also a const, which
    XLA would copy whole to write the carry in place."""
    readers: dict = {}
    for e in body.eqns:
        for a in e.inputs:
            if isinstance(a, Var):
                readers.setdefault(a, []).append(e)
    outputs = {a for a in body.outputs if isinstance(a, Var)}
    found = {}
    for c, bc in zip(consts, body.inputs[:len(consts)], strict=True):
        if not (isinstance(c, Var) and c in t_in) or bc in outputs:
            continue
        if all(e.op == "scan" and "mean_runs" in e.params for e in readers.get(bc, ())):
            found[bc] = t_in[c]
    return found


def schedule(eqns: list, is_update) -> list:
    """`eqns` with each update eqn right after the last other eqn it depends on (its gradient),
    and what it reads that no gradient made (shared scalars) right before its first reader."""
    producer = {v: e for e in eqns for v in e.outputs}
    anchor, position = {}, {}
    for k, e in enumerate(eqns):
        position[id(e)] = k
        if is_update(e):
            anchor[id(e)] = max((anchor[id(producer[a])] if is_update(producer[a])
                                 else position[id(producer[a])]
                                 for a in e.inputs if isinstance(a, Var) and a in producer),
                                default=-1)
    placed, out = set(), []

    def place(e):
        todo = [(e, False)]
        while todo:
            e, ready = todo.pop()
            if id(e) in placed:
                continue
            if ready:
                placed.add(id(e))
                out.append(e)
                continue
            todo.append((e, True))
            for a in reversed(e.inputs):
                q = producer.get(a) if isinstance(a, Var) else None
                if q is not None and id(q) not in placed:
                    todo.append((q, False))

    after = {}
    for e in eqns:
        if is_update(e) and anchor[id(e)] >= 0:
            after.setdefault(anchor[id(e)], []).append(e)
    for k, e in enumerate(eqns):
        if not is_update(e):
            place(e)
            for u in after.get(k, ()):
                place(u)
    for e in eqns:
        place(e)
    return out


# -- the public transform ----------------------------------------------------------------------
def without_grads(graph: Graph, *, placeholder: bool = False) -> Graph:
    """`graph` without its `grad` outputs (a training step updates the params and need not
    return the gradients: then a fused update leaves no stacked gradient). `placeholder`: the
    grads' part of the result becomes `None` instead of going, so the parts after it keep their
    positions. `info["with_grads"]` is `graph`, which `jg.remat` plans (its loop modes are
    derived with the grads) before leaving them out again."""
    drop = [k for k, r in enumerate(graph.output_roles) if r == "grad"]
    if not drop:
        return graph
    tree = graph.out_tree
    if tree is not None:
        parts, start = list(tree.children()), 0
        for j, part in enumerate(parts):
            if list(range(start, start + part.num_leaves)) == drop:
                del parts[j]
                break
            start += part.num_leaves
        else:
            raise TransformError("jg.fuse_updates(keep_grads=False): the grads are not one part "
                                 "of the graph's result, so they cannot be left out")
        values = [jax.tree.unflatten(t, [0] * t.num_leaves) for t in parts]
        if placeholder:
            values.insert(j, None)
        tree = jax.tree.structure(tuple(values))
    keep = [k for k in range(len(graph.outputs)) if k not in drop]
    return graph.replace(outputs=tuple(graph.outputs[k] for k in keep),
                         output_roles=tuple(graph.output_roles[k] for k in keep), out_tree=tree,
                         info={**graph.info, "with_grads": (graph, placeholder)})


def with_grads(graph: Graph) -> tuple[Graph, bool] | None:
    """(the graph `without_grads` made `graph` from, its `placeholder`), or None when `graph`
    was not made so or was changed since."""
    found = graph.info.get("with_grads")
    if found is None or found[0].eqns is not graph.eqns:
        return None
    return found


def _state_inputs(graph: Graph) -> list:
    """Per output: the param, optimizer state or accumulator input it is the new value of (same
    shape and dtype), or None."""
    return [old if role in STATE_OF else None
            for old, role in zip(updated_inputs(graph), graph.output_roles, strict=True)]


def plan_updates(step: Step, pairs) -> tuple[dict, dict]:
    """({scan index: ScanPlan}, {output position: (where, Blocked | None)})."""
    g = step.graph
    plans, status = {}, {}
    for pos, (out, role) in enumerate(zip(g.outputs, g.output_roles, strict=True)):
        k = step.producer.get(out) if isinstance(out, Var) else None
        if role not in STATE_OF:
            continue
        if k not in step.update:  # an input passed through, or fused already
            done = k is not None and g.eqns[k].op == "scan" and "backward" in g.eqns[k].tags
            status[pos] = ("scan" if done else "after", None)
            continue
        grads = step.sources.get(k, frozenset())
        s = _scan_of(step, grads) if grads else None
        if len(grads) > 1 and s is None:
            met = step.meets[k]
            status[pos] = ("end", Blocked(None if met is None else g.eqns[met],
                                          "needs the gradients of several params first"))
        elif s is None or out.aval.shape[:1] != (g.eqns[s].params["length"],):
            status[pos] = ("after", None)
        else:
            plan = plans.setdefault(s, ScanPlan(s))
            blocked = slice_cone(step, out, s, plan)
            if blocked is None:
                plan.outputs.append((out, pairs[pos]))
            status[pos] = ("after", blocked) if blocked else ("scan", None)
    return plans, status


def _report(graph: Graph, status: dict) -> dict:
    """Per param (by argument path): where its update went, and what prevents fusing it."""
    role = "new_param" if "new_param" in graph.output_roles else "new_accumulator"
    positions = [k for k, r in enumerate(graph.output_roles) if r == role]
    paths, index = graph.input_paths(), {v: k for k, v in enumerate(graph.inputs)}
    texts = dict(zip(map(id, graph.eqns), eqn_lines(graph)[1], strict=True))
    report = {}
    for param, pos in zip(graph.grad_params(), positions, strict=False):
        where, blocked = status[pos]
        report[paths[index[param]]] = {
            "fused": blocked is None and where in ("scan", "after"), "where": where,
            "reason": None if blocked is None else blocked.text(texts)}
    return report


def fuse_updates(graph: Graph, *, keep_grads: bool = True) -> Graph:
    """`graph` with each optimizer update where its gradient is made.

    A gradient stacked over a backward scan's iterations has its update moved into the scan's
    body (when the update acts on each slice: elementwise ops, per-slice reductions, shared
    scalars); any other update goes right after its gradient. Bitwise the unfused step under
    `jg.evaluate`.

    Args:
        graph: a training step with an optimizer update (`jg.optimizer_step`) or an accumulation
            (`jg.accumulate`).
        keep_grads: keep the `grad` outputs; `False` leaves them out, so a stacked gradient is
            never made.

    Returns:
        The fused `Graph`. `info["fuse_updates"]` reports, per param, whether its update was
        `fused`, `where` (`"scan"`, or after its gradient), and the `reason` (the eqn) that
        prevented it."""
    validate(graph, "jg.fuse_updates")
    if not isinstance(keep_grads, bool):
        raise TransformError(f"jg.fuse_updates: keep_grads must be a bool, got {keep_grads!r}")
    if not any(r in STATE_OF for r in graph.output_roles):
        raise TransformError(
            "jg.fuse_updates: the graph has no optimizer update (no new_param outputs) and no "
            "accumulation (no new_accumulator outputs); build the step with "
            "jg.optimizer_step(jg.backward(g), tx) or jg.accumulate(jg.backward(g), period)")
    if not keep_grads:
        graph = without_grads(graph)
    step = find_update(graph)
    plans, status = plan_updates(step, _state_inputs(graph))
    eqns, moved, fused = [], {}, []
    for i, e in enumerate(graph.eqns):
        plan = plans.get(i)
        if plan is None or not plan.outputs:
            eqns.append(e)
            continue
        pre, scan, outs = fused_scan(step, plan)
        eqns += [*pre, scan]
        fused.append(scan)
        moved.update(outs)
    update = {id(graph.eqns[k]) for k in step.update}
    eqns = schedule(eqns, lambda e: id(e) in update)
    outputs = tuple(moved.get(a, a) if isinstance(a, Var) else a for a in graph.outputs)
    result = dce(graph.replace(eqns=tuple(eqns), outputs=outputs))
    live = {a for e in result.eqns for a in e.inputs if isinstance(a, Var)}
    live.update(a for a in result.outputs if isinstance(a, Var))
    ids = {id(s) for s in fused}
    return result.replace(
        eqns=tuple(without_unused_ys(e, live) if id(e) in ids else e for e in result.eqns),
        info={**graph.info, "fuse_updates": _report(graph, status)})
