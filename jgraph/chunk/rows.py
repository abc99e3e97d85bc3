"""How each op maps rows: the rule table `jg.chunk_rows` reads.

Rows are the leading `k` axes of a value (the batch, or batch x sequence positions). An eqn maps
rows when each row of its outputs depends only on the same row of its row inputs (those whose
leading axes are the rows) and on the whole of its other inputs (constants: parameters, values
computed outside the region), which must not vary along the row axes. Such an eqn computes a
chunk of rows from the same chunk of its row inputs: `jg.chunk_rows` emits it again on a chunk,
with the params a rule returns for the chunk's row shape.

    rule(eqn, rows, k, shape) -> params
        rows: one bool per input (does it carry the rows?); shape: the new sizes of the k row axes.
        Raises `NotRowwise(why)` when the eqn's rows are not computed independently.

An op missing from the table does not map rows (random bits, loops, scatters, sorts across rows,
user rules whose backward could mix rows, and `custom_jvp_call`, whose JVP JAX traced for the
shapes of all rows): a region stops there.
"""

from __future__ import annotations

from typing import Callable


class NotRowwise(Exception):
    """An eqn whose output rows do not depend on the same input rows alone (the message: why)."""


# op -> rule(eqn, rows, k, shape) -> the eqn's params for row axes of sizes `shape`
ROW_RULES: dict[str, Callable] = {}


def row_params(eqn, rows, k: int, shape: tuple[int, ...]) -> dict:
    """The params of `eqn` emitted on rows of sizes `shape` (`NotRowwise` if it mixes rows)."""
    rule = ROW_RULES.get(eqn.op)
    if rule is None:
        raise NotRowwise(f"no row rule for op {eqn.op!r}")
    return rule(eqn, tuple(rows), k, tuple(shape))


def _aval(a):
    return a.aval


def _constant_along_rows(a, k: int, out_rank: int) -> bool:
    """A constant operand of an elementwise op: a scalar, or size 1 on every row axis."""
    shape = a.aval.shape
    return not shape or (len(shape) == out_rank and all(d == 1 for d in shape[:k]))


# -- elementwise ops (operands broadcast only along size-1 axes): params do not change ---------
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh",
    "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt",
    "imag", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max",
    "min", "mul", "name", "ne", "neg", "nextafter", "not", "or", "pow", "real", "reduce_precision",
    "rem", "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient",
    "sub", "tan", "tanh", "xor", "complex",
})


def elementwise_rule(eqn, rows, k, shape):
    rank = len(eqn.outputs[0].aval.shape)
    for a, row in zip(eqn.inputs, rows, strict=True):
        if not row and not _constant_along_rows(a, k, rank):
            raise NotRowwise(f"operand {a.aval.str_short()} varies along the row axes but is "
                             "not a row input")
    return dict(eqn.params)


for _op in ELEMENTWISE:
    ROW_RULES[_op] = elementwise_rule


# -- structural ops: the row axes stay leading and whole ----------------------------------------
def _needs_rows(rows, what: str) -> None:
    if not all(rows):
        raise NotRowwise(f"{what} of an operand that does not carry the rows")


def broadcast_rule(eqn, rows, k, shape):
    if len(eqn.inputs) != 1:
        raise NotRowwise("a broadcast to a dynamic shape")
    dims = eqn.params["broadcast_dimensions"]
    operand = eqn.inputs[0].aval.shape
    if rows[0]:
        if tuple(dims[:k]) != tuple(range(k)):
            raise NotRowwise(f"broadcast moves the row axes (dims {dims})")
    elif any(d < k and operand[j] != 1 for j, d in enumerate(dims)):
        raise NotRowwise(f"broadcast of a constant along the row axes (dims {dims})")
    return {**eqn.params, "shape": tuple(shape) + tuple(eqn.params["shape"][k:])}


ROW_RULES["broadcast_in_dim"] = broadcast_rule


def iota_rule(eqn, rows, k, shape):
    if eqn.params["dimension"] < k:
        raise NotRowwise("an iota counting along a row axis (it depends on the row's position)")
    return {**eqn.params, "shape": tuple(shape) + tuple(eqn.params["shape"][k:])}


ROW_RULES["iota"] = iota_rule


def reshape_rule(eqn, rows, k, shape):
    _needs_rows(rows[:1], "a reshape")
    sizes = tuple(eqn.params["new_sizes"])
    if eqn.params.get("dimensions") is not None or len(eqn.inputs) != 1:
        raise NotRowwise("a reshape with a transposition or a dynamic shape")
    if sizes[:k] != tuple(eqn.inputs[0].aval.shape[:k]):
        raise NotRowwise(f"a reshape merging or splitting row axes (to {sizes})")
    return {**eqn.params, "new_sizes": tuple(shape) + sizes[k:]}


ROW_RULES["reshape"] = reshape_rule


def _axes_not_rows(param: str, what: str):
    """Rule for an op acting along the axes named by `param` (an int or a tuple): none is a row
    axis; params do not change."""
    def rule(eqn, rows, k, shape):
        _needs_rows(rows, what)
        axes = eqn.params[param]
        axes = (axes,) if isinstance(axes, int) else tuple(axes)
        if any(a < k for a in axes):
            raise NotRowwise(f"{what} along row axis {min(axes)}: it mixes rows")
        return dict(eqn.params)

    return rule


