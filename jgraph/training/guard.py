"""`guard_nonfinite(g, keep)`: a training step that reports, and can refuse, non-finite results.

The guarded graph has one more output, role `metric`, last in its result tuple: a boolean that is
true iff every floating output of the step is finite (its loss, gradients, new accumulators, new
params and new optimizer state). It is a chain of `all(is_finite(x))` reductions over values the
step computes anyway, which XLA fuses into their producers: no extra pass over memory, and the
caller reads one bool per step.

For each state role in `keep` (`param`, `opt_state`, `accumulator`, `counter`), the new value of
that state becomes `where(finite, new, old)`: a non-finite step leaves that state as it was, as
`optax.apply_if_finite` drops a non-finite update. Values are bitwise unchanged when the step is
finite.
"""

from __future__ import annotations

import jax.numpy as jnp

from jgraph.builder import Builder
from jgraph.errors import TransformError
from jgraph.ir import Graph, is_float
from jgraph.training.graphs import LEAF, call_parts, grad_params, tuple_tree

STATE_ROLES = ("param", "opt_state", "accumulator", "counter")


def _all_finite(*xs):
    ok = jnp.bool_(True)
    for x in xs:
        ok = jnp.logical_and(ok, jnp.all(jnp.isfinite(x)))
    return ok


def _keep_if(ok, new, old):
    return jnp.where(ok, new, old)


def _updated_inputs(graph: Graph, role: str) -> list:
    """The inputs that the `new_<role>` outputs update, in the order of those outputs."""
    return grad_params(graph) if role == "param" else graph.inputs_with_role(role)


def guard_nonfinite(graph: Graph, keep=()) -> Graph:
    """Append the finite check (a `metric` output) and keep the `keep` states of a bad step."""
    unknown = set(keep) - set(STATE_ROLES)
    if unknown:
        raise TransformError(f"guard_nonfinite: unknown state roles {sorted(unknown)}; known: "
                             f"{list(STATE_ROLES)}")
    if graph.info.get("finite_output") is not None:
        raise TransformError("guard_nonfinite: the graph is already guarded")
    b = Builder()
    checked = [a for a in graph.outputs if is_float(a.aval)]
    ok = b.call(_all_finite, *checked)[0]
    outputs = list(graph.outputs)
    for role in keep:
        positions = [k for k, r in enumerate(graph.output_roles) if r == "new_" + role]
        olds = _updated_inputs(graph, role)
        if len(positions) != len(olds):
            raise TransformError(f"guard_nonfinite: {len(positions)} new_{role} outputs for "
                                 f"{len(olds)} {role} inputs")
        for k, old in zip(positions, olds, strict=True):
            new = outputs[k].aval
            if (new.shape, new.dtype) != (old.aval.shape, old.aval.dtype):
                raise TransformError(f"guard_nonfinite: new_{role} {new} does not match its "
                                     f"input {old.aval}")
            outputs[k] = b.call(_keep_if, ok, outputs[k], old)[0]
    return graph.replace(
        eqns=graph.eqns + tuple(b.eqns),
        outputs=tuple(outputs) + (ok,),
        output_roles=graph.output_roles + ("metric",),
        out_tree=tuple_tree([*call_parts(graph.out_tree, "guard_nonfinite"), LEAF]),
        info={**graph.info, "finite_output": len(outputs),
              "guarded": (len(graph.eqns), graph.outputs, graph.output_roles, graph.out_tree)},
    )


def unguarded(graph: Graph) -> Graph:
    """The graph `guard_nonfinite` was given, from the guarded graph it returned (or one whose
    info alone changed since): its eqns were appended, its outputs replaced."""
    record = graph.info.get("guarded")
    if record is None:
        raise TransformError("unguarded: the graph is not guarded (no guard_nonfinite record)")
    neqns, outputs, roles, out_tree = record
    if graph.output_roles[-1:] != ("metric",) or len(graph.eqns) < neqns:
        raise TransformError("unguarded: the guarded graph was changed after guard_nonfinite")
    info = {k: v for k, v in graph.info.items() if k not in ("finite_output", "guarded")}
    return graph.replace(eqns=graph.eqns[:neqns], outputs=outputs, output_roles=roles,
                         out_tree=out_tree, info=info)


def _present(graph: Graph, roles) -> tuple:
    """The state roles of `roles` whose new values `graph` outputs."""
    return tuple(r for r in roles if "new_" + r in graph.output_roles)


def with_guard(graph: Graph, mode: str) -> Graph:
    """The graph as the `on_nonfinite` mode runs it: "raise" keeps every state of a non-finite
    step, "skip" its params and optimizer state (accumulators restart at the next period)."""
    if mode == "ignore":
        return graph
    keep = STATE_ROLES if mode == "raise" else ("param", "opt_state")
    return guard_nonfinite(graph, keep=_present(graph, keep))
