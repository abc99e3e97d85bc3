"""The IR: golden strings of `str(graph)`, and `check` rejecting hand-corrupted graphs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jgraph as jg
from jgraph.builder import Builder
from jgraph.ir import Graph, Literal, Var, literal

f32 = jnp.float32


def layer(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]))


P = {"w": jnp.ones((3, 2), f32), "b": jnp.zeros((2,), f32)}
X = jnp.ones((4, 3), f32)


def layer_graph():
    return jg.trace(layer, P, X, param_argnums=0)


# -- golden strings -------------------------------------------------------------------------------
LAYER = """\
{ lambda a:f32[2]@param b:f32[3,2]@param c:f32[4,3]@data .
  let d:f32[4,2] = dot_general[contract=[1]x[0]] c b
      e:f32[1,2] = broadcast_in_dim[dims=(1,)] a
      f:f32[4,2] = add d e
      g:f32[4,2] = tanh f
      h:f32[] = reduce_sum[axes=(0, 1)] g
  in ( h@loss ) }"""


def aux(w, x, labels):
    logits = x @ w
    return jnp.mean(logits**2) * 0.5, jax.lax.argmax(logits, 1, jnp.int32) == labels


AUX = """\
{ lambda a:f32[3,2]@param b:f32[4,3]@data c:i32[4]@data .
  let d:f32[4,2] = dot_general[contract=[1]x[0]] b a
      e:f32[4,2] = integer_pow[y=2] d
      f:f32[] = reduce_sum[axes=(0, 1)] e
      g:f32[] = div f 8.0:f32[]
      h:f32[] = mul g 0.5:f32[]
      i:i32[4] = argmax[axes=(1,) index_dtype=int32] d
      j:bool[4] = eq i c
  in ( h@loss j@aux ) }"""


def inner(x):
    return jnp.sin(x) * 2.0


def outer(x):
    return checkpoint_name(jax.checkpoint(inner)(x), "h") + 1.0


def regions(x):
    y = jax.checkpoint(outer, policy=jax.checkpoint_policies.save_only_these_names("h"))(x)
    return jnp.sum(jax.checkpoint(jnp.cos, prevent_cse=False)(y))


REGIONS = """\
{ lambda a:f32[2]@data .
  let b:f32[2] = sin a            # region 0/1
      c:f32[2] = mul b 2.0:f32[]  # region 0/1
      d:f32[2] = name[name=h] c   # region 0
      e:f32[2] = add d 1.0:f32[]  # region 0
      f:f32[2] = cos e            # region 2
      g:f32[] = reduce_sum[axes=(0,)] f
  in ( g@loss ) }
# region 0: checkpoint(outer, policy=SaveOnlyTheseNames(saveable_names=frozenset({'h'})))
# region 1: checkpoint(inner) in region 0
# region 2: checkpoint(cos, prevent_cse=False)"""


def bmm(q, k):
    return jnp.sum(jnp.einsum("bqd,bkd->bqk", q, k))


BMM = """\
{ lambda a:f32[2,3,4]@data b:f32[2,5,4]@data .
  let c:f32[2,3,5] = dot_general[contract=[2]x[2] batch=[0]x[0]] a b
      d:f32[] = reduce_sum[axes=(0, 1, 2)] c
  in ( d@loss ) }"""


def conv_pool(w, x):
    y = jax.lax.conv_general_dilated(x, w, (2,), [(1, 1)], rhs_dilation=(2,),
                                     dimension_numbers=("NCH", "OIH", "NCH"))
    pooled = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 1, 2), (1, 1, 2),
                                   [(0, 0), (0, 0), (1, 0)])
    return jnp.sum(pooled)