for _op in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
            "argmax", "argmin"):
    ROW_RULES[_op] = _axes_not_rows("axes", f"{_op}")
for _op in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
    ROW_RULES[_op] = _axes_not_rows("axis", _op)
ROW_RULES["squeeze"] = _axes_not_rows("dimensions", "squeeze")
ROW_RULES["rev"] = _axes_not_rows("dimensions", "rev")
ROW_RULES["concatenate"] = _axes_not_rows("dimension", "concatenate")
ROW_RULES["split"] = _axes_not_rows("axis", "split")


def transpose_rule(eqn, rows, k, shape):
    _needs_rows(rows, "a transpose")
    perm = tuple(eqn.params["permutation"])
    if perm[:k] != tuple(range(k)):
        raise NotRowwise(f"a transpose moving the row axes ({perm})")
    return dict(eqn.params)


ROW_RULES["transpose"] = transpose_rule


def pad_rule(eqn, rows, k, shape):
    _needs_rows(rows[:1], "a pad")
    if rows[1]:
        raise NotRowwise("a padding value that carries rows")
    if any(tuple(c) != (0, 0, 0) for c in eqn.params["padding_config"][:k]):
        raise NotRowwise("a pad along a row axis")
    return dict(eqn.params)


ROW_RULES["pad"] = pad_rule


def slice_rule(eqn, rows, k, shape):
    _needs_rows(rows, "a slice")
    p = eqn.params
    whole = tuple(eqn.inputs[0].aval.shape[:k])
    strides = p.get("strides") or (1,) * len(p["start_indices"])
    if (any(s != 0 for s in p["start_indices"][:k]) or tuple(p["limit_indices"][:k]) != whole
            or any(s != 1 for s in strides[:k])):
        raise NotRowwise("a slice of some rows")
    return {**p, "limit_indices": tuple(shape) + tuple(p["limit_indices"][k:])}


ROW_RULES["slice"] = slice_rule


# -- dot_general: the row axes are free (or batch) axes of the row operands, leading the output --
def dot_rule(eqn, rows, k, shape):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ranks = [len(a.aval.shape) for a in eqn.inputs]
    free = [[d for d in range(ranks[i]) if d not in (lc, rc)[i] and d not in (lb, rb)[i]]
            for i in (0, 1)]
    # where each output axis comes from: {operand: axis}
    origin = ([{0: x, 1: y} for x, y in zip(lb, rb, strict=True)]
              + [{0: d} for d in free[0]] + [{1: d} for d in free[1]])
    for axis in range(k):
        if axis >= len(origin):
            raise NotRowwise("a dot whose output has fewer axes than rows")
        came = origin[axis]
        if any(not rows[i] for i in came) or any(came.get(i, axis) != axis for i in (0, 1)):
            raise NotRowwise(f"a dot whose output row axis {axis} is not row axis {axis} of its "
                             "row operands")
        for i in (0, 1):
            if rows[i] and i not in came:
                raise NotRowwise(f"a dot contracting or moving row axis {axis} of operand {i}")
    for i in (0, 1):
        if rows[i] and any(d < k for d in (lc, rc)[i]):
            raise NotRowwise("a dot contracting a row axis")
    return dict(eqn.params)


ROW_RULES["dot_general"] = dot_rule


# -- gather: rows either batch the gather (operand and indices) or are whole slices ----------------
def gather_rule(eqn, rows, k, shape):
    p = eqn.params
    dn, sizes = p["dimension_numbers"], list(p["slice_sizes"])
    operand, indices = eqn.inputs[0].aval.shape, eqn.inputs[1].aval.shape
    batch = dict(zip(dn.operand_batching_dims, dn.start_indices_batching_dims, strict=True))
    if not any(rows):
        raise NotRowwise("a gather of a constant by constant indices")
    if rows[1]:
        # the indices' leading axes are the output's leading axes (no offset axis before them)
        if any(d < k for d in dn.offset_dims) or len(indices) - 1 < k:
            raise NotRowwise("a gather whose output rows are not its indices' rows")
    if rows[0]:
        offsets = [d for d in range(len(operand)) if d not in dn.collapsed_slice_dims
                   and d not in dn.operand_batching_dims]
        for axis in range(k):
            if axis in dn.start_index_map:
                raise NotRowwise("a gather indexing along a row axis (it reads other rows)")
            if batch.get(axis) == axis and rows[1]:
                continue  # batched with the same row of the indices
            position = (list(dn.offset_dims)[offsets.index(axis)] if axis in offsets else None)
            if position != axis or sizes[axis] != operand[axis] or rows[1]:
                raise NotRowwise("a gather taking rows from other positions")
            sizes[axis] = shape[axis]
    elif any(d in batch for d in range(len(operand))) and rows[1]:
        raise NotRowwise("a gather batched over a constant operand")
    return {**p, "slice_sizes": tuple(sizes)}


ROW_RULES["gather"] = gather_rule
