"""Gradient families of data-movement ops and contractions, with the parameters of JAX's
autodiff suite: broadcast, reshape (with `dimensions`), transpose, rev, slice (strides), pad
(negative and interior, rank 0), concatenate, split, stack, tile, squeeze; `dot_general` (contract
and batch dimensions, preferred types) and `conv_general_dilated` (layouts, strides, padding, both
dilations, feature and batch groups, empty spatial dimensions)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
from jax import lax
from op_families import COMPLEX, ISSUE_TAG, REAL, Arg, Case

RC = (REAL, COMPLEX)


def _broadcast_cases():
    cases = [Case("broadcast_in_dim", f"{shape}+{sizes}",
                  lambda x, sizes=sizes: lax.broadcast(x, sizes), (Arg(shape),),
                  ("broadcast_in_dim",), RC)
             for shape in [(), (2, 3)] for sizes in [(2,), (1, 2)]]
    for inshape, outshape, dims in [((2,), (2, 2), (0,)), ((2,), (2, 2), (1,)),
                                    ((2,), (2, 3), (0,)), ((), (2, 3), ()),
                                    ((3, 1), (3, 2, 4), (0, 2))]:
        cases.append(Case("broadcast_in_dim", f"{inshape}->{outshape}@{dims}",
                          lambda x, o=outshape, d=dims: lax.broadcast_in_dim(x, o, d),
                          (Arg(inshape),), ("broadcast_in_dim",)))
    return cases


def _reshape_cases():
    cases = []
    for shape, out, perm in [((3, 4), (12,), None), ((2, 1, 4), (8,), None),
                             ((2, 2, 4), (2, 8), None), ((3, 4), (12,), (0, 1)),
                             ((3, 4), (12,), (1, 0)), ((2, 1, 4), (8,), (0, 2, 1)),
                             ((2, 1, 4), (8,), (2, 0, 1)), ((2, 2, 4), (2, 8), (0, 2, 1)),
                             ((2, 2, 4), (2, 8), (2, 0, 1))]:
        cases.append(Case("reshape", f"{shape}->{out}@{perm}",
                          lambda x, o=out, p=perm: lax.reshape(x, o, p), (Arg(shape),),
                          ("reshape",), RC, tags=ISSUE_TAG if perm == (1, 0) else frozenset()))
    cases.append(Case("squeeze", "(3,1,4)", lambda x: lax.squeeze(x, (1,)), (Arg((3, 1, 4)),),
                      ("squeeze",), RC))
    cases.append(Case("squeeze", "expand_dims", lambda x: jnp.expand_dims(x, (0, 2)) * 2,
                      (Arg((3, 4)),), ("broadcast_in_dim",)))
    return cases


def _permutation_cases():
    cases = [Case("transpose", f"{shape}@{perm}", lambda x, p=perm: lax.transpose(x, p),
                  (Arg(shape),), ("transpose",), RC)
             for shape, perm in [((3, 4), (1, 0)), ((3, 4, 5), (2, 1, 0)),
                                 ((3, 4, 5), (1, 0, 2))]]
    cases += [Case("rev", f"{shape}@{dims}", lambda x, d=dims: lax.rev(x, d), (Arg(shape),),
                   ("rev",), RC)
              for shape, dims in [((3,), (0,)), ((2, 3), (0, 1)), ((2, 3, 4), (1,))]]
    return cases


def _slice_cases():
    table = [((3,), (1,), (2,), None), ((7,), (4,), (7,), None), ((5,), (1,), (5,), (2,)),
             ((8,), (1,), (6,), (2,)), ((5, 3), (1, 1), (3, 2), None),
             ((5, 3), (1, 1), (3, 1), None), ((7, 5, 3), (4, 0, 1), (7, 1, 3), None),
             ((5, 3), (1, 1), (2, 1), (1, 1)), ((5, 3), (1, 1), (5, 3), (2, 1)),
             ((3, 3, 5), (0, 2, 0), (3, 2, 5), (1, 2, 1)), ((3, 4), (0, 0), (0, 4), None)]
    return [Case("slice", f"{shape}[{lo}:{hi}:{st}]",
                 lambda x, lo=lo, hi=hi, st=st: lax.slice(x, lo, hi, st), (Arg(shape),),
                 ("slice",), RC) for shape, lo, hi, st in table]


def _pad_cases():
    """JAX's testPadGrad, with and without the padding value as an argument (rank 0 too)."""
    cases = []
    for shape, pads in [((), ()), ((2, 3), ((1, 2, 1), (0, 1, 0))),
                        ((2, 3), ((-1, 0, 0), (-1, 0, 2))), ((3, 4), ((1, -1, 1), (2, 0, 0)))]:
        cases.append(Case("pad", f"{shape}{pads}",
                          lambda x, p=pads: lax.pad(x, jnp.zeros((), x.dtype), p), (Arg(shape),),
                          ("pad",), RC, tags=frozenset() if shape else ISSUE_TAG))
        cases.append(Case("pad", f"{shape}{pads}+value", lambda x, v, p=pads: lax.pad(x, v, p),
                          (Arg(shape), Arg(())), ("pad",), RC))
    return cases


