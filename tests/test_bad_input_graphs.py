"""Hand-built malformed graphs and bad call arguments: a `jgraph` error naming the field.

Issue 19, item 7: users who write passes build graphs by hand. A graph whose fields do not have
the IR's types (an input that is not a `Var`, `inputs=None`, an eqn that is not an `Eqn`, params
that are not a mapping, not a Graph at all) gets a `GraphError` naming the field from `jg.check`,
`jg.evaluate`, `jg.compile`, `jg.backward` and the other transforms, never a raw
`AttributeError`/`TypeError` from inside them; `str` prints it, naming the field on its first
line and marking each bad value. An eqn declaring another aval than its op computes is a
`GraphError` from `jg.evaluate` and `jg.compile` too, not a value. Also `jg.evaluate`'s argument
checks.
"""

import dataclasses
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgraph as jg
from jgraph.ir import Eqn, Literal, Var, literal

X = jnp.linspace(-1.0, 1.0, 3)


def traced():
    return jg.trace(lambda p, x: jnp.sum(jnp.tanh(x * p)), X, X, param_argnums=0)


def with_eqn0(g, **changes):
    return g.replace(eqns=(dataclasses.replace(g.eqns[0], **changes),) + g.eqns[1:])


def scan_with_body(g, **changes):
    """A graph whose scan body has `changes` (a malformed sub-graph)."""
    outer = jg.trace(lambda p, x: jnp.sum(jax.lax.scan(lambda c, _: (jnp.sin(c * p), None), x,
                                                       None, length=2)[0]), X, X,
                     param_argnums=0)
    i = next(i for i, e in enumerate(outer.eqns) if e.op == "scan")
    scan = outer.eqns[i]
    body = scan.params["body"].replace(**changes)
    new = dataclasses.replace(scan, params={**scan.params, "body": body})
    return outer.replace(eqns=outer.eqns[:i] + (new,) + outer.eqns[i + 1:])


# (what, make the graph from a good one, the field the message must name)
MALFORMED = [
    ("not a Graph", lambda g: {"inputs": g.inputs}, r"Graph \(from jg.trace\), got dict"),
    ("inputs None", lambda g: g.replace(inputs=None), r"`inputs` must be a tuple, got NoneType"),
    ("inputs a list", lambda g: g.replace(inputs=list(g.inputs)), r"`inputs` must be a tuple"),
    ("an input a str", lambda g: g.replace(inputs=("x",) + g.inputs[1:]),
     r"`inputs\[0\]` must be a Var, got str 'x'"),
    ("an input a Literal", lambda g: g.replace(inputs=(literal(1.0),) + g.inputs[1:]),
     r"`inputs\[0\]` must be a Var, got Literal"),
    ("an input's aval None", lambda g: g.replace(inputs=(Var(None),) + g.inputs[1:]),
     r"`inputs\[0\].aval` must be an abstract value"),
    ("an input's aval a ShapeDtypeStruct",
     lambda g: g.replace(inputs=(Var(jax.ShapeDtypeStruct((3,), jnp.float32)),) + g.inputs[1:]),
     r"`inputs\[0\].aval` must be an abstract value"),
    ("an output an int", lambda g: g.replace(outputs=(3,)),
     r"`outputs\[0\]` must be a Var or Literal, got int 3"),
    ("outputs None", lambda g: g.replace(outputs=None), r"`outputs` must be a tuple"),
    ("a literal output without aval", lambda g: g.replace(outputs=(Literal(1.0, None),)),
     r"`outputs\[0\].aval`"),
    ("eqns None", lambda g: g.replace(eqns=None), r"`eqns` must be a tuple"),
    ("an eqn a tuple", lambda g: g.replace(eqns=(("mul",),) + g.eqns[1:]),
     r"`eqns\[0\]` must be an Eqn, got tuple"),
    ("params None", lambda g: with_eqn0(g, params=None),
     r"`eqns\[0\].params` \(mul\) must be a mapping, got NoneType"),
    ("params a list", lambda g: with_eqn0(g, params=[("a", 1)]), r"`eqns\[0\].params`"),
    ("op an int", lambda g: with_eqn0(g, op=7), r"`eqns\[0\].op` must be a str, got int 7"),
    ("eqn inputs None", lambda g: with_eqn0(g, inputs=None), r"`eqns\[0\].inputs` \(mul\)"),
    ("an eqn input None", lambda g: with_eqn0(g, inputs=(None,) + g.eqns[0].inputs[1:]),
     r"`eqns\[0\].inputs\[0\]` must be a Var or Literal, got NoneType"),
    ("an eqn output a Literal", lambda g: with_eqn0(g, outputs=(literal(1.0),)),
     r"`eqns\[0\].outputs\[0\]` must be a Var, got Literal"),
    ("tags a list", lambda g: with_eqn0(g, tags=["backward"]), r"`eqns\[0\].tags` \(mul\)"),
    ("a region id a list", lambda g: with_eqn0(g, regions=([0],)),
     r"`eqns\[0\].regions\[0\]` \(mul\) must be a region id"),
    ("roles None", lambda g: g.replace(input_roles=None), r"`input_roles` must be a tuple"),
    ("a role an int", lambda g: g.replace(output_roles=(1,)), r"`output_roles\[0\]` must be a str"),
    ("regions a list", lambda g: g.replace(regions=[]), r"`regions` must be a tuple"),
    ("a region an int", lambda g: g.replace(regions=(1,)), r"`regions\[0\]` must be a Region"),
    ("in_tree a str", lambda g: g.replace(in_tree="x"), r"`in_tree` must be a PyTreeDef"),
    ("info None", lambda g: g.replace(info=None), r"`info` must be a mapping"),
    ("param_argnums a str", lambda g: g.replace(param_argnums="0"),
     r"`param_argnums` must be None, an argument index .* got str '0'"),
    ("param_argnums out of range", lambda g: g.replace(param_argnums=(0, 5)),
     r"`param_argnums` .*\[-2, 2\)"),
    ("a scan body's inputs None", lambda g: scan_with_body(g, inputs=None),
     r"`inputs` must be a tuple"),
    ("a scan body's eqn not an Eqn", lambda g: scan_with_body(g, eqns=(1,)),
     r"`eqns\[0\]` must be an Eqn"),
]

