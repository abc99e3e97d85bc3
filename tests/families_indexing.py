"""Gradient families of indexing ops, with the parameters of JAX's autodiff suite: gather and
scatter-add over index layouts and modes (clip, fill, promise_in_bounds) with out-of-bounds
indices where the mode defines them; scatter (overwrite) with unique and duplicate indices in
every mode; scatter-sub, scatter-max/min (ties included); numpy-style indexing and its batched
(vmapped) gathers; dynamic_slice / dynamic_update_slice with negative and out-of-range starts."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from op_families import COMPLEX, ISSUE_TAG, REAL, Arg, Case

RC = (REAL, COMPLEX)
MODES = ["clip", "fill", "promise_in_bounds"]
GDN, SDN = lax.GatherDimensionNumbers, lax.ScatterDimensionNumbers

# operand shape, index shape, dimension numbers, slice sizes, largest in-bounds index
GATHERS = [((5,), (2, 1), GDN((), (0,), (0,)), (1,), 5),
           ((10,), (3, 1), GDN((1,), (), (0,)), (2,), 9),
           ((10, 5), (3, 1), GDN((1,), (0,), (0,)), (1, 3), 3)]
# operand shape, index shape, update shape, dimension numbers, largest in-bounds index
SCATTERS = [((5,), (2, 1), (2,), SDN((), (0,), (0,)), 4),
            ((10,), (3, 1), (3, 2), SDN((1,), (), (0,)), 9),
            ((10, 5), (3, 1), (3, 3), SDN((1,), (0,), (0,)), 3)]


def _indices(name, shape, low, high, unique=False):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if unique:
        return rng.permutation(high)[:int(np.prod(shape))].reshape(shape).astype(np.int32)
    return rng.integers(low, high, shape).astype(np.int32)


def _gather_cases():
    cases = []
    for k, (shape, ishape, dn, sizes, top) in enumerate(GATHERS):
        for mode in MODES:
            for it in range(5):
                # out-of-bounds indices only where the mode defines their gradient (as JAX)
                low, high = (0, top) if mode == "promise_in_bounds" else (-top, 2 * top)
                idx = _indices(f"g{k}{mode}{it}", ishape, low, high)
                fn = (lambda x, idx=idx, dn=dn, sizes=sizes, mode=mode:
                      lax.gather(x, idx, dn, sizes, mode=mode, fill_value=-1))
                cases.append(Case(f"gather/{mode}", f"{k}:{it}:{idx.ravel().tolist()}", fn,
                                  (Arg(shape),), ("gather",), RC))
    take = np.array([[0], [3], [1]])
    cases += [
        Case("gather/numpy", "x[idx]", lambda x: x[np.array([2, 0, 2, -1])], (Arg((3, 4)),),
             ("gather",), RC),
        Case("gather/numpy", "x[:, idx]", lambda x: x[:, np.array([[1, 0], [3, 3]])],
             (Arg((3, 4)),), ("gather",)),
        Case("gather/numpy", "take_along_axis", lambda x: jnp.take_along_axis(x, take, 1),
             (Arg((3, 4)),), ("gather",)),
        Case("gather/numpy", "index_take",
             lambda x: x[np.array([0, 2]), :, np.array([1, 3])], (Arg((3, 4, 5)),),
             ("gather",)),
        Case("gather/batched", "vmap",
             lambda x: jax.vmap(lambda row: row[np.array([3, 0, 3])])(x), (Arg((2, 5)),),
             ("gather",)),
        Case("gather/batched", "vmap2",
             lambda x: jax.vmap(lambda row, i: row[i])(x, np.array([[0, 4], [1, 1]])),
             (Arg((2, 5)),), ("gather",)),
    ]
    return cases


def _scatter_add_cases():
    cases = []
    for k, (shape, ishape, ushape, dn, top) in enumerate(SCATTERS):
        for mode in MODES:
            for it in range(5):
                low, high = (0, top) if mode == "promise_in_bounds" else (-top, 2 * top)
                idx = _indices(f"s{k}{mode}{it}", ishape, low, high)
                for op, scatter in [("scatter-add", lax.scatter_add),
                                    ("scatter-sub", lax.scatter_sub)]:
                    fn = (lambda x, u, idx=idx, dn=dn, mode=mode, scatter=scatter:
                          scatter(x, idx, u, dn, mode=mode))
                    cases.append(Case(f"{op}/{mode}", f"{k}:{it}:{idx.ravel().tolist()}", fn,
                                      (Arg(shape), Arg(ushape)), (op,), RC))
    cases.append(Case("scatter-add/numpy", "at.add dup", lambda x, u: x.at[
        np.array([2, 0, 2, 1])].add(u), (Arg((3, 4)), Arg((4, 4))), ("scatter-add",), RC))
    cases.append(Case("scatter-add/numpy", "fill oob", lambda x, u: x.at[
        np.array([1, 7, -9])].add(u, mode="fill"), (Arg((5,)), Arg((3,))), ("scatter-add",),
        tags=ISSUE_TAG))
    return cases


def _scatter_cases():
    """Overwriting scatter: JAX's testScatterGrad (unique indices, spaced so windows do not
    overlap), then duplicate indices (only the update that lands gets a gradient) in every mode,
    out-of-bounds indices, and the numpy forms."""
    cases = []
    for k, ((shape, ishape, ushape, dn, top), spacing) in enumerate(zip(SCATTERS, (1, 2, 1),
                                                                         strict=True)):
        for it in range(5):
            idx = _indices(f"u{k}{it}", ishape, 0, top // spacing, unique=True) * spacing
            for unique in (False, True):
                fn = (lambda x, u, idx=idx, dn=dn, unique=unique:
                      lax.scatter(x, idx, u, dn, unique_indices=unique))
                cases.append(Case("scatter/unique", f"{k}:{it}:{idx.ravel().tolist()}:{unique}",
                                  fn, (Arg(shape), Arg(ushape)), ("scatter",), RC))
        for mode in MODES:
            for it in range(3):
                low, high = (0, top) if mode == "promise_in_bounds" else (-top, 2 * top)
                idx = _indices(f"d{k}{mode}{it}", ishape, low, high)
                idx[-1] = idx[0]  # at least one duplicate
                fn = (lambda x, u, idx=idx, dn=dn, mode=mode: lax.scatter(x, idx, u, dn,
                                                                          mode=mode))
                cases.append(Case(f"scatter/duplicates/{mode}",
                                  f"{k}:{it}:{idx.ravel().tolist()}", fn,
                                  (Arg(shape), Arg(ushape)), ("scatter",), RC))
    cases += [
        Case("scatter/numpy", "set dup", lambda x, u: x.at[np.array([0, 0])].set(u),
             (Arg((5,)), Arg((2,))), ("scatter",), RC, tags=ISSUE_TAG),
        Case("scatter/numpy", "set rows dup", lambda x, u: x.at[np.array([2, 0, 2])].set(u),
             (Arg((3, 4)), Arg((3, 4))), ("scatter",)),
        Case("scatter/numpy", "set diag", lambda x: x.at[np.diag_indices(5)].set(
            jnp.arange(5, dtype=x.dtype)), (Arg((5, 5)),), ("scatter",)),
        Case("scatter/numpy", "set oob drop", lambda x, u: x.at[np.array([1, 9, 1])].set(
            u, mode="drop"), (Arg((5,)), Arg((3,))), ("scatter",)),
        Case("scatter/numpy", "set scalar index", lambda x, u: x.at[2].set(u),
             (Arg((4, 3)), Arg((3,))), ("scatter",)),
    ]
    return cases


def _scatter_extremal_cases():
    """JAX's testScatterMax/Min (random indices, duplicates likely), and ties with the operand
    and between updates (checked against JAX only: a tie is not differentiable)."""
    cases = []
    for op, scatter in [("scatter-max", lax.scatter_max), ("scatter-min", lax.scatter_min)]:
        for k, (shape, ishape, ushape, dn, _) in enumerate(SCATTERS):
            for it in range(4):
                idx = _indices(f"{op}{k}{it}", ishape, 0, max(shape))
                fn = lambda x, u, idx=idx, dn=dn, scatter=scatter: scatter(x, idx, u, dn)
                cases.append(Case(op, f"{k}:{it}:{idx.ravel().tolist()}", fn,
                                  (Arg(shape, "unique"), Arg(ushape, "unique")), (op,)))
        # x[1] ties with two updates, x[2] with one; index 9 is out of bounds (dropped)
        method = "max" if op == "scatter-max" else "min"
        cases.append(Case(f"{op}/ties", "operand and updates",
                          lambda x, u, m=method: getattr(x.at[np.array([1, 1, 2, 9])], m)(u),
                          (Arg((5,), ("values", (0, 3, 1, 2, 5))),
                           Arg((4,), ("values", (3, 3, 1, 7)))), (op,), order=0,
                          why_no_fd="ties: the derivative is a convention (JAX's, checked)"))
    return cases


def _dynamic_slice_cases():
    """JAX's testDynamicSliceGrad / testDynamicUpdateSliceGrad, plus starts that are negative
    or out of range (normalised once, then clamped, as JAX does)."""
    cases = []
    for shape, starts, sizes in [((3,), (1,), (1,)), ((5, 3), (1, 1), (3, 1)),
                                 ((7, 5, 3), (4, 1, 0), (2, 0, 1)), ((5, 5), (-8, 0), (1, 5)),
                                 ((5, 5), (-2, 3), (2, 2)), ((5, 5), (4, 9), (3, 2)),
                                 ((5, 5), (-1, -7), (5, 1))]:
        cases.append(Case("dynamic_slice", f"{shape}@{starts}+{sizes}",
                          lambda x, s=starts, n=sizes: lax.dynamic_slice(x, s, n),
                          (Arg(shape),), ("dynamic_slice",), RC))
        cases.append(Case("dynamic_update_slice", f"{shape}@{starts}<-{sizes}",
                          lambda x, u, s=starts: lax.dynamic_update_slice(x, u, s),
                          (Arg(shape), Arg(sizes)), ("dynamic_update_slice",), RC))
        cases.append(Case("dynamic_update_slice", f"{shape}@{starts}<-{sizes} traced starts",
                          lambda x, u, s=starts: lax.dynamic_update_slice(
                              x, u, [jnp.int32(v) + 0 * jnp.int32(x.size) for v in s]),
                          (Arg(shape), Arg(sizes)), ("dynamic_update_slice",)))
    cases.append(Case("dynamic_slice", "index_in_dim -8",
                      lambda x: lax.dynamic_index_in_dim(x, -8, 0), (Arg((5, 5)),),
                      ("dynamic_slice",), tags=ISSUE_TAG))
    cases.append(Case("dynamic_update_slice", "update_index_in_dim -8",
                      lambda x, y: lax.dynamic_update_index_in_dim(x, y, -8, 0),
                      (Arg((5, 5)), Arg((1, 5))), ("dynamic_update_slice",), tags=ISSUE_TAG))
    return cases


def cases():
    return (_gather_cases() + _scatter_add_cases() + _scatter_cases() + _scatter_extremal_cases()
            + _dynamic_slice_cases())
