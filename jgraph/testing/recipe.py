"""Recipes: the plain data a random graph or program is drawn as, before it is built.

A `Recipe` lists the call arguments (leaves are *slots* 0..n-1), the steps (each applies one op
family to earlier slots and defines new slots), checkpoint spans over the steps (nested, each with
a policy), which slots are summed into the loss and which are returned as aux, and the seed of the
example inputs. `jgraph.testing.build` turns it into a `Graph` (through `Builder`, no tracer) or
into a JAX function (for `jg.trace`); `str(recipe)` prints it as Python-like source, which is what
hypothesis shows for a shrunk counterexample.

A `Slot` records what the strategies need to keep drawing well-formed graphs: the shape, the kind
(`float`, `int`, `bool`) and a bound on |value| given arguments in [-1, 1] (ints in [0, 4)), which
keeps drawn computations finite and well conditioned for finite differences.

`Chooser` is the small random-choice interface op families draw with (a thin wrapper of a
hypothesis `draw`), so that families are plain functions a user can write without hypothesis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

FLOAT, INT, BOOL = "float", "int", "bool"
INT_HIGH = 4  # integer arguments are drawn in [0, INT_HIGH)
_KIND_LETTER = {FLOAT: "f", INT: "i", BOOL: "b"}


def dtype_of(float_dtype: str, kind: str) -> np.dtype:
    """The dtype of a value of `kind` in a recipe whose floats are `float_dtype`."""
    return np.dtype({FLOAT: float_dtype, INT: "int32", BOOL: "bool"}[kind])


@dataclass(frozen=True)
class Slot:
    shape: tuple[int, ...]  # the value's shape
    kind: str  # FLOAT, INT or BOOL
    bound: float  # |value| <= bound for arguments in [-1, 1] (ints in [0, INT_HIGH))
    weak: bool = False  # an argument passed as a Python float (weakly typed)

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __str__(self):
        if self.weak:
            return "float (a Python scalar)"
        return f"{_KIND_LETTER[self.kind]}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Step:
    family: str  # name of an op family in `jgraph.testing.families.FAMILIES`
    operands: tuple[int, ...]  # slots read
    static: tuple[tuple[str, Any], ...]  # the family's keyword arguments (hashable, sorted)
    outputs: tuple[int, ...]  # slots defined
    name: str | None = None  # `checkpoint_name` given to the first output (a float)

    def text(self) -> str:
        args = [f"v{j}" for j in self.operands] + [f"{k}={v!r}" for k, v in self.static]
        call = f"{self.family}({', '.join(args)})"
        if self.name is not None:
            call = f"checkpoint_name({call}, {self.name!r})"
        return f"{', '.join(f'v{j}' for j in self.outputs)} = {call}"


@dataclass(frozen=True)
class Span:
    start: int  # first step of the checkpoint region
    stop: int  # one past its last step
    parent: int | None  # index of the enclosing span in `Recipe.spans`, or None
    policy: str | None  # a name in `jgraph.testing.build.POLICIES` (None: saves nothing)
    names: tuple[str, ...] = ()  # the names a name policy is given
    prevent_cse: bool = True  # as `jax.checkpoint(prevent_cse=...)`

    def policy_text(self) -> str:
        if self.policy is None:
            return "None"
        return f"{self.policy}{self.names!r}" if self.names else self.policy


@dataclass(frozen=True)
class Recipe:
    arguments: tuple[Any, ...]  # per call argument: a slot (a leaf) or ((key, slot), ...) (a dict)
    slots: tuple[Slot, ...]  # argument leaves first (in flattening order), then step outputs
    steps: tuple[Step, ...]  # in order; a step reads only earlier slots
    spans: tuple[Span, ...]  # checkpoint regions over steps; parents before children
    loss_terms: tuple[int, ...]  # float slots; loss = sum of their sums
    aux: tuple[int, ...]  # slots returned as the aux tuple (with `has_aux`)
    has_aux: bool  # the function returns (loss, aux)
    param_argnums: int | tuple[int, ...]  # as given to `jg.trace`
    dtype: str  # the floating dtype, "float32" or "float64"
    seed: int  # seed of the example arguments

    def leaves(self) -> int:
        return sum(1 if isinstance(a, int) else len(a) for a in self.arguments)

    def spans_of(self, step: int) -> tuple[int, ...]:
        """Indices of the spans holding `step`, outermost first."""
        return tuple(k for k, s in enumerate(self.spans) if s.start <= step < s.stop)

    def _depth(self, span: int) -> int:
        depth, parent = 0, self.spans[span].parent
        while parent is not None:
            depth, parent = depth + 1, self.spans[parent].parent
        return depth

    def _repr_pretty_(self, printer, cycle):  # hypothesis's (and IPython's) pretty printer
        printer.text(str(self))

    def __str__(self):
        params = self.param_argnums
        params = (params,) if isinstance(params, int) else params
        heads = []
        for i, a in enumerate(self.arguments):
            role = " (param)" if i in params else ""
            if isinstance(a, int):
                heads.append(f"a{i}: {self.slots[a]}{role}")
            else:
                inner = ", ".join(f"{k!r}: {self.slots[j]}" for k, j in a)
                heads.append(f"a{i}: {{{inner}}}{role}")
        lines = [f"def program({', '.join(f'a{i}' for i in range(len(self.arguments)))}):"
                 f"  # {self.dtype}, seed={self.seed}, param_argnums={self.param_argnums!r}"]
        lines += [f"    # {h}" for h in heads]
        for i, a in enumerate(self.arguments):
            if isinstance(a, int):
                lines.append(f"    v{a} = a{i}")
            else:
                lines += [f"    v{j} = a{i}[{k!r}]" for k, j in a]
        for i, step in enumerate(self.steps):
            for k, span in enumerate(self.spans):
                if span.start == i:
                    indent = "    " * (1 + self._depth(k))
                    lines.append(f"{indent}with checkpoint(region={k}, policy="
                                 f"{span.policy_text()}, prevent_cse={span.prevent_cse}):")
            lines.append("    " * (1 + len(self.spans_of(i))) + step.text())
        loss = " + ".join(f"sum(v{j})" for j in self.loss_terms)
        lines.append(f"    loss = {loss}")
        aux = ", ".join(f"v{j}" for j in self.aux) + ("," if len(self.aux) == 1 else "")
        lines.append(f"    return loss, ({aux})" if self.has_aux else "    return loss")
        return "\n".join(lines)


class Chooser:
    """Random choices for op families, drawn through hypothesis (so they shrink); `dtype` is
    the name of the recipe's floating dtype."""

    def __init__(self, draw, dtype: str):
        self._draw = draw
        self.dtype = dtype

    def integer(self, lo: int, hi: int) -> int:
        """An int in [lo, hi] (shrinks towards lo)."""
        from hypothesis import strategies as st

        return self._draw(st.integers(lo, hi))

    def boolean(self) -> bool:
        from hypothesis import strategies as st

        return self._draw(st.booleans())

    def choice(self, options: Sequence):
        """One of `options` (shrinks towards the first)."""
        from hypothesis import strategies as st

        return self._draw(st.sampled_from(tuple(options)))

    def subset(self, options: Sequence, min_size: int = 0, max_size: int | None = None) -> tuple:
        """Distinct elements of `options`, in their order in `options` (each taken on a coin,
        the first ones added up to `min_size`, cut at `max_size`; shrinks towards the first)."""
        from hypothesis import strategies as st

        options = tuple(options)
        taken = [self._draw(st.booleans()) for _ in options]
        for k in range(len(options)):
            if sum(taken) >= min_size:
                break
            taken[k] = True
        picked = [o for o, t in zip(options, taken, strict=True) if t]
        return tuple(picked[:len(options) if max_size is None else max_size])

    def permutation(self, n: int) -> tuple[int, ...]:
        from hypothesis import strategies as st

        return tuple(self._draw(st.permutations(range(n))))
