"""The options of `graphs()` / `programs()` / `recipes()`, checked: a clear error, never a draw.

hypothesis draws lazily, so a nonsense option (an unknown family in `exclude=`, an integer
`dtype`, `min_steps > max_steps`) would otherwise surface later as a raw error inside a test, or
never (an excluded family that does not exist excludes nothing). Each check raises
`TestingOptionError` naming the option, what it got and what is allowed.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from jgraph.errors import JGraphError
from jgraph.testing.families import FAMILIES, MAX_RANK, MAX_SIZE

OPTIONS = ("dtype", "min_steps", "max_steps", "ranks", "dims", "families", "exclude", "regions",
           "names", "aux", "integers", "loops")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
MAX_STEPS = 1000  # a recipe's steps are drawn one by one: more is a hang, not a test


class TestingOptionError(JGraphError, ValueError, TypeError):
    """An option of `jg.testing.graphs()`/`programs()`/`check_grads` is of the wrong type or out
    of range."""

    __test__ = False  # not a test class, whatever pytest thinks of the name


def known_options(options: dict, what: str) -> None:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TestingOptionError(f"{what}: unknown options {unknown}; the options are "
                                 f"{list(OPTIONS)}")


def float_dtype(dtype, drawing: bool = True) -> str | None:
    """The recipe's floating dtype by name: the default, or one of `FLOAT_DTYPES`. The default
    and the x64 requirement of float64 depend on JAX's setting when drawing (`drawing`), not
    when the strategy is made (often at import, outside the `jax.enable_x64` of the test)."""
    if dtype is None:
        if not drawing:
            return None
        return "float64" if jax.config.jax_enable_x64 else "float32"
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in FLOAT_DTYPES:
        raise TestingOptionError(f"jg.testing: dtype must be a floating dtype, one of "
                                 f"{list(FLOAT_DTYPES)} (or None: float64 under x64, else "
                                 f"float32), got {name or repr(dtype)}")
    if drawing and name == "float64" and not jax.config.jax_enable_x64:
        raise TestingOptionError("jg.testing: dtype float64 needs `jax.enable_x64(True)` (JAX "
                                 "would make every value float32)")
    return name


def count(value, name: str, low: int, high: int) -> int:
    """`value` as an int in [low, high]; `name` is prefixed by "jg.testing: " unless it names
    its function already."""
    where = name if ":" in name else f"jg.testing: {name}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TestingOptionError(f"{where} must be an int, got {value!r}")
    if not low <= value <= high:
        raise TestingOptionError(f"{where} must be in [{low}, {high}], got {value}")
    return int(value)


def steps(min_steps, max_steps) -> tuple[int, int]:
    low = count(min_steps, "min_steps", 0, MAX_STEPS)
    high = count(max_steps, "max_steps", 0, MAX_STEPS)
    if low > high:
        raise TestingOptionError(f"jg.testing: min_steps={low} is more than max_steps={high}")
    return low, high


def bounds(value, name: str, low: int, high: int) -> tuple[int, int]:
    """A `(lo, hi)` pair of ints with low <= lo <= hi <= high."""
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise TestingOptionError(f"jg.testing: {name} must be a pair (lo, hi) of ints in "
                                 f"[{low}, {high}], got {value!r}")
    lo = count(value[0], f"{name}[0]", low, high)
    hi = count(value[1], f"{name}[1]", low, high)
    if lo > hi:
        raise TestingOptionError(f"jg.testing: {name}=({lo}, {hi}) is reversed (lo > hi)")
    return lo, hi


def flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TestingOptionError(f"jg.testing: {name} must be True or False, got {value!r}")
    return value


def _names(value, name: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, tuple | list | set | frozenset):
        hint = f" (write ({value!r},))" if isinstance(value, str) else ""
        raise TestingOptionError(f"jg.testing: {name} must be a tuple of op family names, got "
                                 f"{value!r}{hint}")
    unknown = [n for n in value if n not in FAMILIES]
    if unknown:
        raise TestingOptionError(f"jg.testing: {name} names unknown op families {unknown}; "
                                 f"known: {sorted(FAMILIES)}")
    return tuple(value)


def families(families, exclude, loops: bool, integers: bool) -> tuple[str, ...]:
    """The families to draw from; an error if a name is unknown or none is left."""
    names = tuple(FAMILIES) if families is None else _names(families, "families")
    excluded = set(_names(exclude, "exclude"))
    chosen = tuple(n for n in names if n not in excluded
                   and (loops or FAMILIES[n].group != "loop")
                   and (integers or FAMILIES[n].group != "integer"))
    if not chosen:
        raise TestingOptionError(f"jg.testing: no op family is left to draw from (families="
                                 f"{families!r}, exclude={exclude!r}, loops={loops}, "
                                 f"integers={integers})")
    return chosen


def shapes(ranks, dims) -> tuple[tuple[int, int], tuple[int, int]]:
    return bounds(ranks, "ranks", 0, MAX_RANK), bounds(dims, "dims", 1, MAX_SIZE)