CONV = """\
{ lambda a:f32[4,2,3]@data b:f32[1,2,8]@data .
  let c:f32[1,4,3] = conv_general_dilated[dims=NC0,OI0->NC0 window_strides=(2,) \
padding=((1, 1),) rhs_dilation=(2,)] b a
      d:f32[1,4,2] = reduce_window_max[window_dimensions=(1, 1, 2) window_strides=(1, 1, 2) \
padding=((0, 0), (0, 0), (1, 0))] c
      e:f32[] = reduce_sum[axes=(0, 1, 2)] d
  in ( e@loss ) }"""


GOLDEN = [
    ("layer", lambda: layer_graph(), LAYER),
    ("aux", lambda: jg.trace(aux, P["w"], X, jnp.zeros((4,), jnp.int32), param_argnums=0,
                             has_aux=True), AUX),
    ("regions", lambda: jg.trace(regions, jnp.ones((2,), f32)), REGIONS),
    ("batched_dot", lambda: jg.trace(bmm, jnp.ones((2, 3, 4), f32), jnp.ones((2, 5, 4), f32)), BMM),
    ("conv_pool", lambda: jg.trace(conv_pool, jnp.ones((4, 2, 3), f32), jnp.ones((1, 2, 8), f32)),
     CONV),
]


@pytest.mark.parametrize("make, golden", [g[1:] for g in GOLDEN], ids=[g[0] for g in GOLDEN])
def test_golden_string(make, golden):
    assert str(make()) == golden


def test_tags_print_as_comments():
    x = Var(jax.core.ShapedArray((3,), np.dtype("float32")))
    fwd = Builder()
    (y,) = fwd.call(jnp.sin, x)
    bwd = Builder(tags={"backward"})
    (z,) = bwd.call(jnp.cos, y)
    eqns = fwd.eqns + [dataclasses.replace(e, tags=frozenset({"recompute", "no_cse"}))
                       for e in fwd.eqns[:1]] + bwd.eqns
    # the recompute redefines its own output variable so the graph stays single-assignment
    recompute = dataclasses.replace(eqns[1], outputs=(Var(y.aval),))
    eqns[1] = recompute
    g = Graph((x,), tuple(eqns), (z, recompute.outputs[0]), ("data",), ("aux", "aux"))
    assert str(jg.check(g)) == """\
{ lambda a:f32[3]@data .
  let b:f32[3] = sin a
      c:f32[3] = sin a  # no_cse, recompute
      d:f32[3] = cos b  # backward
  in ( d@aux c@aux ) }"""


def test_literals_print_with_their_type():
    g = jg.trace(lambda x: jnp.sum(jnp.where(x > 0, x, 2) * np.arange(3.0, dtype=np.float32)),
                 jnp.ones((3,), f32))
    text = str(g)
    assert "gt a 0.0:f32[]" in text and "const:f32[3]" in text, text


# -- the IR's objects -----------------------------------------------------------------------------
def test_vars_are_identities_and_everything_is_frozen():
    aval = jax.core.ShapedArray((2,), np.dtype("float32"))
    a, b = Var(aval), Var(aval)
    assert a != b and a == a and len({a, b}) == 2
    g = layer_graph()
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.eqns = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.eqns[0].op = "add"
    shorter = g.replace(eqns=g.eqns[:-1], outputs=(g.eqns[-2].outputs[0],), output_roles=("aux",))
    assert len(g.eqns) == 5 and len(shorter.eqns) == 4 and g.output_roles == ("loss",)
    jg.check(shorter)


def test_literal_helper_types():
    assert literal(2.0).aval.weak_type and literal(2.0).aval.shape == ()
    lit = literal(np.arange(3, dtype=np.int32))
    assert lit.aval.dtype == np.int32 and lit.aval.shape == (3,) and not lit.aval.weak_type


def test_roles_by_name():
    g = layer_graph()
    assert [v.aval.shape for v in g.inputs_with_role("param")] == [(2,), (3, 2)]
    assert [v.aval.shape for v in g.inputs_with_role("data")] == [(4, 3)]
    assert g.outputs_with_role("loss") == [g.outputs[0]]