ENTRY_POINTS = [
    ("jg.check", jg.check),
    ("jg.evaluate", lambda g: jg.evaluate(g, X, X)),
    ("jg.compile", lambda g: jg.compile(g)(X, X)),
    ("jg.backward", jg.backward),
    ("jg.remat", jg.remat),
    ("jg.to_jax", jg.to_jax),
    ("jg.memory", jg.memory),
    ("jg.accumulate", lambda g: jg.accumulate(g, period=2)),
]


def outcome(call, pattern) -> str:
    try:
        call()
    except jg.GraphError as e:
        return "clear" if re.search(pattern, str(e)) else f"unclear: {e}"
    except Exception as e:  # noqa: BLE001 - classifying is the point
        return f"raw: {type(e).__name__}: {e}"
    return "silent"


def test_malformed_graphs_get_a_graph_error_naming_the_field():
    good = traced()
    outcomes = {}
    for what, make, pattern in MALFORMED:
        for name, entry in ENTRY_POINTS:
            outcomes[f"{name}({what})"] = outcome(lambda: entry(make(good)), pattern)
    tally = {k: sum(o.split(":")[0] == k for o in outcomes.values())
             for k in ("clear", "unclear", "raw", "silent")}
    print(f"\nmalformed graphs: {len(outcomes)} probes, {tally}")
    bad = {k: o for k, o in outcomes.items() if o != "clear"}
    assert not bad, bad


def test_malformed_graphs_print_naming_the_field_and_marking_bad_values():
    good = traced()
    for what, make, pattern in MALFORMED:
        if what == "not a Graph":
            continue  # str() of any other object is its own business
        text = str(make(good))
        first, *rest = text.splitlines()
        assert first.startswith("# malformed graph (jg.check raises): graph field"), (what, text)
        assert re.search(pattern, first), (what, first)
        assert rest[0].startswith("{ lambda ") and rest[-1].endswith(" ) }"), (what, text)
    text = str(with_eqn0(good, inputs=(None,) + good.eqns[0].inputs[1:]))
    assert "= mul <bad NoneType None> " in text  # the bad value where it stands, the rest named
    assert "tanh" in text and "@loss" in text


def _with_mul_output(g, aval):
    """`g` whose first `mul` declares `aval` for its output (the same Var, read as before)."""
    i = next(i for i, e in enumerate(g.eqns) if e.op == "mul")
    old, new = g.eqns[i].outputs[0], Var(aval)
    eqns = [dataclasses.replace(e, inputs=tuple(new if a is old else a for a in e.inputs))
            for e in g.eqns]
    eqns[i] = dataclasses.replace(eqns[i], outputs=(new,))
    return g.replace(eqns=tuple(eqns))


@pytest.mark.parametrize("aval", [jax.core.ShapedArray((4,), jnp.float32),
                                  jax.core.ShapedArray((3,), jnp.int32),
                                  jax.core.ShapedArray((3,), jnp.float16)], ids=str)
