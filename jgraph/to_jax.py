"""`to_jax`: a graph -> a plain JAX function in which every op is a `jax.custom_vjp`.

Each eqn with a floating output is lowered as a `jax.custom_vjp` whose forward is the op's lowering
and whose backward is jgraph's VJP rule for the op (`jgraph.vjp_rules`). So
`jax.grad(to_jax(graph))` runs jgraph's rules under JAX's autodiff, and can be compared with
`jgraph.backward`. Ops with no floating output, or in NON_DIFFERENTIABLE, are bound as they are
(JAX gives them zero gradients). A differentiable op without a rule raises `TransformError` when
JAX differentiates it.
"""

from __future__ import annotations

import jax

from jgraph import ops
from jgraph.backward import vjp_rules
from jgraph.check import validate
from jgraph.control_flow import HIGHER_ORDER
from jgraph.custom_lowering import RULE_IN_LOWERING, expanded_custom_eqns
from jgraph.errors import TransformError
from jgraph.interpreter import Interpreter, flatten_args, unflatten_outputs
from jgraph.ir import Eqn, Graph, is_float


def _with_rule(eqn: Eqn):
    """The op of `eqn` as a custom_vjp function of its input values (returns a list)."""
    lowering, params = ops.lowerings[eqn.op], dict(eqn.params)

    @jax.custom_vjp
    def op(*xs):
        return list(lowering(*xs, **params))

    expanded = ops.expanded_lowerings.get(eqn.op)

    def fwd(*xs):
        # The next order differentiates what the forward ran: the op again (so its rule), or,
        # for a custom-derivative op, what JAX runs in its place (fwd's code, the jvp rule's
        # primal outputs), as `jax.grad` of `jax.grad` does.
        outs = op(*xs) if expanded is None else list(expanded(*xs, **params))
        return outs, (xs, outs)

    def bwd(res, cts):
        xs, outs = res
        rule = vjp_rules.get(eqn.op)
        if rule is None:
            raise TransformError(f"no VJP rule for op {eqn.op!r}, which is on the gradient path"
                                 + (f" at {eqn.source}" if eqn.source else ""))
        result = list(rule(tuple(cts), tuple(xs), tuple(outs), **params))
        result += [None] * (len(xs) - len(result))
        return tuple(None if ct is None or not is_float(jax.typeof(x)) else ct
                     for ct, x in zip(result, xs, strict=True))

    op.defvjp(fwd, bwd)
    return op


def _needs_rule(eqn: Eqn) -> bool:
    """Ops run through their rule; a control-flow op is lowered as itself (lax.scan, ...) with
    its body run by this same interpreter, so JAX differentiates the loop through its body's
    custom_vjp ops; an op whose lowering carries the user's rule is lowered as itself."""
    return (eqn.op not in ops.NON_DIFFERENTIABLE and eqn.op not in ops.CUTS_GRADIENT
            and eqn.op not in HIGHER_ORDER and eqn.op not in RULE_IN_LOWERING
            and any(is_float(v.aval) for v in eqn.outputs))


class _CustomVJPLowering(Interpreter):
    """Evaluates each differentiable eqn through its custom_vjp wrapper. A custom-derivative eqn
    jgraph's backward expanded (`expanded_custom_eqns`) is already code, as in
    `jax.value_and_grad`: JAX differentiates its lowering."""

    def __init__(self, graph: Graph, parent_expanded=None):
        self.parent_expanded = parent_expanded
        expanded = (expanded_custom_eqns(graph) if parent_expanded is None
                    else parent_expanded)
        self.wrapped = {id(e): _with_rule(e) for e in graph.eqns
                        if _needs_rule(e) and e not in expanded}

    def eval_eqn(self, eqn, values):
        op = self.wrapped.get(id(eqn))
        return super().eval_eqn(eqn, values) if op is None else op(*values)

    def sub_interpreter(self, graph: Graph) -> Interpreter:
        return _CustomVJPLowering(graph, self.expanded)


def to_jax(graph: Graph):
    """A plain JAX function running `graph` whose gradients use jgraph's VJP rules.

    Args:
        graph: a forward graph (from `jg.trace`) or any other graph.

    Returns:
        A function with the traced function's pytree signature. `jax.grad`, `jax.vjp` and
        `jax.jit` of it work as on any JAX function; each op carries its jgraph VJP rule (a
        `custom_vjp` per op), so `jax.grad` of it computes what `jg.backward` does."""
    validate(graph, "jg.to_jax")
    lowering = _CustomVJPLowering(graph)

    def fn(*args):
        return unflatten_outputs(graph, lowering.run(graph, *flatten_args(graph, args)))

    fn.__name__ = "jgraph_to_jax"
    return fn