# -- check rejects corrupted graphs ---------------------------------------------------------------
def _substitute(graph: Graph, old: Var, new: Var) -> Graph:
    def sub(a):
        return new if a is old else a

    eqns = tuple(dataclasses.replace(e, inputs=tuple(map(sub, e.inputs)),
                                     outputs=tuple(map(sub, e.outputs))) for e in graph.eqns)
    return graph.replace(eqns=eqns, outputs=tuple(map(sub, graph.outputs)))


def _use_before_def(g):
    e = list(g.eqns)
    e[2], e[3] = e[3], e[2]  # tanh before the add that defines its input
    return g.replace(eqns=tuple(e))


def _wrong_aval(g):
    tanh_out = g.eqns[3].outputs[0]
    return _substitute(g, tanh_out, Var(jax.core.ShapedArray((4, 3), np.dtype("float32"))))


def _duplicate_definition(g):
    e = list(g.eqns)
    e[3] = dataclasses.replace(e[3], outputs=e[2].outputs)  # tanh redefines the add's output
    e[4] = dataclasses.replace(e[4], inputs=e[2].outputs)
    return g.replace(eqns=tuple(e))


def _redefined_input(_):
    g = jg.trace(lambda x: jnp.sum(jnp.sin(x)), X)
    sin = g.eqns[0]
    e = (dataclasses.replace(sin, outputs=g.inputs), dataclasses.replace(g.eqns[1],
                                                                       inputs=g.inputs))
    return g.replace(eqns=e)  # sin overwrites its own input


def _shape_rule_rejects(g):
    e = list(g.eqns)
    e[2] = dataclasses.replace(e[2], inputs=(e[2].inputs[0], g.inputs[2]))  # add f32[4,2] f32[4,3]
    return g.replace(eqns=tuple(e))


def _unknown_op(g):
    e = list(g.eqns)
    e[3] = dataclasses.replace(e[3], op="frobnicate")
    return g.replace(eqns=tuple(e))


def _bad_literal(g):
    e = list(g.eqns)
    wrong = Literal(np.float64(1.0), jax.core.ShapedArray((), np.dtype("float32")))
    e[2] = dataclasses.replace(e[2], inputs=(e[2].inputs[0], wrong))
    return g.replace(eqns=tuple(e))


def _unknown_region(g):
    e = list(g.eqns)
    e[3] = dataclasses.replace(e[3], regions=(7,))
    return g.replace(eqns=tuple(e))


CORRUPTIONS = [
    ("use_before_def", _use_before_def,
     r"eqn 2 `f:f32\[4,2\] = tanh g`.*: input 0 \(g\) is used before it is defined"),
    ("wrong_aval", _wrong_aval,
     r"eqn 3 `g:f32\[4,3\] = tanh f`.*: output 0 has aval f32\[4,3\] but the shape rule of "
     r"'tanh' gives f32\[4,2\]"),
    ("duplicate_definition", _duplicate_definition,
     r"eqn 3 `f:f32\[4,2\] = tanh f`.*: output 0 \(f\) is defined twice"),
    ("redefined_input", _redefined_input,
     r"eqn 0 `a:f32\[4,3\] = sin a`.*: output 0 \(a\) is defined twice"),
    ("shape_rule_rejects", _shape_rule_rejects,
     r"eqn 2 `f:f32\[4,2\] = add d c`.*: the shape rule of 'add' rejects its inputs"),
    ("unknown_op", _unknown_op, r"eqn 3 `g:f32\[4,2\] = frobnicate f`.*: unknown op 'frobnicate'"),
    ("bad_literal", _bad_literal,
     r"eqn 2 `f:f32\[4,2\] = add d 1.0:f32\[\]`.*: literal input 1 holds a float64\[\] value"),
    ("unknown_region", _unknown_region, r"eqn 3 `g:f32\[4,2\] = tanh f`.*: refers to unknown "
                                        r"checkpoint region 7"),
    ("dangling_output", lambda g: g.replace(outputs=(Var(g.outputs[0].aval),)),
     r"graph output 0 \(i@loss\) is dangling"),
    ("unknown_input_role", lambda g: g.replace(input_roles=("weights", "param", "data")),
     r"input 0 has unknown role 'weights'"),
    ("unknown_output_role", lambda g: g.replace(output_roles=("result",)),
     r"output 0 has unknown role 'result'"),
    ("non_scalar_loss", lambda g: g.replace(outputs=(g.eqns[3].outputs[0],)),
     r"output 0 has role 'loss' but is f32\[4,2\], not a floating scalar"),
    ("integer_loss", lambda g: g.replace(outputs=(Var(jax.core.ShapedArray((), np.int32)),)),
     r"output 0 has role 'loss' but is i32\[\]"),
    ("missing_roles", lambda g: g.replace(input_roles=("param",)), r"3 inputs but 1 input roles"),
    ("duplicate_input", lambda g: g.replace(inputs=(g.inputs[0], g.inputs[0], g.inputs[2]),
                                            in_tree=None),
     r"graph input 1 \(a\) appears twice"),
]


