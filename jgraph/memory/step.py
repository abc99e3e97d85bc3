"""The programs XLA compiles: the donated training step of a graph, and a loop's body.

`step_program(graph)` is what `jg.compiled_memory` compiles (`jgraph.memory.compiled`): the
graph's state inputs (params, accumulators, optimizer state, counters) are donated; without
`new_param` outputs, each grad feeds an SGD update `p - lr * g` of its param. JAX aliases each
result to the first unused donated argument of the same shape and dtype, results in order (the
step returns each state's new value first, in its inputs' order: `jgraph.lower.donation_order`),
and XLA writes it there. Where a donated argument is still read by a kernel its result's writer does
not depend on, XLA's copy insertion copies the argument first (a temp), and the argument's
allocation is free until the result is written: temps may live there (`jgraph.memory.buffers`).

`body_program(body, ...)` is a loop body as XLA runs it: its carries are the loop's state
buffers (an old carry read after the new one is written is copied, as for a donated argument),
a scan's x slices are dynamic slices of the stacked inputs (fused into their readers) and its y
slices are written in place into the stacked outputs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from jgraph import opkinds
from jgraph.ir import Eqn, Graph, Literal, Var
from jgraph.lower import donation_order
from jgraph.memory.flatten import Ops, flatten
from jgraph.memory.program import Kernel, Value, connect, kernels
from jgraph.roles import donated_buffers
from jgraph.target import STATE_ROLES


@dataclass
class Program:
    kernels: list[Kernel]  # in the graph's schedule order (XLA's scheduler reorders them)
    values: list[Value]  # every buffer, arguments included
    results: list[Value]  # what the computation returns, in order (the scheduler starts there)
    aliased: list[tuple[Value, Value]]  # (donated argument, result written into its allocation)
    origin: dict = field(default_factory=dict)  # a rewritten eqn -> the graph's eqn
    overhead: int = 0  # bytes of a loop's own small buffers (0 for the step)


def sgd_plan(graph: Graph):
    """(is_state per input, whether grads feed an SGD update, the param index of each grad)."""
    is_state = [r in STATE_ROLES for r in graph.input_roles]
    updates_itself = any(r == "new_param" for r in graph.output_roles)
    params = [k for k, r in enumerate(graph.input_roles) if r == "param"]
    grads = [k for k, r in enumerate(graph.output_roles) if r == "grad"]
    sgd = not updates_itself and len(grads) == len(params) > 0
    index = {v: k for k, v in enumerate(graph.inputs)}
    grad_params = [index[v] for v in graph.grad_params()] if sgd else []
    return is_state, sgd, grad_params


def step_program(graph: Graph, workspace, decided: dict | None = None) -> Program:
    """The donated step of `graph` (as `jgraph.memory.compiled.donated_step` builds it);
    `decided`: XLA's fusion decisions on the graph's values, where one compile showed them
    (`jgraph.memory.fusions`)."""
    is_state, sgd, grad_params = sgd_plan(graph)
    ops = flatten(graph)
    roles = {}
    results: list = []  # the step's flat results, in order: atoms of `ops`
    if sgd:
        grads = [a for a, r in zip(graph.outputs, graph.output_roles, strict=True) if r == "grad"]
        new = {k: graph.inputs[k] for k, s in enumerate(is_state) if s}
        for k, g in zip(grad_params, grads, strict=True):
            p = graph.inputs[k]
            out = Var(p.aval)
            update = Eqn("sub", (p, ops.root(g)), {}, (out,))
            ops.eqns.append(update)
            roles[update] = "update"
            new[k] = out
        results = [new[k] for k in sorted(new)]
        results += [ops.root(a) for a, r in zip(graph.outputs, graph.output_roles, strict=True)
                    if r != "grad"]
    else:
        results = [ops.root(graph.outputs[k]) for k in donation_order(graph, is_state)]
    donated = [v for v, s in zip(graph.inputs, is_state, strict=True) if s]
    alias = _jax_aliases(donated, results)
    inputs = {v: Value(v, opkinds.nbytes(v.aval), "input") for v in graph.inputs}
    for d in alias.values():
        inputs[d].kind = "donated"
    written = {r: d for r, d in alias.items() if r is not d}

    def kind_of(var):
        if var in written:
            return "state"
        return "output" if var in live_out else "temp"

    live_out = {a for a in results if isinstance(a, Var)}
    return _program(ops, inputs, results, written, kind_of, roles, workspace, reusable=True,
                    decided=decided)


def _jax_aliases(donated: list[Var], results: list) -> dict:
    """result -> the donated argument JAX writes it into (`jgraph.roles.donated_buffers`), for
    the first place a value is returned (XLA copies it into the others)."""
    alias: dict = {}
    for a, d in zip(results, donated_buffers(donated, results), strict=True):
        if d is not None and isinstance(a, Var) and a not in alias:
            alias[a] = d
    return alias


def _program(ops, inputs, results, written, kind_of, roles, workspace, reusable,
             decided=None) -> Program:
    external = {a for a in results if isinstance(a, Var)}
    found = kernels(ops.eqns, ops.root, external, workspace, decided or {})
    for k in found:
        k.role = roles.get(k.root, k.role)
    values = dict(inputs)
    created = connect(found, ops.root, values, kind_of)
    result_values = [values[a] for a in results if isinstance(a, Var)]
    aliased = [(values[d], values[r]) for r, d in written.items() if r in values]
    program = Program(found, list(inputs.values()) + created, result_values,
                      aliased if reusable else [], ops.origin)
    _insert_copies(program, aliased)
    return program


def _insert_copies(program: Program, aliased) -> None:
    """XLA's copy insertion for arguments whose allocation a result is written into: copy the
    argument first when a kernel reading it is not an ancestor of the result's writer."""
    watched = {arg: writer.kernel for arg, writer in aliased if writer.kernel is not None}
    if not watched:
        return
    bit = {}
    for arg in watched:
        for reader in arg.readers:
            bit.setdefault(reader, 1 << len(bit))
    ancestors: dict[Kernel, int] = {}
    for k in program.kernels:  # schedule order is topological
        mask = 0
        for v in k.reads:
            p = v.kernel
            if p is not None:
                mask |= ancestors[p] | bit.get(p, 0)
        ancestors[k] = mask
    for arg, writer in watched.items():
        others = [r for r in arg.readers if r is not writer]
        need = 0
        for r in others:
            need |= bit[r]
        if not others or ancestors[writer] & need == need:
            continue
        copy = Kernel(None, "copy")
        copy.order = min(r.order for r in arg.readers) - 0.5
        value = Value(arg.var, arg.size, "temp", copy)
        copy.writes.append(value)
        for r in list(arg.readers):
            r.reads = [value if v is arg else v for v in r.reads]
            value.readers.append(r)
        arg.readers = []
        copy.read(arg)
        program.kernels.insert(_position(program.kernels, copy.order), copy)
        program.values.append(value)


