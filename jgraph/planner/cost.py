"""The planner's cost model: what recomputing an eqn costs, and what keeping a value costs.

Recompute cost is counted in flop-equivalents per run of the eqn:
- contractions (`dot_general`, `conv_general_dilated`) by their contraction sizes: 2 x (output
  elements) x (contracted elements per output);
- a loop by its body: a `scan` costs its body's cost times its length (times `mean_runs`, for the
  masked scan that recomputes a kept scan's carries, whose cond runs the body (k-1)/2 times on
  average), a `cond` its costliest branch, a `while` its body once (its trip count is unknown);
- an op that reads or writes memory in its own kernel (a reduction, a gather, a scatter, a sort,
  an FFT, ...) by the elements it moves;
- a cheap elementwise or layout op (add, tanh, select, broadcast, reshape, convert, ...) costs
  almost nothing to recompute: XLA fuses it into the kernel that reads it, which then reads the
  op's inputs instead of a stored result (PyTorch's min-cut insight). It costs
  `FUSED_PER_ELEMENT` per output element, so that moderate budgets are met at no slowdown.

Keeping a value costs its bytes (`jgraph.memory.nbytes`) for as long as it is kept, and memory
traffic: a value kept from the forward to the backward is written out and read back, where a
value recomputed just before its reader is often still in cache. `KEPT_BYTE_COST` flop-equivalents
per byte kept (the machine's balance of flops to bandwidth; on XLA:CPU a large temp also costs
page faults: on the planner benchmark's models a kept byte costs about as much as 64 flops).
"""

from __future__ import annotations

import math

import numpy as np

from jgraph.ir import Eqn, Graph, sub_graphs

# Ops that run as their own kernel and move their operands through memory (not fused away).
MEMORY_BOUND = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "gather",
    "scatter", "scatter_add", "scatter_mul", "scatter_min", "scatter_max", "sort", "top_k",
    "fft", "reduce_window_sum", "reduce_window_max", "reduce_window_min", "select_and_scatter_add",
    "reduce_precision", "custom_jvp_call", "custom_vjp_call", "dynamic_slice",
    "dynamic_update_slice", "concatenate", "pad", "transpose", "rng_bit_generator",
    "random_bits", "threefry2x32"})
# Ops whose cost is their arithmetic: transcendental elementwise ops count a few flops each.
TRANSCENDENTAL = frozenset({"exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin",
                            "cos", "tan", "erf", "erf_inv", "pow", "atan2", "sqrt", "rsqrt",
                            "lgamma", "digamma"})
FUSED_PER_ELEMENT = 0.05  # a fused elementwise op: a twentieth of a flop per element
KEPT_BYTE_COST = 64.0  # flop-equivalents per byte kept from the forward to the backward
TRANSCENDENTAL_PER_ELEMENT = 0.2


def elements(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def eqn_cost(eqn: Eqn) -> float:
    """Flop-equivalents of running `eqn` once (its bodies included)."""
    if eqn.op == "dot_general":
        (contract, _), lhs = eqn.params["dimension_numbers"], eqn.inputs[0].aval
        k = math.prod(lhs.shape[d] for d in contract[0])
        return 2.0 * elements(eqn.outputs[0].aval) * max(k, 1)
    if eqn.op == "conv_general_dilated":
        rhs = eqn.inputs[1].aval
        out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
        per_output = elements(rhs) / max(out_features, 1)
        return 2.0 * elements(eqn.outputs[0].aval) * per_output
    if eqn.op == "scan":  # `mean_runs`: the body runs this often on average (a masked scan)
        return eqn.params.get("mean_runs", eqn.params["length"]) * graph_cost(eqn.params["body"])
    if eqn.op == "cond":
        return max((graph_cost(b) for b in eqn.params["branches"]), default=0.0)
    if sub_graphs(eqn):
        return sum(graph_cost(g) for g in sub_graphs(eqn))
    out = sum(elements(v.aval) for v in eqn.outputs)
    if eqn.op in MEMORY_BOUND:
        return float(out + sum(elements(a.aval) for a in eqn.inputs))
    if eqn.op in TRANSCENDENTAL:
        return TRANSCENDENTAL_PER_ELEMENT * out
    return FUSED_PER_ELEMENT * out


def graph_cost(graph: Graph) -> float:
    return sum(eqn_cost(e) for e in graph.eqns)


def recompute_flops(graph: Graph) -> float:
    """Flop-equivalents the recompute eqns of a rematerialized graph run per step: a loop body's
    recompute once per iteration, a whole loop recomputed at its full cost."""
    total = 0.0
    for e in graph.eqns:
        if "recompute" in e.tags:
            total += eqn_cost(e)
        elif e.op == "scan":
            total += e.params["length"] * recompute_flops(e.params["body"])
        elif e.op == "cond":
            total += max((recompute_flops(b) for b in e.params["branches"]), default=0.0)
    return total
