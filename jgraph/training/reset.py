"""`reset(g)`: the graph producing the reset value of every state input of a training graph.

ggml_graph_reset made a pure function: given the params, it returns accumulators set to zero, the
micro-step counter set to 0, a loss seed of 1 and the optimizer state as `tx.init` gives it (which
zeroes AdamW's moments and its step count). The result is called as `reset_graph(params)` and
returns a dict with the parts the training graph has: `grad_acc`, `opt_state`, `counter`,
`loss_seed`. (Zeroing the accumulators at the start of each period happens inside the micro-step
graph, see `jgraph.training.accumulate`; this graph builds the initial state and serves
`Optimizer.reset`.)

`first_micro_step(g)` specialises a micro-step graph (from `accumulate`, possibly with an optimizer
step) to the first micro-step of a period, where the accumulators are known to be zero: the
counter input is replaced by 0, scalar constants are folded, selects on a known predicate pick
their operand, and dead eqns are dropped, so no eqn reads an accumulator. The signature is kept
(accumulator and counter inputs stay, unread); the results equal `g`'s at counter 0, bitwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jgraph import ops
from jgraph.builder import Builder
from jgraph.check import validate
from jgraph.errors import TransformError
from jgraph.interpreter import Interpreter
from jgraph.ir import Graph, Literal, Var
from jgraph.passes import dce
from jgraph.training.graphs import LEAF, grad_params, grads_tree


def _zeros(*, shape, dtype):
    return jnp.zeros(shape, dtype)


def _ones(*, shape, dtype):
    return jnp.ones(shape, dtype)


def _init(*params, tx, tree):
    return jax.tree.leaves(tx.init(jax.tree.unflatten(tree, params)))


def reset(graph: Graph, tx=None) -> Graph:
    """The graph `params -> {state part: reset value}` for the state inputs of `graph`.

    Args:
        graph: a training-step graph with state inputs (`jg.accumulate`, `jg.optimizer_step`).
        tx: the optax transformation whose `tx.init(params)` is the reset optimizer state; None:
            the one `optimizer_step` recorded on the graph (DESIGN §6 keeps `jg.reset(go)`
            working).

    Returns:
        A `Graph` from the params to the reset accumulators (zeros), counter (0) and optimizer
        state."""
    validate(graph, "jg.reset")
    tree = grads_tree(graph)
    params = tuple(Var(p.aval) for p in grad_params(graph))
    b = Builder()
    parts: dict[str, tuple[list, list, object]] = {}  # name -> (outputs, roles, treedef)

    def zeros_like(role, fill):
        vs = graph.inputs_with_role(role)
        return [b.call(fill, shape=v.aval.shape, dtype=v.aval.dtype)[0] for v in vs]

    if "accumulator" in graph.input_roles:
        parts["grad_acc"] = (zeros_like("accumulator", _zeros), "new_accumulator", tree)
    if "counter" in graph.input_roles:
        parts["counter"] = (zeros_like("counter", _zeros), "new_counter", LEAF)
    if "loss_seed" in graph.input_roles:
        parts["loss_seed"] = (zeros_like("loss_seed", _ones), "new_loss_seed", LEAF)
    if "opt_state" in graph.input_roles or "tx" in graph.info:  # (SGD's state has no leaves)
        tx, state_tree = tx or graph.info.get("tx"), graph.info.get("opt_state_tree")
        if tx is None:
            raise TransformError("reset: the graph has opt_state inputs but no recorded optax "
                                 "transformation (build it with jg.optimizer_step)")
        outs = b.call(_init, *params, tx=tx, tree=tree)
        parts["opt_state"] = (outs, "new_opt_state", state_tree)
    if not parts:
        raise TransformError("reset: the graph has no state inputs (accumulator, opt_state, "
                             "counter, loss_seed) to reset")
    names = sorted(parts)  # the flattening order of a dict
    out_tree = jax.tree.structure({k: jax.tree.unflatten(parts[k][2], [0] * parts[k][2].num_leaves)
                                   for k in names})
    return Graph(
        inputs=params,
        eqns=tuple(b.eqns),
        outputs=tuple(a for k in names for a in parts[k][0]),
        input_roles=("param",) * len(params),
        output_roles=tuple(parts[k][1] for k in names for _ in parts[k][0]),
        in_tree=jax.tree.structure((jax.tree.unflatten(tree, [0] * tree.num_leaves),)),
        out_tree=out_tree,
        param_argnums=0,
        info={"grads_tree": tree, "resets": tuple(names)},
    )


class _FirstMicroStep(Interpreter):
    """The interpreter loop on atoms instead of values (a partial evaluator): the counter reads
    as the literal 0, a scalar eqn of known operands folds to a literal, a select on a known
    predicate becomes its chosen case, and any other eqn is re-emitted on the atoms it reads."""

    def __init__(self, counter: Var):
        self.counter = counter
        self.eqns: list = []
        self.known: dict[Var, np.ndarray] = {}  # vars holding one value everywhere

    def write(self, var, value):
        if var is self.counter:
            value = Literal(np.zeros((), var.aval.dtype), var.aval)
        super().write(var, value)

    def free(self, var):
        pass  # atoms cost nothing; outputs must stay readable

    def output(self, atom):
        return atom if isinstance(atom, Literal) else self.env[atom]

    def read(self, atom):
        return atom if isinstance(atom, Literal) else self.env[atom]

    def _constant(self, atom):
        """The value of an atom that is one value everywhere (scalar literal, broadcast)."""
        if isinstance(atom, Literal):
            value = np.asarray(atom.value)
            return value.reshape(()) if value.size == 1 else None
        return self.known.get(atom)

    def eval_eqn(self, eqn, inputs):
        values = [self._constant(a) for a in inputs]
        if eqn.op == "select_n" and values[0] is not None:  # a known predicate picks a case
            return [inputs[1 + int(values[0])]]
        if (all(v is not None and a.aval.shape == () for v, a in zip(values, inputs, strict=True))
                and len(eqn.outputs) == 1 and eqn.outputs[0].aval.shape == ()
                and eqn.op in ops.lowerings):
            # fold a computation on scalars (a value known one value everywhere is not a scalar:
            # summing a broadcast of 1.0 does not give 1.0)
            out = eqn.outputs[0]
            value = np.asarray(ops.lowerings[eqn.op](*values, **eqn.params)[0], out.aval.dtype)
            return [Literal(value, out.aval)]
        if eqn.op == "broadcast_in_dim" and values[0] is not None:
            self.known[eqn.outputs[0]] = values[0]
        inputs = tuple(inputs)
        self.eqns.append(dataclasses.replace(eqn, inputs=inputs) if inputs != eqn.inputs else eqn)
        return list(eqn.outputs)


def first_micro_step(graph: Graph) -> Graph:
    """`graph` specialised to counter 0: the first micro-step of a period reads no accumulator.

    Args:
        graph: an accumulation micro-step (`jg.accumulate`, possibly with `jg.optimizer_step`).

    Returns:
        The `Graph` with the counter fixed at 0 and the accumulators' reads removed."""
    validate(graph, "jg.first_micro_step")
    counters = graph.inputs_with_role("counter")
    if len(counters) != 1 or "accumulator" not in graph.input_roles:
        raise TransformError("first_micro_step: the graph needs accumulator inputs and one counter "
                             "input (build it with jg.accumulate)")
    partial = _FirstMicroStep(counters[0])
    with jax.disable_jit():  # folding runs one scalar op at a time, eagerly
        outputs = tuple(partial.run(graph, *graph.inputs))
    return dce(graph.replace(eqns=tuple(partial.eqns), outputs=outputs,
                             info={**graph.info, "first_micro_step": True}))