def _position(found: list[Kernel], order: float) -> int:
    """Where a kernel of `order` goes: before the first of a later order (`found` is sorted)."""
    return bisect.bisect_right(found, order, key=lambda k: k.order)


# -- loop bodies -------------------------------------------------------------------------------
def body_program(body: Graph, n_consts: int, n_carry: int, scan: bool, workspace) -> Program:
    """A loop body as XLA runs it: consts, carries, then (for a scan) x slices in; carries, then
    y slices out. Carries are state, x slices dynamic slices of the stacks, y slices written in
    place into the stacked outputs."""
    ops = Ops()
    inputs = {}
    for v in body.inputs if not scan else body.inputs[:n_consts + n_carry]:
        inputs[v] = Value(v, opkinds.nbytes(v.aval), "input")
    for v in body.inputs[n_consts + n_carry:] if scan else ():
        stack = Var(v.aval.update(shape=(1,) + tuple(v.aval.shape)))
        inputs[stack] = Value(stack, opkinds.nbytes(v.aval), "input")
        ops.eqns.append(Eqn("dynamic_slice", (stack,), {}, (v,)))
    flatten(body, ops)
    results, written = [], {}
    carry_in = body.inputs[n_consts:n_consts + n_carry]
    for k, a in enumerate(body.outputs):
        a = ops.root(a)
        if k < n_carry:
            if isinstance(a, Var) and a is not carry_in[k] and a not in written:
                written[a] = carry_in[k]
            results.append(a)
        elif scan and isinstance(a, Var):
            stack = Var(a.aval)
            inputs[stack] = Value(stack, opkinds.nbytes(a.aval), "input")
            out = Var(a.aval)
            ops.eqns.append(Eqn("dynamic_update_slice", (stack, a), {}, (out,)))
            written[out] = stack
            results.append(out)
        else:
            results.append(a)
    written = {r: d for r, d in written.items() if not isinstance(r, Literal)}
    program = _program(ops, inputs, results, written, lambda var: "state"
                       if var in written or var in results else "temp", {}, workspace,
                       reusable=False)
    n = 1 + len(body.inputs) + len(body.outputs) - n_carry
    program.overhead = opkinds.loop_overhead(n)
    return program