@pytest.mark.parametrize("entry", ["evaluate", "compile", "backward"])
@pytest.mark.parametrize("full_check", [False, True], ids=["default", "JGRAPH_CHECK_GRAPHS"])
def test_an_eqn_declaring_another_aval_than_its_op_computes_is_refused(aval, entry, full_check,
                                                                       monkeypatch):
    monkeypatch.setattr(jg.config, "check_graphs", full_check)  # users' default: off
    g = _with_mul_output(traced(), aval)
    with pytest.raises(jg.GraphError, match="shape rule of 'mul' gives f32\\[3\\]"):
        jg.check(g)
    run = {"evaluate": lambda: jg.evaluate(g, X, X), "compile": lambda: jg.compile(g)(X, X),
           "backward": lambda: jg.evaluate(jg.backward(g), X, X)}[entry]
    said = (r"shape rule of 'mul' gives f32\[3\]" if full_check else
            r"output 0 of the eqn is declared .*, but op 'mul' computes f32\[3\]")
    with pytest.raises(jg.GraphError, match=said):
        run()


def test_a_well_formed_graph_still_prints_and_checks():
    g = traced()
    assert jg.check(g) is g
    assert str(g).startswith("{ lambda a:f32[3]@param b:f32[3]@data .")
    nested = scan_with_body(g)  # unchanged body: still fine
    jg.check(nested)
    assert "scan[" in str(nested)


def test_the_field_check_keeps_check_cheap():
    """The field pass costs a fraction of the structural check it precedes (it runs on every
    graph every transform is given): measured as a ratio in this process, never a time."""
    from jgraph.ir import check_fields

    def f(p, x):
        for w in p:
            x = jnp.tanh(x @ w + 1.0)
        return jnp.mean(x)

    gb = jg.backward(jg.trace(f, [jnp.eye(8)] * 60, jnp.ones((2, 8)), param_argnums=0))

    fields = structure = float("inf")
    for _ in range(15):  # interleaved, the best of each: what a busy machine leaves alone
        start = time.perf_counter()
        check_fields(gb)
        middle = time.perf_counter()
        jg.check(gb, shapes=False)
        fields, structure = (min(fields, middle - start),
                             min(structure, time.perf_counter() - middle))
    assert fields < 0.6 * structure, (fields, structure)


# -- evaluate's arguments -------------------------------------------------------------------------
ARGS = [  # (what, args for f(p={"a": f32[3]}, x=f32[3]), message pattern)
    ("a str leaf", ({"a": "abc"}, X), r"args\[0\]\['a'\] is a str \('abc'\), not an array"),
    ("an object leaf", ({"a": object()}, X), r"args\[0\]\['a'\] is a object .*not an array"),
    ("None leaf", ({"a": None}, X), r"do not match the traced signature"),
    ("a missing argument", ({"a": X},), r"missing    args\[1\]"),
    ("another shape", ({"a": jnp.ones(4)}, X), r"args\[0\]\['a'\] is f32\[4\] but the traced"),
    ("a Python scalar for an array", ({"a": 1.0}, X), r"weakly typed: a Python scalar"),
]
INT_ARGS = [  # (what, n for g(p=f32[3], n=i32[]), message pattern)
    ("a Python float for an int", 2.5, r"Python float 2.5 .* i32\[\]"),
    ("a Python bool for an int", True, r"Python bool True .* i32\[\] there \(no silent"),
    ("an int out of range", 2**40, r"out of the range of i32\[\]"),
    ("a str for an int", "3", r"args\[1\] is a str \('3'\), not an array"),
]


def test_evaluate_names_bad_arguments():
    g = jg.trace(lambda p, x: jnp.sum(jnp.tanh(x * p["a"])), {"a": X}, X, param_argnums=0)
    gi = jg.trace(lambda p, n: jnp.sum(p * n), X, 2, param_argnums=0)
    outcomes = {what: outcome_any(lambda: jg.evaluate(g, *args), pattern)
                for what, args, pattern in ARGS}
    outcomes |= {what: outcome_any(lambda: jg.evaluate(gi, X, n), pattern)
                 for what, n, pattern in INT_ARGS}
    bad = {k: o for k, o in outcomes.items() if o != "clear"}
    assert not bad, bad
    np.testing.assert_allclose(jg.evaluate(gi, X, 3), jnp.sum(X * 3))  # a fitting int works


def outcome_any(call, pattern) -> str:
    try:
        call()
    except jg.JGraphError as e:
        return "clear" if re.search(pattern, str(e)) else f"unclear: {e}"
    except Exception as e:  # noqa: BLE001
        return f"raw: {type(e).__name__}: {e}"
    return "silent"


def test_an_eqn_given_where_a_graph_is_expected():
    eqn = traced().eqns[0]
    assert isinstance(eqn, Eqn)
    with pytest.raises(jg.GraphError, match="takes a jgraph Graph .* got Eqn"):
        jg.backward(eqn)