@pytest.mark.parametrize("corrupt, message", [c[1:] for c in CORRUPTIONS],
                         ids=[c[0] for c in CORRUPTIONS])
def test_check_rejects(corrupt, message):
    g = layer_graph()
    assert jg.check(g) is g
    with pytest.raises(jg.GraphError, match=message):
        jg.check(corrupt(g))


def test_check_names_the_source_line():
    g = _unknown_op(layer_graph())
    with pytest.raises(jg.GraphError, match=r"test_ir.py:\d+:\d+ \(layer\)"):
        jg.check(g)


def test_check_compares_every_grad_output_with_its_param():
    gb = jg.backward(layer_graph())
    jg.check(gb)
    k = gb.output_roles.index("grad")
    wrong = Var(jax.core.ShapedArray((1, 5), np.dtype("float32")))
    zero = Literal(np.float32(0), jax.core.ShapedArray((), np.float32))
    eqn = jg.Eqn("broadcast_in_dim", (zero,),
                 dict(shape=(1, 5), broadcast_dimensions=(), sharding=None), (wrong,))
    bad = gb.replace(eqns=gb.eqns + (eqn,),
                     outputs=gb.outputs[:k] + (wrong,) + gb.outputs[k + 1:])
    with pytest.raises(jg.GraphError, match=r"output \d+ \(grad 0\) is f32\[1,5\] but its param "
                                            r"input a is f32\[2\]"):
        jg.check(bad)


def test_region_lookup_of_an_unknown_id_is_a_graph_error():
    with pytest.raises(jg.GraphError, match="no checkpoint region 3"):
        layer_graph().region(3)


def test_a_sub_graph_shared_by_two_eqns_prints_as_two_copies_do():
    # The tracer can hand two while eqns the same cond Graph object (JAX traces a cond function
    # once). Printing named variables by object, so the second copy reused the first one's names
    # and equal graphs printed differently (found by the tracing property).
    def f(p):
        def more(s):
            return s[0] < 3

        def step(s):
            return s[0] + 1, jnp.cos(s[1])

        a = jax.lax.while_loop(more, step, (jnp.int32(0), p))[1]
        return jax.lax.while_loop(more, step, (jnp.int32(0), a))[1]

    g = jg.trace(f, np.float32(0.5))
    first, second = g.eqns
    assert first.params["cond_graph"] is not second.params["cond_graph"]
    shared = dataclasses.replace(second, params={**second.params, **{
        k: first.params[k] for k in ("cond_graph", "body")}})
    g_shared = jg.check(dataclasses.replace(g, eqns=(first, shared)))
    assert str(g_shared) == str(g)
    assert "cond_graph={ lambda m:i32[] n:f32[] ." in str(g_shared)
