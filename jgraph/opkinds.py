"""How XLA:CPU treats each op, as far as memory goes: the rule table of the memory model.

Every op gets a *kind* (`kind(eqn)`), read off XLA:CPU's instruction fusion
(`cpu_instruction_fusion.cc`: which HLOs loop-fuse, which are "expensive") and its lowering:

    alias      no buffer: output k is the buffer of one input (reshape and squeeze are bitcasts;
               custom_jvp_call, name, stop_gradient are identities)
    cheap      loop-fusible and cheap: fused into every consumer that is a loop fusion, even when
               that duplicates it (elementwise arithmetic, broadcast, transpose, slice, pad, ...)
    expensive  loop-fusible but never duplicated, and never fused into a consumer that reads each
               element more than once (tanh, exp, log, divide, gather, ...)
    reduce     loop-fusible and expensive; a consumer reading it elementwise may fuse it
    library    a reduction XLA:CPU hands to YNNPACK (f32 sum, max or min of at least 4096
               elements): fuses only elementwise producers nothing else reads, and is fused
               into nothing
    tree       a reduction XLA splits into a reduce_window and a reduce (a reduced dimension
               longer than 32): its operand is materialised, its result fuses like a reduce
    dot        a library call: its output is a buffer and so are its operands (transposes of
               them fold into the call); batch dimensions that are not leading cost a copy
    opaque     its output is a buffer and so are its operands (convolution, reduce_window,
               scatter, sort, FFT, linear algebra, and any op this table does not know)
    loop       scan, cond, while: buffers for its results, and the body's own buffers inside
    rng        threefry random bits: a small while loop whose two halves are materialised
    expanded   an op XLA expands into shared intermediates, all materialised (erf, erfc; the
               index array of a gather or scatter with batching dimensions)

`workspace(eqn)` is the bytes an op needs only while it runs (XLA's expansion of
`select_and_scatter_add` into index iotas and a scatter, threefry's loop state). Tables are
names of JAX primitives (and jgraph's own ops); an op missing from them is `opaque`, which may
overestimate but never hides a buffer.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from jgraph.errors import TransformError
from jgraph.ir import Eqn, Var

ALIGN = 64  # XLA:CPU aligns every buffer of its temp allocation to 64 bytes


def itemsize(dtype) -> int:
    """Bytes per element of a numpy dtype or of one of JAX's extended dtypes (a PRNG key's is its
    key data's: 8 bytes for `key<fry>`), which numpy cannot interpret."""
    size = getattr(dtype, "itemsize", None)
    if size is None:
        raise TransformError(f"jgraph.memory: cannot size elements of dtype {dtype}: it has no "
                             f"itemsize")
    return int(size)


def nbytes(aval) -> int:
    return math.prod(aval.shape) * itemsize(aval.dtype)


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


CHEAP = frozenset({
    "add", "add_any", "sub", "mul", "neg", "max", "min", "abs", "sign", "floor", "ceil", "round",
    "nextafter", "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "xor", "shift_left", "shift_right_logical", "shift_right_arithmetic", "convert_element_type",
    "bitcast_convert_type", "integer_pow", "square", "sin", "cos", "is_finite",
    "population_count", "clz", "real", "imag", "conj", "complex", "reduce_precision",
    "broadcast_in_dim", "iota", "transpose", "slice", "pad", "concatenate", "rev",
    "dynamic_slice", "dynamic_update_slice", "split", "copy", "copy_p", "operand_copy", "taint",
})
EXPENSIVE = frozenset({
    "div", "rem", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt",
    "cbrt", "pow", "erf_inv", "lgamma", "digamma", "igamma", "igammac",
    "igamma_grad_a", "random_gamma_grad", "bessel_i0e", "bessel_i1e", "atan2", "atan", "asin",
    "acos", "atanh", "asinh", "acosh", "sinh", "cosh", "tan", "polygamma", "zeta",
    "regularized_incomplete_beta", "gather",
})
REDUCE = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                    "reduce_or", "reduce_xor", "argmax", "argmin"})
LOOPS = frozenset({"scan", "cond", "while"})
RNG = frozenset({"random_bits", "random_split", "random_fold_in", "random_seed",
                 "threefry2x32"})
