"""Slice rules of `jg.fuse_updates`: which eqns act on each slice of a stacked value.

An update eqn moves into a backward scan's body when it computes slice i of its outputs from
slice i of its stacked inputs (and whole values that do not depend on the scan). `SLICE_RULES`
maps an op to a rule `(eqn, length) -> (per input: SLICE | WHOLE, params per slice) | None`;
`slice_form` checks the rule's answer against the op's shape rule.
"""

from __future__ import annotations

from jgraph import ops
from jgraph.ir import Eqn

# Output roles an update writes, and the state input each one replaces.
STATE_OF = {"new_param": "param", "new_opt_state": "opt_state", "new_accumulator": "accumulator"}
SLICE, WHOLE = "slice", "whole"  # how a slice-wise eqn reads an input: its slice i, or all of it

# -- slice rules: op -> rule(eqn, length) -> (per input: SLICE | WHOLE, params per slice) | None
SLICE_RULES: dict = {}
ELEMENTWISE = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "integer_pow", "max", "min", "neg",
    "abs", "sign", "floor", "ceil", "round", "sqrt", "rsqrt", "cbrt", "exp", "exp2", "log",
    "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "atan2", "square", "select_n",
    "clamp", "convert_element_type", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "xor", "is_finite", "nextafter", "erf", "erf_inv", "copy", "copy_p", "reduce_precision",
})


def _elementwise_rule(eqn, length):
    """Operands of the output's shape (or 1 where it broadcasts) are sliced; scalars are shared."""
    out = eqn.outputs[0].aval.shape

    def mode(shape):
        if shape == ():
            return WHOLE
        fits = len(shape) == len(out) and shape[:1] == out[:1]
        return SLICE if fits and all(d in (1, o) for d, o in zip(shape, out, strict=True)) \
            else None

    modes = [mode(a.aval.shape) for a in eqn.inputs]
    return None if None in modes else (modes, dict(eqn.params))


SLICE_RULES.update(dict.fromkeys(ELEMENTWISE, _elementwise_rule))


def _reduce_rule(eqn, length):
    axes = eqn.params["axes"]
    return None if 0 in axes else ([SLICE], {**eqn.params, "axes": tuple(a - 1 for a in axes)})


SLICE_RULES.update(dict.fromkeys(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                                  "reduce_and", "reduce_or"), _reduce_rule))


def _broadcast_rule(eqn, length):
    p, x = eqn.params, eqn.inputs[0]
    dims = p["broadcast_dimensions"]
    if 0 not in dims:  # the operand is the same for every slice
        return [WHOLE], {**p, "shape": p["shape"][1:],
                         "broadcast_dimensions": tuple(d - 1 for d in dims)}
    if dims[0] != 0 or x.aval.shape[0] != length:
        return None
    return [SLICE], {**p, "shape": p["shape"][1:],
                     "broadcast_dimensions": tuple(d - 1 for d in dims[1:])}


SLICE_RULES["broadcast_in_dim"] = _broadcast_rule


def _reshape_rule(eqn, length):
    p = eqn.params
    if p.get("dimensions") is not None or eqn.inputs[0].aval.shape[:1] != (length,):
        return None
    return [SLICE], {**p, "new_sizes": tuple(p["new_sizes"][1:])}


SLICE_RULES["reshape"] = _reshape_rule


def _transpose_rule(eqn, length):
    perm = eqn.params["permutation"]
    return None if perm[0] != 0 else ([SLICE], {"permutation": tuple(d - 1 for d in perm[1:])})


SLICE_RULES["transpose"] = _transpose_rule


def _squeeze_rule(eqn, length):
    dims = eqn.params["dimensions"]
    return None if 0 in dims else ([SLICE], {"dimensions": tuple(d - 1 for d in dims)})


SLICE_RULES["squeeze"] = _squeeze_rule


def sliced(aval):
    return aval.update(shape=aval.shape[1:])


def slice_form(eqn: Eqn, length: int):
    """(modes, params, per-slice output avals) of `eqn` run on slice i of its stacked inputs,
    or None when it is not slice-wise. The op's shape rule must give the slices of its outputs."""
    rule = SLICE_RULES.get(eqn.op)
    if rule is None or not all(v.aval.shape[:1] == (length,) for v in eqn.outputs):
        return None
    found = rule(eqn, length)
    if found is None:
        return None
    modes, params = found
    if any(m == SLICE and a.aval.shape[:1] != (length,) for a, m in
           zip(eqn.inputs, modes, strict=True)):
        return None
    avals = [sliced(a.aval) if m == SLICE else a.aval
             for a, m in zip(eqn.inputs, modes, strict=True)]
    try:
        outs = ops.shape_rules[eqn.op](*avals, **params)
    except Exception:  # noqa: BLE001 - a rule that does not fit: the eqn is not slice-wise
        return None
    for out, v in zip(outs, eqn.outputs, strict=True):
        if (out.shape, out.dtype) != (v.aval.shape[1:], v.aval.dtype):
            return None
    return modes, params, outs
