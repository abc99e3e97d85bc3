"""The one interpreter loop, and `evaluate`, the reference interpreter.

`Interpreter.run` walks the schedule with an environment from variables to values, freeing each
value after its last use. Subclasses change what one eqn does (`eval_eqn`): evaluation binds the
op's lowering eagerly, `jgraph.lower` runs the same loop under `jax.jit`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jgraph import ops
from jgraph.check import validate
from jgraph.control_flow import HIGHER_ORDER
from jgraph.custom_lowering import expanded_custom_eqns
from jgraph.errors import GraphError, JGraphError
from jgraph.ir import Graph, Literal, Var, short_aval
from jgraph.naming import while_processing


def last_uses(graph: Graph) -> dict[Var, int]:
    """For each variable, the index of the last eqn reading it (len(eqns) if it is an output)."""
    last: dict[Var, int] = {}
    for i, eqn in enumerate(graph.eqns):
        for a in eqn.inputs:
            if isinstance(a, Var):
                last[a] = i
    for a in graph.outputs:
        if isinstance(a, Var):
            last[a] = len(graph.eqns)
    return last


class Interpreter:
    """Runs a graph on flat arguments: `env`, `read`, `write`, one loop over the eqns, each value
    freed after its last use. Subclasses change what one step does: `eval_eqn` (evaluation binds
    the op's lowering; `jgraph.lower` runs the same loop under `jax.jit`), or the bookkeeping
    hooks `write` and `free` (`jgraph.memory` counts bytes with them, computing nothing).

    A control-flow op (`scan`, `cond`, `while`) runs its sub-graphs with `run_sub`: an interpreter
    of the same kind (`sub_interpreter`) on each body, called inside `lax.scan` and friends.
    """

    # The custom-derivative eqns jgraph's backward expanded lower by `ops.expanded_lowerings`
    # (`jgraph.custom_lowering`): those of the graph `run` is given, found when a custom op is
    # met, or its parent's when it runs a sub-graph.
    parent_expanded: frozenset | None = None
    _expanded: frozenset | None = None
    _expanded_in: Graph | None = None

    @property
    def expanded(self) -> frozenset:
        if self._expanded is None:
            self._expanded = (frozenset() if self._expanded_in is None
                              else expanded_custom_eqns(self._expanded_in))
        return self._expanded

    def run(self, graph: Graph, *args):
        if len(args) != len(graph.inputs):
            raise JGraphError(f"graph takes {len(graph.inputs)} flat inputs, got {len(args)}")
        self._expanded, self._expanded_in = self.parent_expanded, graph
        self.env: dict[Var, object] = {}
        last = last_uses(graph)
        for v, x in zip(graph.inputs, args, strict=True):
            self.write(v, x)
        for i, eqn in enumerate(graph.eqns):
            with while_processing("evaluating", eqn, graph):
                outs = self.eval_eqn(eqn, [self.read(a) for a in eqn.inputs])
                computed_as_declared(eqn, outs)
            for v, x in zip(eqn.outputs, outs, strict=True):
                self.write(v, x)
            for v in (*eqn.inputs, *eqn.outputs):  # last use, or never used
                if isinstance(v, Var) and last.get(v, i) == i and v in self.env:
                    self.free(v)
        return [self.output(a) for a in graph.outputs]

    def read(self, atom):
        return atom.value if isinstance(atom, Literal) else self.env[atom]

    def write(self, var: Var, value) -> None:
        self.env[var] = value

    def free(self, var: Var) -> None:
        del self.env[var]

    def output(self, atom):
        if isinstance(atom, Literal):  # a constant output is an array, as under jax.jit
            return jnp.asarray(atom.value, atom.aval.dtype)
        return self.env[atom]

    def eval_eqn(self, eqn, values):
        try:
            expanded = eqn.op in ops.expanded_lowerings and eqn in self.expanded
            table = ops.expanded_lowerings if expanded else ops.lowerings
            lowering = table[eqn.op]
        except KeyError:
            raise JGraphError(f"no lowering for op {eqn.op!r} ({eqn.source})") from None
        if eqn.op in HIGHER_ORDER:
            return lowering(*values, interpret=self.run_sub, **eqn.params)
        return lowering(*values, **eqn.params)

    def sub_interpreter(self, graph: Graph) -> Interpreter:
        """The interpreter that runs a sub-graph (a loop body, a branch) of the current graph."""
        sub = type(self)()
        sub.parent_expanded = self.expanded
        return sub

    def run_sub(self, graph: Graph, *values) -> list:
        return self.sub_interpreter(graph).run(graph, *values)


def computed_as_declared(eqn, outs) -> None:
    """`GraphError` unless the op computed what the eqn declares: one value per output, each of
    the declared shape and dtype (`check` proves it from the shape rules; evaluation and lowering,
    which skip that by default, see it here for the price of a comparison). Values that are not
    arrays or tracers (a partial evaluator's atoms) are not compared."""
    if len(outs) != len(eqn.outputs):
        raise GraphError(f"op {eqn.op!r} computed {len(outs)} outputs, but the eqn declares "
                         f"{len(eqn.outputs)}")
    for k, (v, x) in enumerate(zip(eqn.outputs, outs, strict=True)):
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is None or dtype is None:
            continue
        if tuple(shape) != v.aval.shape or dtype != v.aval.dtype:
            got = jax.core.ShapedArray(tuple(shape), dtype)
            raise GraphError(f"output {k} of the eqn is declared {short_aval(v.aval)}, but op "
                             f"{eqn.op!r} computes {short_aval(got)} from its inputs (jg.check "
                             "names what is wrong)")


def flatten_args(graph: Graph, args) -> list:
    """Flatten call arguments against the graph's inputs: same structure, shapes and dtypes.

    Python scalars (weakly typed values) are converted to the input's dtype when that loses
    nothing (an int for a float input, say); a float for an integer input, a complex for a real
    one or an int out of the dtype's range is an error, never a silent truncation."""
    leaves, tree = jax.tree.flatten(tuple(args))
    if graph.in_tree is not None and tree != graph.in_tree:
        raise JGraphError("arguments do not match the traced signature:\n"
                          + _tree_difference(graph, args))
    if len(leaves) != len(graph.inputs):
        raise JGraphError(f"graph takes {len(graph.inputs)} flat inputs, got {len(leaves)}")
    for k, (x, v) in enumerate(zip(leaves, graph.inputs, strict=True)):
        if isinstance(x, (bool, int, float, complex)) and v.aval.shape == ():
            leaves[k] = _python_scalar(x, v.aval, lambda: _leaf_path(args, k))
            continue
        try:
            aval = jax.typeof(x)
        except TypeError:  # a string, an object: JAX's own message would not say where
            raise JGraphError(f"argument {_leaf_path(args, k)} is {_describe(x)}, not an array; "
                              f"the traced signature has {short_aval(v.aval)} there") from None
        if getattr(aval, "weak_type", False) and np.shape(x) == v.aval.shape \
                and _kind_fits(_dtype(x), v.aval.dtype):
            leaves[k] = jax.lax.convert_element_type(x, v.aval.dtype)  # a Python scalar, jitted
        elif np.shape(x) != v.aval.shape or _dtype(x) != v.aval.dtype:
            raise JGraphError(f"argument {_leaf_path(args, k)} is {_describe(x)} but the traced "
                              f"signature has {short_aval(v.aval)} there")
    return leaves


# bool < signed/unsigned int < float < complex: a value fits rightwards (by JAX's dtype
# hierarchy: NumPy calls bfloat16 and the float8s kind "V")
_KINDS = (jnp.bool_, jnp.integer, jnp.floating, jnp.complexfloating)


def _kind(dtype) -> int:
    return next(k for k, kind in enumerate(_KINDS) if jnp.issubdtype(dtype, kind))


def _kind_fits(src, dst) -> bool:
    if src is None or jax.dtypes.issubdtype(dst, jax.dtypes.extended):
        return False
    return _kind(src) <= _kind(dst)


def _python_scalar(x, aval, path):
    value = np.asarray(x)
    # a bool is not weakly typed in JAX (`jax.jit` refuses True for an int): neither here
    if not _kind_fits(value.dtype, aval.dtype) or (isinstance(x, bool)
                                                  and value.dtype != aval.dtype):
        raise JGraphError(f"argument {path()} is the Python {type(x).__name__} {x!r} but the "
                          f"traced signature has {short_aval(aval)} there (no silent conversion)")
    if np.dtype(aval.dtype).kind in "iu":
        info = np.iinfo(aval.dtype)
        if not info.min <= x <= info.max:
            raise JGraphError(f"argument {path()} is {x!r}, out of the range of "
                              f"{short_aval(aval)}")
    return np.asarray(x, aval.dtype)


def _tree_difference(graph: Graph, args) -> str:
    """Expected vs got, per leaf path: the leaves that are missing, unexpected or different."""
    expected = dict(zip(graph.input_paths(), graph.inputs, strict=True))
    got = {"" + jax.tree_util.keystr(p): x
           for p, x in jax.tree_util.tree_flatten_with_path(tuple(args))[0]}
    lines = [f"  expected {graph.in_tree}", f"  got      {jax.tree.structure(tuple(args))}"]
    for path in expected.keys() - got.keys():
        lines.append(f"  missing    args{path}: expected {short_aval(expected[path].aval)}")
    for path in got.keys() - expected.keys():
        lines.append(f"  unexpected args{path}: {_describe(got[path])}")
    return "\n".join(sorted(lines[:2]) + sorted(lines[2:]))


def _dtype(x):
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return None
    return jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)


def _leaf_path(args, k: int) -> str:
    path = jax.tree_util.tree_flatten_with_path(tuple(args))[0][k][0]
    return "args" + jax.tree_util.keystr(path)


def _describe(x) -> str:
    try:
        aval = jax.typeof(x)
        weak = " (weakly typed: a Python scalar)" if getattr(aval, "weak_type", False) else ""
        return short_aval(aval) + weak
    except TypeError:
        text = repr(x)
        return f"a {type(x).__name__} ({text[:40] + '...' if len(text) > 40 else text})"


def unflatten_outputs(graph: Graph, flat):
    if graph.out_tree is None:
        return tuple(flat)
    return jax.tree.unflatten(graph.out_tree, flat)


def evaluate(graph: Graph, *args):
    """Run `graph` op by op without `jax.jit` (the reference interpreter).

    Loops run in Python, one body eqn at a time (`jax.disable_jit` makes `lax.scan` and friends
    loop eagerly).

    Args:
        graph: any graph.
        *args: the arguments of the traced function (pytrees as `fn` took them), followed by the
            state the graph takes (accumulators, optimizer state, counter), if any.

    Returns:
        The graph's outputs, in the traced function's pytree structure: `(loss, grads)` for a
        `jg.backward` graph."""
    validate(graph, "jg.evaluate")
    flat = flatten_args(graph, args)
    with jax.disable_jit():
        return unflatten_outputs(graph, Interpreter().run(graph, *flat))
