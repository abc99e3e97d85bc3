"""Bad-input sweeps over random graphs and programs: every bad input gets a `jgraph` error naming
the problem (and where it came from), never a raw `KeyError`/`IndexError`/... from jgraph's
internals, nor a silently wrong result.

- mutated graphs (drop an eqn, read a value before its definition, swap or replace an input,
  change an aval, define a value twice, a literal of the wrong dtype, an unknown region, a wrong
  role): `check` raises `GraphError` naming the broken eqn (or input/output). Whether a swapped
  or replaced input breaks an eqn is decided by JAX (`jax.eval_shape` of the op), not by `check`;
- malformed user programs (non-scalar loss, integer params, unsupported primitives, a
  differentiable op without a VJP rule, and calls with other pytrees, shapes or dtypes): a
  `JGraphError` naming the problem, and the user's line where the problem is an eqn;
- corrupt state files (truncated, bytes flipped or inserted, header edited and resealed, another
  version, another model): `StateFileError`, the optimizer's and dataset's state untouched; or,
  where an edit changed nothing that matters, exactly the saved state.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import struct
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from jax import lax
from properties import assert_bitwise, examples

import jgraph as jg
from jgraph import ops
from jgraph.control_flow import HIGHER_ORDER
from jgraph.ir import Literal, Var
from jgraph.lower import Lowering
from jgraph.training import StateFileError, StateFileWarning
from jgraph.training.state_io import FORMAT_VERSION, MAGIC

HERE = re.escape(Path(__file__).name) + r":\d+"


# -- mutated graphs: check names the broken eqn ------------------------------------------------
def _defined_before(g, i) -> list[Var]:
    return list(g.inputs) + [v for e in g.eqns[:i] for v in e.outputs]


def _first_reader(g, outs, after: int):
    return next((j for j in range(after + 1, len(g.eqns))
                 if any(isinstance(a, Var) and a in outs for a in g.eqns[j].inputs)), None)


def _breaks(eqn, inputs) -> bool:
    """Does JAX reject `eqn`'s op on these inputs, or give other output avals? (A loop or a
    cond runs its bodies through jgraph's lowering, as `jgraph.lower` runs them: without it
    every loop was taken as broken by any swap, one of a weak and a strong scalar included.)"""
    specs = [jax.ShapeDtypeStruct(a.aval.shape, a.aval.dtype, weak_type=a.aval.weak_type)
             for a in inputs]
    bodies = {"interpret": Lowering().run_sub} if eqn.op in HIGHER_ORDER else {}
    try:
        outs = jax.eval_shape(lambda *xs: ops.lowerings[eqn.op](*xs, **bodies, **eqn.params),
                              *specs)
    except Exception:  # noqa: BLE001 - any rejection by JAX breaks the eqn
        return True
    return len(outs) != len(eqn.outputs) or any(
        o.shape != v.aval.shape or o.dtype != v.aval.dtype
        for o, v in zip(outs, eqn.outputs, strict=True))


def _with_eqn(g, i, **changes):
    eqns = list(g.eqns)
    eqns[i] = dataclasses.replace(eqns[i], **changes)
    return g.replace(eqns=tuple(eqns))


def drop_eqn(data, g):
    read = [i for i, e in enumerate(g.eqns) if _first_reader(g, e.outputs, i) is not None]
    if not read:
        return None
    i = data.draw(st.sampled_from(read))
    j = _first_reader(g, g.eqns[i].outputs, i)
    return g.replace(eqns=g.eqns[:i] + g.eqns[i + 1:]), j - 1, "is used before it is defined"


def read_before_definition(data, g):  # a cycle: an eqn reads its own or a later output
    sites = [(i, k) for i, e in enumerate(g.eqns) for k, a in enumerate(e.inputs)]
    if not sites:
        return None
    i, k = data.draw(st.sampled_from(sites))
    later = [v for e in g.eqns[i:] for v in e.outputs]
    v = data.draw(st.sampled_from(later))
    inputs = list(g.eqns[i].inputs)
    inputs[k] = v
    return _with_eqn(g, i, inputs=tuple(inputs)), i, f"input {k} .* is used before it is defined"


def swap_inputs(data, g):
    sites = [(i, a, b) for i, e in enumerate(g.eqns) for a in range(len(e.inputs))
             for b in range(a + 1, len(e.inputs)) if e.inputs[a].aval != e.inputs[b].aval]
    sites = [(i, a, b) for i, a, b in sites if _breaks(g.eqns[i], _swapped(g.eqns[i], a, b))]
    if not sites:
        return None
    i, a, b = data.draw(st.sampled_from(sites))
    return _with_eqn(g, i, inputs=_swapped(g.eqns[i], a, b)), i, ""


def _swapped(eqn, a, b):
    inputs = list(eqn.inputs)
    inputs[a], inputs[b] = inputs[b], inputs[a]
    return tuple(inputs)


def replace_input(data, g):
    sites = [(i, k) for i, e in enumerate(g.eqns) for k in range(len(e.inputs))]
    if not sites:
        return None
    i, k = data.draw(st.sampled_from(sites))
    eqn = g.eqns[i]
    others = [v for v in _defined_before(g, i) if v.aval != eqn.inputs[k].aval
              and _breaks(eqn, eqn.inputs[:k] + (v,) + eqn.inputs[k + 1:])]
    if not others:
        return None
    v = data.draw(st.sampled_from(others))
    return _with_eqn(g, i, inputs=eqn.inputs[:k] + (v,) + eqn.inputs[k + 1:]), i, ""


def change_aval(data, g):
    sites = [(i, k) for i, e in enumerate(g.eqns) for k in range(len(e.outputs))]
    i, k = data.draw(st.sampled_from(sites))
    old = g.eqns[i].outputs[k]
    if data.draw(st.booleans()):
        aval = old.aval.update(shape=old.aval.shape + (2,))
    else:
        other = np.float16 if old.aval.dtype != np.float16 else np.int32
        aval = old.aval.update(dtype=np.dtype(other), weak_type=False)
    new = Var(aval)

    def sub(a):
        return new if a is old else a

    eqns = tuple(dataclasses.replace(e, inputs=tuple(map(sub, e.inputs)),
                                     outputs=tuple(map(sub, e.outputs))) for e in g.eqns)
    return g.replace(eqns=eqns), i, f"output {k} has aval"


def define_twice(data, g):
    sites = [(j, k) for j, e in enumerate(g.eqns) for k in range(len(e.outputs))]
    j, k = data.draw(st.sampled_from(sites))
    earlier = _defined_before(g, j)
    w = data.draw(st.sampled_from(earlier))
    outputs = list(g.eqns[j].outputs)
    outputs[k] = w
    return _with_eqn(g, j, outputs=tuple(outputs)), j, f"output {k} "


def wrong_literal(data, g):
    sites = [(i, k) for i, e in enumerate(g.eqns) for k, a in enumerate(e.inputs)
             if isinstance(a, Literal) and np.ndim(a.value) == 0]
    if not sites:
        return None
    i, k = data.draw(st.sampled_from(sites))
    lit = g.eqns[i].inputs[k]
    other = np.float64 if lit.aval.dtype != np.float64 else np.float32
    wrong = Literal(np.asarray(lit.value, other)[()], lit.aval)  # value and aval disagree
    inputs = g.eqns[i].inputs[:k] + (wrong,) + g.eqns[i].inputs[k + 1:]
    return _with_eqn(g, i, inputs=inputs), i, f"literal input {k} holds"


def unknown_region(data, g):
    i = data.draw(st.integers(0, len(g.eqns) - 1))
    return _with_eqn(g, i, regions=(99,)), i, "refers to unknown checkpoint region 99"


def wrong_role(data, g):
    if data.draw(st.booleans()):
        k = data.draw(st.integers(0, len(g.inputs) - 1))
        roles = g.input_roles[:k] + ("weights",) + g.input_roles[k + 1:]
        return g.replace(input_roles=roles), f"input {k}", "has unknown role 'weights'"
    bad = [k for k, a in enumerate(g.outputs)
           if a.aval.shape != () or not jnp.issubdtype(a.aval.dtype, jnp.floating)]
    if not bad:
        return None
    k = data.draw(st.sampled_from(bad))
    roles = ["aux"] * len(g.outputs)
    roles[k] = "loss"
    return g.replace(output_roles=tuple(roles)), f"output {k}", "has role 'loss' but is"


MUTATIONS = {f.__name__: f for f in (drop_eqn, read_before_definition, swap_inputs, replace_input,
                                     change_aval, define_twice, wrong_literal, unknown_region,
                                     wrong_role)}


@examples(100)
@given(jg.testing.graphs(), st.sampled_from(sorted(MUTATIONS)), st.data())
def test_check_names_the_broken_eqn_of_a_mutated_graph(drawn, mutation, data):
    g, _ = drawn
    jg.check(g)
    mutated = MUTATIONS[mutation](data, g)
    assume(mutated is not None)
    bad, where, message = mutated
    where = f"eqn {where} `" if isinstance(where, int) else where
    with pytest.raises(jg.GraphError) as info:
        jg.check(bad)
    assert re.search(re.escape(where) + ".*" + message, str(info.value), re.S), str(info.value)


# -- malformed user programs ----------------------------------------------------------------------
def _text(e: BaseException) -> str:
    return "\n".join([str(e), *getattr(e, "__notes__", [])])


def _first_param_leaf(fn, args):
    n = fn.param_argnums
    i = n if isinstance(n, int) else n[0]
    path, leaf = jax.tree_util.tree_flatten_with_path(args[i])[0][0]
    return i, path, jnp.asarray(leaf)  # a Python-scalar param reads as its weakly typed array


def _loss(fn, args):
    out = fn(*args)
    return out[0] if fn.has_aux else out


def non_scalar_loss(fn, args):
    g = jg.trace(lambda *a: _loss(fn, a) * jnp.ones(2, _loss(fn, a).dtype), *args,
                 param_argnums=fn.param_argnums)
    return lambda: jg.backward(g), "must be a floating scalar|a loss must be a floating scalar"


def integer_param(fn, args):
    i, path, leaf = _first_param_leaf(fn, args)

    def retyped(arg, dtype):
        return jax.tree_util.tree_map_with_path(
            lambda p, x: jnp.asarray(x).astype(dtype) if p == path else x, arg)

    def with_int_param(*a):  # the program itself still computes in floats
        return fn(*a[:i], retyped(a[i], leaf.dtype), *a[i + 1:])

    bad = (*args[:i], jax.tree.map(np.asarray, retyped(args[i], np.int32)), *args[i + 1:])
    g = jg.trace(with_int_param, *bad, param_argnums=fn.param_argnums, has_aux=fn.has_aux)
    where = re.escape(f"args[{i}]{jax.tree_util.keystr(path)}")
    return lambda: jg.backward(g), f"param {where} is i32.*gradients need floating params"


def side_effect(fn, args):
    def with_callback(*a):  # (jax.debug.print is supported: `jgraph.effects`)
        jax.debug.callback(lambda *_: None, _loss(fn, a))
        return fn(*a)

    call = functools.partial(jg.trace, with_callback, *args, param_argnums=fn.param_argnums,
                             has_aux=fn.has_aux)
    return call, f"'debug_callback' has side effects.*{HERE}"


def no_vjp_rule(fn, args):
    i, path, _ = _first_param_leaf(fn, args)

    def with_igamma(*a):
        leaf = jax.tree_util.tree_flatten_with_path(a[i])[0][0][1]
        extra = jnp.sum(lax.igamma(jnp.full_like(leaf, 2.0), leaf * leaf + 1.0))
        out = fn(*a)
        return (out[0] + extra, out[1]) if fn.has_aux else out + extra

    g = jg.trace(with_igamma, *args, param_argnums=fn.param_argnums, has_aux=fn.has_aux)
    return lambda: jg.backward(g), f"no VJP rule for op 'igamma'.*{HERE}"


def _call_with(fn, args, bad):
    step = jg.compile(jg.backward(fn.trace(*args)))
    return lambda: step(*bad)


def other_pytree(fn, args):
    bad = (list(args),) if len(args) == 1 else (args[0], [args[1]], *args[2:])
    return _call_with(fn, args, bad), "do not match the traced signature"


def other_shape(fn, args):
    bad = jax.tree.map(lambda x: np.stack([x, x]), args)
    return _call_with(fn, args, bad), r"argument args\[\d+\].* but the traced signature has"


def other_dtype(fn, args):
    def retype(x):
        x = np.asarray(x)  # Python scalars too
        return x.astype(np.float16) if np.issubdtype(x.dtype, np.floating) else \
            x.astype(np.float32)

    return _call_with(fn, args, jax.tree.map(retype, args)), \
        r"argument args\[\d+\].* but the traced signature has"


FAULTS = {f.__name__: f for f in (non_scalar_loss, integer_param, side_effect, no_vjp_rule,
                                  other_pytree, other_shape, other_dtype)}


@examples(25)
@given(jg.testing.programs(max_steps=4), st.sampled_from(sorted(FAULTS)))
def test_malformed_programs_get_a_jgraph_error_naming_the_problem(drawn, fault):
    fn, args = drawn
    call, message = FAULTS[fault](fn, args)
    with pytest.raises(jg.JGraphError) as info:
        call()
    assert re.search(message, _text(info.value), re.S), _text(info.value)


def _branches_on_the_loss(p, x):
    loss = jnp.sum(jnp.tanh(p * x))
    if loss > 0:  # Python control flow on a traced value
        return loss
    return -loss


def test_python_control_flow_on_traced_values_is_a_trace_error_naming_the_line():
    p = np.ones(3, np.float32)
    with pytest.raises(jg.TraceError, match=HERE):
        jg.trace(_branches_on_the_loss, p, p, param_argnums=0)


def test_a_non_array_argument_is_a_trace_error_naming_it():
    with pytest.raises(jg.TraceError, match=r"args\[1\]"):
        jg.trace(lambda p, s: jnp.sum(p), np.ones(3, np.float32), "data", param_argnums=0)


def test_a_non_scalar_loss_error_names_the_line_that_computed_it():
    g = jg.trace(lambda p: p * 2.0, np.ones(3, np.float32), param_argnums=0)
    with pytest.raises(jg.TransformError, match=HERE):
        jg.backward(g)


# -- corrupt state files --------------------------------------------------------------------------
def _model(p, x):
    return jnp.tanh(x @ p["w"]) @ p["v"]


_X = np.linspace(-1, 1, 40, dtype=np.float32).reshape(8, 5)
_Y = np.arange(8, dtype=np.int32) % 3
_P = {"w": np.full((5, 4), 0.1, np.float32), "v": np.full((4, 3), -0.2, np.float32)}


@functools.cache
def _saved():
    """An optimizer after two steps, and the bytes of its saved state (with a dataset order)."""
    opt = jg.Optimizer(_model, optax.adam(1e-2), loss="cross_entropy", period=2)
    state = opt.init(_P, _X, _Y)
    for _ in range(3):
        state, _ = opt.step(state, _X, _Y)
    folder = Path(tempfile.mkdtemp(prefix="jgraph-sweep-"))
    ds = jg.Dataset(np.arange(12)).shuffle(jax.random.PRNGKey(1))
    opt.save(opt.latest_state, folder / "good.jgs", dataset=ds)
    return opt, folder, (folder / "good.jgs").read_bytes()


def _reseal(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def _corrupt(kind, data, blob):
    body = blob[:-32]
    if kind == "truncate":
        return blob[:data.draw(st.integers(0, len(blob) - 1))]
    if kind == "flip":
        at = data.draw(st.integers(0, len(blob) - 1))
        return blob[:at] + bytes([blob[at] ^ (1 << data.draw(st.integers(0, 7)))]) + blob[at + 1:]
    if kind == "insert":
        at = data.draw(st.integers(0, len(blob)))
        return blob[:at] + data.draw(st.binary(min_size=1, max_size=8)) + blob[at:]
    if kind == "version":
        fields = bytearray(body)
        version = data.draw(st.integers(0, 2**32 - 1).filter(lambda v: v != FORMAT_VERSION)
                            | st.just(2))  # 2 loads, with a warning; the current one is no change
        struct.pack_into("<I", fields, len(MAGIC), version)
        return _reseal(bytes(fields))
    if kind == "edit_header":  # any byte of the JSON header, resealed: the checksum is intact
        hlen = struct.unpack_from("<Q", blob, len(MAGIC) + 4)[0]
        start = len(MAGIC) + 12
        at = data.draw(st.integers(start, start + hlen - 1))
        byte = data.draw(st.integers(0, 255))
        return _reseal(body[:at] + bytes([byte]) + body[at + 1:])
    raise AssertionError(kind)


def _other_model_file(folder) -> Path:
    other = jg.Optimizer(_model, optax.sgd(0.1), loss="cross_entropy", period=2)
    other.save(other.init(_P, _X, _Y), folder / "other.jgs")
    return folder / "other.jgs"


@examples(40)
@given(st.sampled_from(["truncate", "flip", "insert", "version", "edit_header", "other_model"]),
       st.data())
def test_corrupt_state_files_raise_and_leave_the_state_alone(kind, data):
    opt, folder, blob = _saved()
    path = folder / "bad.jgs"
    if kind == "other_model":
        path = _other_model_file(folder)
    else:
        path.write_bytes(_corrupt(kind, data, blob))
    ds = jg.Dataset(np.arange(12))
    before, order = jax.tree.map(np.array, opt.latest_state), ds.permutation.copy()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = opt.load(path, dataset=ds)
    except StateFileError as e:
        assert str(e)
        assert_bitwise(opt.latest_state, before)
        np.testing.assert_array_equal(ds.permutation, order)
        return
    relabelled = kind == "version" and struct.unpack_from("<I", path.read_bytes(),
                                                          len(MAGIC))[0] == 2  # the old version
    assert kind == "edit_header" or relabelled, "a corrupt file loaded"
    assert relabelled == any(issubclass(w.category, StateFileWarning) for w in caught)
    assert_bitwise(loaded, before)  # an edit that changed nothing that matters (whitespace, ...)