def _joining_cases():
    cases = []
    for base in [(4,), (3, 4), (2, 3, 4)]:
        for dim in range(len(base)):
            shapes = [base[:dim] + (n,) + base[dim + 1:] for n in (3, 1, 4)]
            cases.append(Case("concatenate", f"{base}@{dim}",
                              lambda *xs, d=dim: lax.concatenate(xs, d),
                              tuple(Arg(s) for s in shapes), ("concatenate",), RC))
            for sizes in [(2,), (1, 3), (2, 0, 1)]:
                shape = base[:dim] + (sum(sizes),) + base[dim + 1:]
                cases.append(Case("split", f"{base}@{dim}/{sizes}",
                                  lambda x, s=sizes, d=dim: lax.split(x, s, d), (Arg(shape),),
                                  ("split",), RC))
            cases.append(Case("stack", f"{base}@{dim}", lambda x, y, d=dim: jnp.stack([x, y, x],
                                                                                     d),
                              (Arg(base), Arg(base)), ("stack",), RC))
    for shape, reps in [((3,), (2,)), ((2, 3), (1, 2)), ((1, 1, 4), (1, 3, 1))]:
        cases.append(Case("tile", f"{shape}x{reps}", lambda x, r=reps: lax.tile(x, r),
                          (Arg(shape),), ("tile",), RC, order=3))
    cases.append(Case("tile", "jnp.tile", lambda x: jnp.tile(x, (2, 3)), (Arg((3,)),), ("tile",),
                      tags=ISSUE_TAG))
    return cases


HIGHEST = lax.Precision.HIGHEST


def _dot_cases():
    cases = [Case("dot_general", f"dot{a}{b}", lambda x, y: lax.dot(x, y, precision=HIGHEST),
                  (Arg(a), Arg(b)), ("dot_general",), RC)
             for a in [(2,), (3, 2)] for b in [(2,), (2, 4)]]
    for a, b, dims in [((3, 2), (2, 4), (([1], [0]), ([], []))),
                       ((3, 5), (2, 5), (([1], [1]), ([], []))),
                       ((5, 3), (5, 2), (([0], [0]), ([], []))),
                       ((3, 3, 2), (3, 2, 4), (([2], [1]), ([0], [0]))),
                       ((3, 5, 2), (2, 4, 5), (([2], [0]), ([1], [2]))),
                       ((7, 3, 5, 2), (2, 2, 4, 5), (([3], [0]), ([2], [3])))]:
        cases.append(Case("dot_general", f"{a}.{b}@{dims}",
                          lambda x, y, d=dims: lax.dot_general(x, y, d, precision=HIGHEST),
                          (Arg(a), Arg(b)), ("dot_general",), RC))
    for lhs, rhs in [(jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float16),
                     (jnp.bfloat16, jnp.float32)]:
        cases.append(Case(
            "dot_general/preferred", f"{np.dtype(lhs).name}.{np.dtype(rhs).name}->f32",
            lambda x, y: lax.dot_general(x, y, (([1], [0]), ([], [])),
                                         preferred_element_type=jnp.float32),
            (Arg((3, 4), dtype=lhs), Arg((4, 2), dtype=rhs)), ("dot_general",), order=0,
            rtol=2e-2, why_no_fd="fixed narrow dtypes; the float64 form is a plain dot"))
    return cases


