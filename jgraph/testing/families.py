"""Op families for random graphs: each a JAX function and a way to draw its operands and params.

A `Family` has
- `apply(*arrays, **static)`: a JAX function of the operand arrays (the built graph holds its
  eqns, and a drawn program calls it as is);
- `draw(chooser, slots) -> Proposal | None`: picks operand slots among the values drawn so far
  (`slots`, see `jgraph.testing.recipe.Slot`) and static keyword arguments (hashable), and bounds
  |output| given the operands' bounds; None when nothing drawn so far fits;
- `group`: what kind of op it is; a strategy draws a group, then a family of the group, so that
  every group is drawn about as often however many families it has. The groups, in the order
  shrinking prefers: GROUPS. Group "loop" (structured control flow) is drawn unless asked not to
  (`graphs(loops=False)`).

The families live by group in `family_math` (elementwise, custom derivatives, binaries,
contraction, reductions, constants), `family_shapes` (shapes and indexing), `family_integer`
(integer and boolean side computations) and `family_loops` (scan, fori_loop, cond/switch,
while_loop), which import this registry and are imported by the package (`jgraph.testing`).
Each is registered right after its definition; a user's
own family, registered the same way, is drawn by `jg.testing.graphs()` and `programs()` like
these. Values
are kept small (at most MAX_SIZE elements, rank MAX_RANK) and bounded (|value| <= LIMIT), so that
the computations stay finite and finite differences stay accurate.

A loop family is an `apply` that calls `lax.scan`, `lax.fori_loop`, `lax.while_loop` or
`lax.cond` on a small body, and a `draw` that picks the carry and the operands the body closes
over (see `family_loops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jgraph.testing.recipe import FLOAT, Chooser, Slot

LIMIT = 1e3  # bound on |value| of every drawn float value
MAX_SIZE = 48  # elements of any drawn value
MAX_RANK = 4
LITERALS = (2.0, -0.5, 3.0)  # Python scalars drawn as weakly typed literals


@dataclass(frozen=True)
class Proposal:
    operands: tuple[int, ...]  # slots read
    static: dict  # keyword arguments of `apply`
    bound: float  # bound on |output|


@dataclass(frozen=True)
class Family:
    name: str
    apply: Callable  # (*arrays, **static) -> array or tuple of arrays
    draw: Callable[[Chooser, tuple[Slot, ...]], Proposal | None]
    group: str  # one of GROUPS


GROUPS = ("elementwise", "binary", "contraction", "reduction", "shape", "indexing", "integer",
          "custom", "constant", "loop")
FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family` to the families the strategies draw (a family of the same name is replaced)."""
    if family.group not in GROUPS:
        raise ValueError(f"unknown op family group {family.group!r}; known: {GROUPS}")
    FAMILIES[family.name] = family
    return family


# -- helpers for drawing ---------------------------------------------------------------------------
def pick(c: Chooser, slots, ok: Callable[[Slot], bool]) -> int | None:
    """A slot satisfying `ok`, or None; the latest are tried first (deeper graphs, and
    shrinking towards the value just computed)."""
    found = [k for k, s in reversed(list(enumerate(slots))) if ok(s)]
    return c.choice(found) if found else None


def is_float(s: Slot) -> bool:
    return s.kind == FLOAT


def broadcast(a: tuple, b: tuple) -> tuple | None:
    """numpy's broadcast of two shapes, or None."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b, strict=True)):
        return None
    return tuple(max(x, y) for x, y in zip(a, b, strict=True))


def broadcasts(a: tuple, b: tuple) -> bool:
    return broadcast(a, b) is not None


def unary(bound: Callable[[float], float], ok: Callable[[float], bool] = lambda b: True,
          kind: str = FLOAT):
    """Draw for a one-operand family on values of `kind` whose bound satisfies `ok`."""
    def draw(c, slots):
        x = pick(c, slots, lambda s: s.kind == kind and ok(s.bound))
        return None if x is None else Proposal((x,), {}, bound(slots[x].bound))

    return draw


def binary(bound: Callable[[float, float], float], kind: str = FLOAT):
    """Draw for a broadcasting two-operand family on values of `kind`."""
    def draw(c, slots):
        x = pick(c, slots, lambda s: s.kind == kind)
        if x is None:
            return None
        y = pick(c, slots, lambda s: s.kind == kind and broadcasts(s.shape, slots[x].shape))
        b = bound(slots[x].bound, slots[y].bound)
        return None if b > LIMIT else Proposal((x, y), {}, b)

    return draw


def with_literal(bound: Callable[[float, float], float]):
    """Draw for `fn(x, c)` with `c` a Python float (a weakly typed literal)."""
    def draw(c, slots):
        x = pick(c, slots, is_float)
        if x is None:
            return None
        lit = c.choice(LITERALS)
        b = bound(slots[x].bound, abs(lit))
        return None if b > LIMIT else Proposal((x,), {"c": lit}, b)

    return draw


def axis_of(c: Chooser, s: Slot) -> int:
    return c.integer(0, len(s.shape) - 1)


def ranked(kind=None, min_rank=1):
    return lambda s: len(s.shape) >= min_rank and (kind is None or s.kind == kind)


def named(x, *, name):
    """`checkpoint_name(x, name)`: how a step's output gets its name."""
    return checkpoint_name(x, name)


def loss_of(*xs):
    """The drawn loss: the sum of the sums of `xs`."""
    total = jnp.sum(xs[0])
    for x in xs[1:]:
        total = total + jnp.sum(x)
    return total

