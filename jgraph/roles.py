"""Which input each output of a graph is the new value of.

A step graph returns the new value of each state input it updates under that input's role with
`new_` before it (`new_param`, `new_opt_state`, `new_accumulator`, `new_counter`, ...): the k-th
`new_R` output is the k-th `R` input's, params in `Graph.grad_params` order, as `jgraph.check`
requires of a valid graph. Donation pairs them (`jgraph.lower.donation_order`), and so does the
fusion of updates into the backward (`jgraph.fuse`).
"""

from __future__ import annotations

from jgraph.ir import Graph, Var


def updated_inputs(graph: Graph) -> list[Var | None]:
    """Per output, the input it is the new value of (where their shapes and dtypes agree), or
    None."""
    olds = {r: graph.grad_params() if r == "param" else graph.inputs_with_role(r)
            for r in set(graph.input_roles)}
    seen: dict[str, int] = {}
    found: list[Var | None] = []
    for out, role in zip(graph.outputs, graph.output_roles, strict=True):
        old, state = None, role[4:] if role.startswith("new_") else None
        if state in olds and seen.get(state, 0) < len(olds[state]):
            old = olds[state][seen.get(state, 0)]
            seen[state] = seen.get(state, 0) + 1
            if (old.aval.shape, old.aval.dtype) != (out.aval.shape, out.aval.dtype):
                old = None
        found.append(old)
    return found


def donated_buffers(donated: list[Var], results) -> list[Var | None]:
    """Per result (a `Var` or `Literal`), the donated input whose buffer JAX writes it into:
    the first of the same shape and dtype not yet taken, results in order, or None where none
    is left. JAX aliases by position: a literal or repeated result takes one too."""
    free: dict[tuple, list[Var]] = {}
    for v in donated:
        free.setdefault((v.aval.shape, v.aval.dtype), []).append(v)
    found: list[Var | None] = []
    for a in results:
        queue = free.get((a.aval.shape, a.aval.dtype))
        found.append(queue.pop(0) if queue else None)
    return found