def _conv_cases():
    """JAX's testConvGeneralDilatedGrad: groups, lhs shapes (an empty spatial dim too),
    strides, both dilations, paddings, dimension numbers; complex dtypes."""
    cases = []
    layouts = [(("NCHW", "OIHW", "NCHW"), ([0, 1, 2, 3], [0, 1, 2, 3])),
               (("NHWC", "HWIO", "NHWC"), ([0, 2, 3, 1], [2, 3, 1, 0])),
               (("NHWC", "OIHW", "NCHW"), ([0, 2, 3, 1], [0, 1, 2, 3]))]
    for (bgc, fgc), (b, i, j) in itertools.product([(1, 1), (2, 1), (1, 2)],
                                                   itertools.product([1, 2], repeat=3)):
        for spatial in [(6, 7), (0, 4)]:
            lhs = (b * bgc, i * fgc) + spatial
            rhs = (j * bgc * fgc, i, 1, 2)
            pads = [((0, 0), (0, 0)), ((1, 0), (0, 1))] + ([((0, -1), (0, 0))] if spatial[0]
                                                            else [])
            for strides, lhs_dil, rhs_dil, pad, (dn, (lperm, rperm)) in itertools.product(
                    [(1, 1), (1, 2), (2, 1)], [(1, 1), (2, 1)], [(1, 1), (2, 2)], pads, layouts):
                fn = (lambda x, w, s=strides, p=pad, ld=lhs_dil, rd=rhs_dil, dn=dn, f=fgc, g=bgc:
                      lax.conv_general_dilated(x, w, s, p, ld, rd, dn, f, g, precision=HIGHEST))
                name = (f"g{bgc},{fgc} {lhs}*{rhs} s{strides} ld{lhs_dil} rd{rhs_dil} p{pad} "
                        f"{dn[0]}")
                cases.append(Case("conv_general_dilated", name, fn,
                                  (Arg(tuple(np.take(lhs, lperm)), "small"),
                                   Arg(tuple(np.take(rhs, rperm)), "small")),
                                  ("conv_general_dilated",), RC, rtol=1e-4))
    cases.append(Case("conv_general_dilated/preferred", "bf16->f32",
                      lambda x, w: lax.conv_general_dilated(
                          x, w, (1, 1), "SAME", preferred_element_type=jnp.float32),
                      (Arg((1, 2, 4, 4), dtype=jnp.bfloat16), Arg((3, 2, 2, 2),
                                                                  dtype=jnp.bfloat16)),
                      ("conv_general_dilated",), order=0, rtol=2e-2,
                      why_no_fd="fixed narrow dtypes; the float64 form is a plain convolution"))
    return cases


def _sharding_cases():
    """A layout annotation (on this process's one device; many devices: tests/test_sharding.py):
    its cotangent gets the same constraint."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    return [Case("sharding_constraint", f"{spec}", lambda x, s=spec: jnp.sin(
                     lax.with_sharding_constraint(x, NamedSharding(mesh, s))),
                 (Arg((4, 3)),), ("sharding_constraint",), RC)
            for spec in (PartitionSpec("data"), PartitionSpec(None, "data"))]


def cases():
    return (_broadcast_cases() + _reshape_cases() + _permutation_cases() + _slice_cases()
            + _pad_cases() + _joining_cases() + _dot_cases() + _conv_cases() + _sharding_cases())
