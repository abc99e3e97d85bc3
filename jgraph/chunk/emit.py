"""Emitting a region on a chunk of rows, and moving rows in and out of chunks (`jg.chunk_rows`).

A region's eqns are emitted again on a chunk, each with the params its row rule gives for the
chunk's row shape (`jgraph.chunk.rows`), into a scan body; the row inputs are cut into chunks
along one row axis before the scan, the ys put back after it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jgraph.builder import Builder
from jgraph.chunk.find import Head
from jgraph.chunk.rows import row_params
from jgraph.errors import TransformError
from jgraph.ir import Eqn, Graph, Var, short_aval
from jgraph.naming import while_processing


def split_rows(rows, chunks: int) -> tuple[int, int, int, int]:
    """(row axis to split, rows per chunk, full chunks, rows left for one more chunk): an axis
    the chunks divide if any, else one with at least `chunks` rows, else the longest."""
    def fit(a):
        return (rows[a] % chunks == 0 and rows[a] >= chunks, rows[a] >= chunks, -a)

    axis = max(range(len(rows)), key=lambda a: (fit(a), rows[a]))
    count = min(chunks, rows[axis])
    size = -(-rows[axis] // count)
    n = rows[axis] // size
    return axis, size, n, rows[axis] - n * size


def chunk_shape(rows, axis: int, size: int) -> tuple[int, ...]:
    """`rows` with `size` rows along `axis`."""
    return tuple(size if a == axis else r for a, r in enumerate(rows))


def emit_on_chunk(b: Builder, head: Head, rows, env: dict) -> None:
    """Emit `head`'s eqns on a chunk of `rows` into `b`; `env` maps the region's inputs to the
    chunk's atoms and gets its values. The row sums (`head.sums`) keep their params, and so do
    eqns without flags (`head.flags`: reading no rows, such as a layer's weights transposed)."""
    k = head.k
    for eqn in head.eqns:
        b.source = eqn.source
        flags = head.flags.get(eqn)
        as_is = flags is None or (eqn in head.sums and head.sums_reduce)
        with while_processing("chunking", eqn, error=TransformError):
            params = eqn.params if as_is else row_params(eqn, flags, k, rows)
            outs = b.bind(eqn.op, *(env.get(a, a) if type(a) is Var else a for a in eqn.inputs),
                          **params)
        for v, new in zip(eqn.outputs, outs, strict=True):
            expect = v.aval.shape if as_is else rows + v.aval.shape[k:]
            if tuple(new.aval.shape) != tuple(expect):  # a row rule that does not fit its op
                raise TransformError(f"chunk_rows: `{eqn.op}` on a chunk gives "
                                     f"{short_aval(new.aval)}, expected {expect}")
            env[v] = new


def scan_over_chunks(b: Builder, body_of, consts, row_inputs, axis: int, size: int, n: int,
                     rest: int) -> list[Var]:
    """Emit a scan over the `n` chunks of `size` rows of `row_inputs` along `axis` (and one
    more iteration on the `rest` rows left) whose body is `body_of(rows in a chunk)`: (consts,
    a chunk of each row input) -> a chunk of each result; the results, put back together."""
    xs = [b.call(to_chunks, u, axis=axis, n=n, size=size)[0] for u in row_inputs]
    _, ys = emit_scan(b, body_of(size), consts, [], xs, n)
    if not rest:
        return [b.call(from_chunks, y, axis=axis)[0] for y in ys]
    xs = [b.call(rest_chunk, u, axis=axis, start=n * size)[0] for u in row_inputs]
    _, more = emit_scan(b, body_of(rest), consts, [], xs, 1)
    return [b.call(join_chunks, y, m, axis=axis)[0] for y, m in zip(ys, more, strict=True)]


def with_loops(graph: Graph, replaced: dict, gone: set) -> Graph:
    """`graph` with each region's end replaced by its eqns (`replaced`: end -> eqns) and the
    region's other eqns (`gone`) left out."""
    eqns = []
    for eqn in graph.eqns:
        if eqn in replaced:
            eqns += replaced[eqn]
        elif eqn not in gone:
            eqns.append(eqn)
    return graph.replace(eqns=tuple(eqns))


def emit_scan(b: Builder, body: Graph, consts, carry, xs, length: int, final=None):
    """Emit the scan; `final` (vars) name the first carries it returns (the row sums)."""
    avals = [a.aval for a in body.outputs]
    nk = len(carry)
    outs = [Var(a) for a in avals[:nk]] + [Var(a.update(shape=(length, *a.shape)))
                                            for a in avals[nk:]]
    if final is not None:
        outs[:len(final)] = final
    params = {"body": body, "length": length, "reverse": False, "num_consts": len(consts),
              "num_carry": nk, "unroll": 1}
    b.eqns.append(Eqn("scan", tuple(consts) + tuple(carry) + tuple(xs), params, tuple(outs),
                      b.tags, b.regions, b.source))
    return outs[:nk], outs[nk:]


# -- accumulating over chunks (emitted with `Builder.call`) --------------------------------------
def accumulated(dtype):
    """The dtype sums over chunks are carried in: float32 for 16-bit floats (as XLA accumulates
    a dot or a reduction), else the value's own."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dtype


def zeros(*, shape, dtype):
    return jnp.zeros(shape, dtype)


def accumulate(acc, x):
    return acc + x.astype(acc.dtype)


def cast(x, *, dtype):
    return x.astype(dtype)


# -- moving rows in and out of chunks (emitted with `Builder.call`) ------------------------------
def to_chunks(u, *, axis, n, size):
    """(..., n*size [+ rest], ...) -> (n, ..., size, ...): the full chunks along `axis`."""
    u = lax.slice_in_dim(u, 0, n * size, axis=axis)
    u = u.reshape(u.shape[:axis] + (n, size) + u.shape[axis + 1:])
    return jnp.moveaxis(u, axis, 0)


def from_chunks(y, *, axis):
    """(n, ..., size, ...) -> (..., n*size, ...)."""
    y = jnp.moveaxis(y, 0, axis)
    return y.reshape(y.shape[:axis] + (y.shape[axis] * y.shape[axis + 1],) + y.shape[axis + 2:])


def rest_chunk(u, *, axis, start):
    """The rows from `start` on along `axis`, as one chunk (a leading axis of 1)."""
    return lax.slice_in_dim(u, start, u.shape[axis], axis=axis)[None]


def join_chunks(y, more, *, axis):
    return jnp.concatenate([from_chunks(y, axis=axis), more[0]], axis=axis)