IDENTITIES = frozenset({"reshape", "squeeze", "expand_dims", "name", "stop_gradient",
                        "optimization_barrier", "random_wrap", "random_unwrap",
                        "sharding_constraint", "device_put", "pvary"})


def aliases(eqn: Eqn) -> list[int] | None:
    """For an op that is a bitcast or an identity, the input each output is the buffer of."""
    op, n = eqn.op, len(eqn.outputs)
    if op in IDENTITIES:
        return list(range(n)) if op in ("optimization_barrier", "device_put") else [0] * n
    if op in ("custom_jvp_call", "custom_vjp_call_lazy"):  # consts, primals, the body's outputs
        first = eqn.params["n_consts"] + eqn.params["n_primals"]
        return list(range(first, first + n))
    if op == "custom_vjp_call":  # inputs: primals, residuals, the inlined fwd's outputs, consts
        first = eqn.params["n_primals"] + eqn.params["n_res"]
        return list(range(first, first + n))
    if not eqn.inputs or not eqn.outputs or not isinstance(eqn.inputs[0], Var):
        return None
    src, out = eqn.inputs[0].aval, eqn.outputs[0].aval
    if op in ("convert_element_type", "copy", "copy_p", "reduce_precision") \
            and src.dtype == out.dtype:
        return [0]
    if op == "broadcast_in_dim" and src.size == out.size:  # only adds dimensions of size 1
        return [0]
    if op in ("slice", "dynamic_slice") and src.shape == out.shape:  # all of it: XLA's
        return [0]  # simplifier reads the operand itself
    if op == "transpose" and _moves_only_unit_dims(src.shape, eqn.params["permutation"]):
        return [0]
    return None


def _moves_only_unit_dims(shape, perm) -> bool:
    kept = [p for p in perm if shape[p] != 1]
    return kept == sorted(kept)


@functools.lru_cache(maxsize=1 << 16)  # eqns are immutable; plans share most of them
def kind(eqn: Eqn) -> str:
    if aliases(eqn) is not None:
        return "alias"
    op = eqn.op
    if op in CHEAP:
        return "cheap"
    if op in ("div", "rem") and not _is_float(eqn):
        return "cheap"  # integer division by a constant is multiplies and shifts
    if op in EXPENSIVE:
        return "expensive"
    if op in REDUCE:
        return reduce_path(eqn)
    if op == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        if not lc:  # an outer product: XLA multiplies broadcasts
            return "cheap"
        if all(len(a.aval.shape) == len(lc) for a in eqn.inputs[:1]) and not \
                eqn.outputs[0].aval.shape:  # a vector dot: a reduction of a product
            return "reduce"
        return "dot"
    if op in LOOPS:
        return "loop"
    if op in RNG:
        return "rng"
    if op in EXPANDED:
        return "expanded"
    return "opaque"


LIBRARY_MIN_ELEMENTS = 4096  # below this XLA:CPU keeps a reduction in its own emitter
TREE_MIN_EXTENT = 33  # XLA's tree reduction rewriter splits a reduced dimension this long


def reduce_path(eqn: Eqn) -> str:
    """How XLA:CPU runs a reduction: "library" (YNNPACK), "tree" or "reduce" (a loop)."""
    x = eqn.inputs[0].aval if isinstance(eqn.inputs[0], Var) else None
    axes = eqn.params.get("axes", ())
    if x is None or not axes:
        return "reduce"
    if eqn.op in ("reduce_sum", "reduce_max", "reduce_min") and x.dtype == np.float32 \
            and x.size >= LIBRARY_MIN_ELEMENTS:
        return "library"
    if eqn.op != "argmax" and eqn.op != "argmin" and any(
            x.shape[a] >= TREE_MIN_EXTENT for a in axes):
        return "tree"
    return "reduce"


# Elementwise ops YNNPACK runs, so a library reduction can fuse them. Not a slice nor a
# concatenate (measured on XLA:CPU: `sum(x[..., :1])` and `max(concatenate(...))` read a
# buffer the slice or the concatenate writes).
LIBRARY_ELEMENTWISE = frozenset({
    "abs", "ceil", "convert_element_type", "erf", "exp", "expm1", "floor", "log", "log1p",
    "logistic", "neg", "round", "rsqrt", "sign", "sqrt", "tanh", "add", "add_any", "div", "max",
    "min", "mul", "pow", "sub", "integer_pow", "square", "broadcast_in_dim", "transpose",
    "pad", "iota",
})


