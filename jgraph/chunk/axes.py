"""How each op maps one chunked axis that may move: the rule table of `jgraph.chunk.blocks`.

Attention's rows move: a query `(b, t, h, d)` becomes scores `(b, h, q, k)` and an output
`(b, q, h, d)`, and every block of queries reads all keys and values. So a block region does not
track leading row axes (`jgraph.chunk.rows`) but one axis per value, the block axis, asked for
backwards from the region's end: given the block axis of an eqn's output, its rule says which
axis of each input holds the same block (None: the input is read whole by every block), and the
eqn's params for a block of `size`.

    rule(eqn, axis, size) -> (params, in_axes, offset)
        offset: the eqn counts positions along the block axis (an `iota`: a causal mask), so a
        block adds its first position to it.
        Raises `NotRowwise(why)` when an output block needs more than the same block of inputs.
"""

from __future__ import annotations

import math
from typing import Callable

from jgraph.chunk.rows import ELEMENTWISE, NotRowwise

# op -> rule(eqn, axis, size) -> (params, in_axes, offset)
AXIS_RULES: dict[str, Callable] = {}


def block_params(eqn, axis: int, size: int) -> tuple[dict, tuple, bool]:
    """(params of `eqn` on a block of `size` along output `axis`, each input's block axis or
    None, whether a block adds its offset to the result); `NotRowwise` if it mixes blocks."""
    rule = AXIS_RULES.get(eqn.op)
    if rule is None:
        raise NotRowwise(f"no block rule for op {eqn.op!r}")
    return rule(eqn, axis, size)


def _shape(a) -> tuple[int, ...]:
    return tuple(a.aval.shape)


def _elementwise(eqn, axis, size):
    out = _shape(eqn.outputs[0])
    in_axes = []
    for a in eqn.inputs:  # operands broadcast along size-1 axes
        shape = _shape(a)
        if not shape or shape[axis] == 1:
            in_axes.append(None)  # the same for every block
        elif len(shape) == len(out) and shape[axis] == out[axis]:
            in_axes.append(axis)
        else:
            raise NotRowwise(f"operand {a.aval.str_short()} broadcasts to {out}")
    return dict(eqn.params), tuple(in_axes), False


for _op in ELEMENTWISE:
    AXIS_RULES[_op] = _elementwise


def _broadcast(eqn, axis, size):
    if len(eqn.inputs) != 1:
        raise NotRowwise("a broadcast to a dynamic shape")
    dims = tuple(eqn.params["broadcast_dimensions"])
    operand = _shape(eqn.inputs[0])
    j = dims.index(axis) if axis in dims else None
    in_axis = None if j is None or operand[j] == 1 else j
    shape = list(eqn.params["shape"])
    shape[axis] = size
    return {**eqn.params, "shape": tuple(shape)}, (in_axis,), False


AXIS_RULES["broadcast_in_dim"] = _broadcast


def _iota(eqn, axis, size):
    shape = list(eqn.params["shape"])
    shape[axis] = size
    if eqn.params.get("sharding") is not None:
        raise NotRowwise("a sharded iota")
    return {**eqn.params, "shape": tuple(shape)}, (), eqn.params["dimension"] == axis


AXIS_RULES["iota"] = _iota


def _reshape(eqn, axis, size):
    if eqn.params.get("dimensions") is not None or len(eqn.inputs) != 1:
        raise NotRowwise("a reshape with a transposition or a dynamic shape")
    old, new = _shape(eqn.inputs[0]), tuple(eqn.params["new_sizes"])
    before = math.prod(new[:axis])
    for j in range(len(old)):  # the input axis holding the same elements, unmerged
        if math.prod(old[:j]) == before and old[j] == new[axis]:
            sizes = list(new)
            sizes[axis] = size
            return {**eqn.params, "new_sizes": tuple(sizes)}, (j,), False
    raise NotRowwise(f"a reshape merging or splitting the block axis ({old} -> {new})")


AXIS_RULES["reshape"] = _reshape


def _transpose(eqn, axis, size):
    return dict(eqn.params), (eqn.params["permutation"][axis],), False


AXIS_RULES["transpose"] = _transpose


def _kept(rank: int, removed) -> list[int]:
    return [d for d in range(rank) if d not in set(removed)]


def _reduce(param: str):
    """An op removing the axes named by `param`: the block axis is one it keeps."""
    def rule(eqn, axis, size):
        removed = eqn.params[param]
        removed = (removed,) if isinstance(removed, int) else tuple(removed)
        return dict(eqn.params), (_kept(len(_shape(eqn.inputs[0])), removed)[axis],), False

    return rule


for _op in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
            "argmax", "argmin"):
    AXIS_RULES[_op] = _reduce("axes")
AXIS_RULES["squeeze"] = _reduce("dimensions")


def _along(param: str, what: str):
    """An op acting along the axes named by `param`, keeping every axis: not the block axis."""
    def rule(eqn, axis, size):
        along = eqn.params[param]
        along = (along,) if isinstance(along, int) else tuple(along)
        if axis in along:
            raise NotRowwise(f"{what} along the block axis: it mixes blocks")
        return dict(eqn.params), (axis,) * len(eqn.inputs), False

    return rule


for _op in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
    AXIS_RULES[_op] = _along("axis", _op)
AXIS_RULES["rev"] = _along("dimensions", "rev")
AXIS_RULES["concatenate"] = _along("dimension", "concatenate")


def _pad(eqn, axis, size):
    if tuple(eqn.params["padding_config"][axis]) != (0, 0, 0):
        raise NotRowwise("a pad along the block axis")
    return dict(eqn.params), (axis, None), False


AXIS_RULES["pad"] = _pad


def _slice(eqn, axis, size):
    p = eqn.params
    strides = p.get("strides") or (1,) * len(p["start_indices"])
    if (p["start_indices"][axis] != 0 or strides[axis] != 1
            or p["limit_indices"][axis] != _shape(eqn.inputs[0])[axis]):
        raise NotRowwise("a slice of part of the block axis")
    limit = list(p["limit_indices"])
    limit[axis] = size
    return {**p, "limit_indices": tuple(limit)}, (axis,), False


AXIS_RULES["slice"] = _slice


def _dot(eqn, axis, size):
    """Output axes are the batch axes, then the lhs's free axes, then the rhs's: the block axis
    is a batch axis of both operands or a free axis of one (the other read whole: keys, values,
    a weight)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ranks = [len(_shape(a)) for a in eqn.inputs]
    free = [[d for d in range(ranks[i]) if d not in (lc, rc)[i] and d not in (lb, rb)[i]]
            for i in (0, 1)]
    if axis < len(lb):
        in_axes = (lb[axis], rb[axis])
    elif axis < len(lb) + len(free[0]):
        in_axes = (free[0][axis - len(lb)], None)
    else:
        in_axes = (None, free[1][axis - len(lb) - len(free[0])])
    return dict(eqn.params), in_axes, False


AXIS_RULES["dot_general"] = _dot
