"""`trace`: an ordinary JAX function -> a forward `Graph`.

The function is traced by `jax.make_jaxpr` on its flattened arguments; each JAX primitive becomes an
op (see `jgraph.builder` for how nested `jit`, `custom_jvp`, `custom_vjp`, `checkpoint` and `scan`
are rewritten).
Leaves of the arguments in `param_argnums` get the role `param`, all others `data`. The output is
the `loss` if it is a single floating scalar (or the first element of `(loss, aux)` with `has_aux`);
any other output is `aux`.
"""

from __future__ import annotations

import os
import traceback

import jax
import jax.numpy as jnp

from jgraph import (  # noqa: F401  (their tracer handlers register into jgraph.builder)
    config,
    control_flow,
    custom_derivatives,
    effects,
    hi_primitives,
)
from jgraph.builder import Builder
from jgraph.check import check
from jgraph.errors import TraceError
from jgraph.ir import Graph, Var


def _normalize_argnums(param_argnums, nargs) -> tuple[int, ...]:
    if param_argnums is None:
        return ()
    nums = (param_argnums,) if isinstance(param_argnums, int) else tuple(param_argnums)
    for n in nums:
        if not isinstance(n, int) or not -nargs <= n < nargs:
            raise TraceError(f"param_argnums {param_argnums!r} out of range for {nargs} arguments")
    return tuple(n % nargs for n in nums)


def _is_scalar_float(aval) -> bool:
    return aval.shape == () and jnp.issubdtype(aval.dtype, jnp.floating)


_NOT_USER = (os.path.dirname(jax.__file__) + os.sep, os.path.dirname(__file__) + os.sep)


def _user_line(error: BaseException) -> str:
    """The innermost frame of `error`'s traceback outside JAX and jgraph, as "file:line (fn)"."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(_NOT_USER)]
    if not frames:
        return "an unknown line"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} ({f.name})"


def _check_leaves(example_args) -> None:
    """Every leaf of the arguments is something JAX can trace (an array or a scalar)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tuple(example_args))[0]:
        try:
            jax.typeof(leaf)
        except TypeError:
            raise TraceError(f"argument args{jax.tree_util.keystr(path)} is a "
                             f"{type(leaf).__name__} ({leaf!r:.60}), not an array or a scalar: "
                             "pass it as a static value (close over it) or as an array") from None


def trace(fn, *example_args, param_argnums=None, has_aux=False) -> Graph:
    """Trace `fn(*example_args)` into a forward graph.

    JAX traces `fn` on the example arguments' avals; each JAX primitive becomes an eqn (nested
    `jit`, `custom_jvp`, `custom_vjp`, `checkpoint` and loops are rewritten: `jgraph.builder`).

    Args:
        fn: the loss function: returns a floating scalar (the loss), or `(loss, aux)` with
            `has_aux`; any other output is `aux`.
        *example_args: arrays or pytrees of arrays with the shapes and dtypes of a real call.
        param_argnums: an int or a tuple of ints: the arguments whose leaves are parameters
            (role `param`; the gradients are taken with respect to them); all others are `data`.
            None: no parameters (a graph to evaluate, not to differentiate).
        has_aux: `fn` returns a pair `(loss, aux)`.

    Returns:
        The forward `Graph`, its inputs and outputs with roles.

    Raises:
        TraceError: `fn` cannot be traced (Python control flow on a traced value, a side effect,
            a closure over another transform's traced values), naming the user's source line."""
    graph, closed_over = trace_closure(fn, *example_args, param_argnums=param_argnums,
                                       has_aux=has_aux)
    if closed_over:
        raise TraceError(f"the function closes over {len(closed_over)} traced value(s) of an "
                         "enclosing transform (jax.jit, vmap, grad, ...), which a graph cannot "
                         "hold: pass them as arguments (jg.value_and_grad handles this itself)")
    return graph


def trace_closure(fn, *example_args, param_argnums=None, has_aux=False):
    """`trace`, for a function that may close over traced values of an enclosing transform (a
    loss defined inside the user's `jax.jit`, reading its batch): those values become one more
    positional argument of the graph, a tuple after `example_args`, with role `data`. Returns
    (graph, the closed-over values, to be passed there; empty when there are none)."""
    argnums = _normalize_argnums(param_argnums, len(example_args))
    _check_leaves(example_args)
    flat_args, in_tree = jax.tree.flatten(tuple(example_args))
    out_tree_box = []

    def flat_fn(*flat):
        out = fn(*jax.tree.unflatten(in_tree, flat))
        if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TraceError("has_aux=True needs a function returning a pair (loss, aux)")
        leaves, out_tree = jax.tree.flatten(out)
        out_tree_box.append(out_tree)
        return leaves

    try:
        closed = jax.make_jaxpr(flat_fn)(*flat_args)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
            jax.errors.TracerIntegerConversionError, jax.errors.UnexpectedTracerError) as e:
        first = str(e).strip().split("\n")[0]
        hint = ("" if "close over" in first else " (the function needs a concrete value where "
                "jg.trace has a traced one: use lax.cond, lax.while_loop or jnp.where for control "
                "flow on array values)")  # JAX's custom_vjp3 refuses closures with this error
        raise TraceError(f"{type(e).__name__} at {_user_line(e)}: {first}{hint}") from e
    out_tree = out_tree_box[-1]

    inputs = tuple(Var(v.aval) for v in closed.jaxpr.invars)
    # A constant that is a tracer belongs to an enclosing trace: it is an input, not a literal.
    hoisted = {id(c): Var(v.aval) for c, v in zip(closed.consts, closed.jaxpr.constvars,
                                                   strict=True) if isinstance(c, jax.core.Tracer)}
    closed_over = list({id(c): c for c in closed.consts if id(c) in hoisted}.values())
    consts = [hoisted.get(id(c), c) for c in closed.consts]
    builder = Builder()
    outputs = tuple(builder.inline(closed.jaxpr, consts, inputs))

    # Roles: leaves of the param arguments are params; a single floating scalar is the loss.
    arg_sizes = [len(jax.tree.leaves(a)) for a in example_args]
    input_roles = []
    for i, size in enumerate(arg_sizes):
        input_roles += ["param" if i in argnums else "data"] * size
    if closed_over:
        inputs += tuple(hoisted[id(c)] for c in closed_over)
        input_roles += ["data"] * len(closed_over)
        in_tree = jax.tree.structure((*example_args, tuple(closed_over)))
    n_loss = out_tree.children()[0].num_leaves if has_aux else out_tree.num_leaves
    output_roles = ["aux"] * len(outputs)
    if n_loss == 1 and outputs and _is_scalar_float(outputs[0].aval):
        output_roles[0] = "loss"
    graph = Graph(
        inputs=inputs,
        eqns=tuple(builder.eqns),
        outputs=outputs,
        input_roles=tuple(input_roles),
        output_roles=tuple(output_roles),
        in_tree=in_tree,
        out_tree=out_tree,
        regions=tuple(builder.new_regions),
        param_argnums=param_argnums,
        has_aux=has_aux,
    )
    return (check(graph) if config.check_graphs else graph), closed_over