def _is_float(eqn: Eqn) -> bool:
    return any(getattr(v.aval.dtype, "kind", "?") in "fc" for v in eqn.outputs)


def always_duplicated(eqn: Eqn) -> bool:
    """XLA fuses these into every consumer however expensive: a broadcast, a widening convert."""
    if eqn.op in ("broadcast_in_dim", "iota"):
        return True
    if eqn.op == "convert_element_type" and isinstance(eqn.inputs[0], Var):
        return nbytes(eqn.inputs[0].aval) < nbytes(eqn.outputs[0].aval)
    return False


def shrinks(eqn: Eqn, broadcast) -> bool:
    """XLA will not duplicate a producer that reads more than it writes from more than one
    operand that is not a broadcast (`ComputeGloballyUnfusible`), unless every consumer can fuse
    it. `broadcast(atom)`: the atom is a broadcast (or an iota, or a constant)."""
    if eqn.op == "taint":  # select(pred(anchor[0]), 0, x): reads one element of the anchor
        return False
    out = eqn.outputs[0].aval
    rank = _true_rank(out.shape)
    large = [a for a in eqn.inputs if isinstance(a, Var) and not broadcast(a)
             and _true_rank(a.aval.shape) >= rank]
    if len(large) <= 1:
        return False
    unique = {id(a): a for a in eqn.inputs if isinstance(a, Var)}.values()
    return sum(int(np.prod(a.aval.shape)) for a in unique) > int(np.prod(out.shape))


def _true_rank(shape) -> int:
    return sum(d > 1 for d in shape)


def reuses(eqn: Eqn, k: int) -> bool:
    """Whether `eqn` reads elements of its input `k` more than once (so an expensive producer of
    that input is not fused into it)."""
    a = eqn.inputs[k]
    if not isinstance(a, Var):
        return False
    if eqn.op == "broadcast_in_dim":
        return eqn.outputs[0].aval.size > a.aval.size
    if eqn.op == "gather":
        return k == 0
    if eqn.op == "dot_general":  # an outer product reads each element many times
        return True
    if eqn.op in ELEMENTWISE and a.aval.size < eqn.outputs[0].aval.size:
        return True  # an operand broadcast along size-1 dimensions (XLA's broadcast reuses it)
    return False


# Ops that compute each output element from the elements at the same index of their operands.
ELEMENTWISE = (CHEAP | EXPENSIVE) - frozenset({
    "broadcast_in_dim", "iota", "transpose", "slice", "pad", "concatenate", "rev", "dynamic_slice",
    "dynamic_update_slice", "split", "copy", "copy_p", "operand_copy", "taint", "gather"})


def dot_reshapes(eqn: Eqn, k: int) -> bool:
    """Whether XLA's dot decomposition reshapes operand `k` of a `dot_general` (several
    contracting or several free dimensions, merged into one each)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    contract, batch = (lc, lb) if k == 0 else (rc, rb)
    rank = len(eqn.inputs[k].aval.shape)
    return len(contract) > 1 or rank - len(contract) - len(batch) > 1


def dot_operand_copies(eqn: Eqn) -> tuple:
    """Per operand of a `dot_general`, the layout XLA:CPU copies it into (`dot_operand_layout`),
    or None where it reads it in place."""
    return tuple(dot_operand_layout(eqn, k) for k in (0, 1))


def dot_operand_layout(eqn: Eqn, k: int) -> tuple | None:
    """The order of dimensions XLA:CPU copies operand `k` of a `dot_general` into, or None when
    the dot reads it in place. XLA's dot decomposition brings each operand to batch dimensions
    first, then the left's free dimensions before its contracting ones and the right's
    contracting ones before its free ones (contracting in the order the dot pairs them), each
    group merged into one dimension: a permutation is a copy, except a 2-D transpose (one free
    and one contracting dimension, batch leading), which the dot kernel takes as it is
    (measured on XLA:CPU: `x[b, s, d] @ w.T` reads `w` in place, `W @ x[b, s, d].T` copies
    `x`, the weight gradient of `x[b, s, d]` contracting `(b, s)` copies `x`)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    contract, batch = (lc, lb) if k == 0 else (rc, rb)
    rank = len(eqn.inputs[k].aval.shape)
    rest = [d for d in range(rank) if d not in batch]
    free = [d for d in rest if d not in contract]
    order = tuple(batch) + tuple(free + list(contract) if k == 0 else list(contract) + free)
    if order == tuple(range(rank)):
        return None
    if tuple(batch) == tuple(range(len(batch))) and len(free) <= 1 and len(contract) <= 1:
        return None
    return order


