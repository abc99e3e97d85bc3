"""Bad options to `jg.testing`: each a `TestingOptionError` naming the option (issue 19, 4 and 8).

`graphs()`/`programs()`/`recipes()` check every option when the strategy is made, before
hypothesis draws anything: an unknown family in `exclude=` used to exclude nothing, an integer
`dtype` drew integer "floats", `min_steps > max_steps` drew `max_steps`. `check_grads` names a bad
`order`, `eps`, `rtol`, `atol`, `seed`, `fn` or `args` (and honours `rtol=0`, which it used to
replace by its default).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import jgraph as jg
from jgraph.testing import FAMILIES, TestingOptionError

KNOWN = r"known: \['add', 'argmax'"
STRATEGY_PROBES = [  # (options, message pattern)
    (dict(exclude=("nope",)), r"exclude names unknown op families \['nope'\]; " + KNOWN),
    (dict(exclude="scan"), r"exclude must be a tuple of op family names, got 'scan' \(write "
                           r"\('scan',\)\)"),
    (dict(families=("tanh", "x")), r"families names unknown op families \['x'\]"),
    (dict(families=()), r"no op family is left to draw from"),
    (dict(families=("scan",), loops=False), r"no op family is left .*loops=False"),
    (dict(families=("tanh",), exclude=("tanh",)), r"no op family is left"),
    (dict(dtype=jnp.int32), r"dtype must be a floating dtype, one of \['float16', 'bfloat16', "
                            r"'float32', 'float64'\] .* got int32"),
    (dict(dtype=bool), r"dtype must be a floating dtype.* got bool"),
    (dict(dtype=jnp.complex64), r"got complex64"),
    (dict(dtype="foo"), r"dtype must be a floating dtype.* got 'foo'"),
    (dict(min_steps=5, max_steps=2), r"min_steps=5 is more than max_steps=2"),
    (dict(min_steps=-1), r"min_steps must be in \[0, 1000\], got -1"),
    (dict(max_steps=-3), r"max_steps must be in \[0, 1000\], got -3"),
    (dict(max_steps=2.5), r"max_steps must be an int, got 2.5"),
    (dict(max_steps=True), r"max_steps must be an int, got True"),
    (dict(ranks=(-1, 2)), r"ranks\[0\] must be in \[0, 4\], got -1"),
    (dict(ranks=(0, 9)), r"ranks\[1\] must be in \[0, 4\], got 9"),
    (dict(ranks=(3, 1)), r"ranks=\(3, 1\) is reversed"),
    (dict(dims=(0, 2)), r"dims\[0\] must be in \[1, 48\], got 0"),
    (dict(dims=3), r"dims must be a pair \(lo, hi\) of ints in \[1, 48\], got 3"),
    (dict(dims=(1, 2, 3)), r"dims must be a pair"),
    (dict(regions="yes"), r"regions must be True or False, got 'yes'"),
    (dict(loops=1), r"loops must be True or False, got 1"),
    (dict(max_step=3), r"unknown options \['max_step'\]; the options are \['dtype', "),
]


def outcome(call, pattern) -> str:
    try:
        call()
    except TestingOptionError as e:
        return "clear" if re.search(pattern, str(e)) else f"unclear: {e}"
    except Exception as e:  # noqa: BLE001 - classifying is the point
        return f"raw: {type(e).__name__}: {e}"
    return "silent"


def test_strategy_options_are_checked_before_anything_is_drawn():
    outcomes = {}
    for options, pattern in STRATEGY_PROBES:
        for name in ("graphs", "programs", "recipes"):
            make = getattr(jg.testing, name)
            outcomes[f"{name}({options})"] = outcome(lambda: make(**options), pattern)
    tally = {k: sum(o.split(":")[0] == k for o in outcomes.values())
             for k in ("clear", "unclear", "raw", "silent")}
    print(f"\njg.testing options: {len(outcomes)} probes, {tally}")
    bad = {k: o for k, o in outcomes.items() if o != "clear"}
    assert not bad, bad
    assert issubclass(TestingOptionError, ValueError) and issubclass(TestingOptionError,
                                                                     TypeError)


def test_float64_needs_x64_when_drawing():
    strategy = jg.testing.graphs(dtype=jnp.float64)  # made outside x64, as at import: fine

    @settings(max_examples=1, deadline=None, database=None)
    @given(strategy)
    def draw(drawn):
        assert any(v.aval.dtype == np.float64 for v in drawn[0].inputs)

    with pytest.raises(TestingOptionError, match=r"dtype float64 needs `jax.enable_x64\(True\)`"):
        draw()
    with jax.enable_x64(True):
        draw()


def test_good_options_are_honoured():
    """The options that are accepted do what they say (a check of the checks' bounds)."""
    drawn = []

    @settings(max_examples=8, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(jg.testing.recipes(dtype="bfloat16", min_steps=2, max_steps=2, ranks=(1, 1),
                              dims=(2, 2), families=("tanh", "add", "scan"), exclude=("scan",),
                              regions=False, loops=True))
    def draw(recipe):
        drawn.append(recipe)

    draw()
    assert drawn
    for recipe in drawn:
        assert recipe.dtype == "bfloat16" and len(recipe.steps) == 2 and not recipe.spans
        assert {s.family for s in recipe.steps} <= {"tanh", "add"}
        assert all(slot.shape == (2,) for slot in recipe.slots[:len(jax.tree.leaves(
            recipe.arguments))])
    assert "tanh" in FAMILIES


def sin_sum(x):
    return jnp.sum(jnp.sin(x))


X = np.linspace(0.0, 1.0, 3)
GRAD_PROBES = [  # (fn, args, options, message pattern)
    (sin_sum, (X,), dict(order=1.5), r"check_grads: order must be an int, got 1.5"),
    (sin_sum, (X,), dict(order=0), r"order must be in \[1, 8\], got 0"),
    (sin_sum, (X,), dict(order=True), r"order must be an int, got True"),
    (sin_sum, (X,), dict(order="2"), r"order must be an int, got '2'"),
    (sin_sum, (X,), dict(eps=0.0), r"eps must be a finite number > 0, got 0.0"),
    (sin_sum, (X,), dict(eps=-1e-3), r"eps must be a finite number > 0"),
    (sin_sum, (X,), dict(eps=float("nan")), r"eps must be a finite number > 0, got nan"),
    (sin_sum, (X,), dict(rtol=-1.0), r"rtol must be a finite number >= 0, got -1.0"),
    (sin_sum, (X,), dict(atol="x"), r"atol must be a finite number >= 0, got 'x'"),
    (sin_sum, (X,), dict(seed=1.5), r"seed must be an int, got 1.5"),
    (sin_sum, (X,), dict(seed=-1), r"seed must be in \[0, "),
    (3, (X,), {}, r"fn must be callable, got int"),
    (sin_sum, X, {}, r"args must be the tuple of fn's arguments, got ndarray \(for one "
                     r"argument x, write \(x,\)\)"),
    (sin_sum, {"x": X}, {}, r"args must be the tuple .* got dict"),
]


def test_check_grads_names_its_bad_arguments():
    outcomes = {f"{getattr(fn, '__name__', fn)}, {type(args).__name__}, {opts}":
                outcome(lambda: jg.testing.check_grads(fn, args, **opts), pattern)
                for fn, args, opts, pattern in GRAD_PROBES}
    bad = {k: o for k, o in outcomes.items() if o != "clear"}
    assert not bad, bad


def test_check_grads_honours_zero_tolerances():
    jg.testing.check_grads(lambda x: jnp.sum(x * 3.0), (X,), rtol=0.0, atol=1e-6)  # linear: exact
    with pytest.raises(AssertionError, match=r"rtol=0.0, atol=0.0"):  # FD has rounding error
        jg.testing.check_grads(sin_sum, (X,), rtol=0.0, atol=0.0)