# Ops XLA expands into a computation whose shared intermediates it materialises, so their
# readers recompute them from these: threefry's two words per output word; erf and erfc's
# rational approximation (|x| and the quotient) and exp(-x^2), which their derivative shares;
# the index array of a batched gather or scatter (`batched_indices`).
EXPANDED = {"batched_indices": 1, "random_bits": 2, "random_split": 2, "random_fold_in": 2,
            "random_seed": 2, "threefry2x32": 2, "erf": 3, "erfc": 3}


def batched_indices(eqn: Eqn) -> tuple | None:
    """The shape of the index array XLA builds for a gather or scatter with batching dimensions
    (indices and one iota per batching dimension, concatenated), or None."""
    numbers = eqn.params["dimension_numbers"]
    batch = getattr(numbers, "operand_batching_dims", ())
    if not batch or not isinstance(eqn.inputs[1], Var):
        return None
    indices = eqn.inputs[1].aval
    depth = indices.shape[-1] if indices.shape else 1
    rows = int(np.prod(indices.shape[:-1])) if indices.shape else 1
    return (rows, depth + len(batch))


def library_dot(eqn: Eqn) -> bool:
    """Whether XLA:CPU hands a dot to YNNPACK: f32, the left operand contracting its last
    dimension, and not tiny (its own emitter takes the rest)."""
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.inputs[0].aval
    out = eqn.outputs[0].aval
    return lhs.dtype == np.float32 and tuple(lc) == (len(lhs.shape) - 1,) \
        and max(out.shape, default=1) >= 8 and min(out.shape, default=1) > 1


def conv_operand_copies(eqn: Eqn) -> tuple:
    """Per operand of a convolution, the layout XLA:CPU copies it into (its dimension spec), or
    None where it reads it in place: XLA:CPU convolves an input laid out (batch, spatial...,
    feature) with a kernel laid out (spatial..., in, out)."""
    numbers = eqn.params["dimension_numbers"]
    lhs, rhs = tuple(numbers.lhs_spec), tuple(numbers.rhs_spec)
    r = len(lhs)
    return (None if lhs == (0, r - 1, *range(1, r - 1)) else lhs,
            None if rhs == (r - 1, r - 2, *range(r - 2)) else rhs)


def output_bytes(eqn: Eqn) -> list[int]:
    """Bytes of each output's buffer (see `EXPANDED`)."""
    return [EXPANDED.get(eqn.op, 1) * nbytes(v.aval) for v in eqn.outputs]


RNG_LOOP_OVERHEAD = 14 * ALIGN  # threefry's loop: counter, key words, their copies, the tuple


def workspace(eqn: Eqn) -> int:
    """Temp bytes an op holds only while it runs, beyond its inputs and outputs."""
    if eqn.op in RNG:  # the loop copies both halves of its state each round
        return sum(aligned(s) for s in output_bytes(eqn)) + RNG_LOOP_OVERHEAD
    if eqn.op == "select_and_scatter_add":  # XLA expands it: an s32 iota per operand dimension,
        operand, source = eqn.inputs[1].aval, eqn.inputs[0].aval  # a variadic reduce_window,
        rank = len(operand.shape)  # the concatenated indices, and a scatter into zeros
        return aligned(rank * operand.size * 4) + 2 * aligned((rank + 1) * source.size * 4)
    if eqn.op in REDUCE and reduce_path(eqn) == "tree":  # the reduce_window's partial sums
        x = eqn.inputs[0].aval
        longest = max(x.shape[a] for a in eqn.params["axes"])
        return aligned(nbytes(eqn.outputs[0].aval) * -(-longest // 32))
    if eqn.op in ("sort", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
        return sum(aligned(nbytes(v.aval)) for v in eqn.outputs)
    return 0


def loop_overhead(n_elements: int) -> int:
    """A while loop's own small buffers: its tuple of pointers, the counter, its copy and the
    increment, and the predicate."""
    return aligned(8 * n_elements) + 4 * ALIGN
