"""The hypothesis strategies: `recipes()`, `graphs()` and `programs()`.

Drawing order (what shrinking simplifies first): the call arguments (how many, leaf or dict,
shapes, kinds, which are params), the steps (each an op family applied to earlier values),
checkpoint spans over the steps with their policies and names, the loss terms, the aux outputs,
and the seed of the example inputs. Shrinking gives fewer arguments and steps, earlier groups and
families (`GROUPS` order, then registration order), the latest operands, smaller shapes, and no
regions, names or Python-scalar arguments.
"""

from __future__ import annotations

import functools
import math

import jax

from jgraph.testing import options
from jgraph.testing.build import POLICIES, Program, example_args, to_graph
from jgraph.testing.families import FAMILIES, GROUPS, MAX_RANK, MAX_SIZE
from jgraph.testing.recipe import (
    BOOL,
    FLOAT,
    INT,
    INT_HIGH,
    Chooser,
    Recipe,
    Slot,
    Span,
    Step,
    dtype_of,
)

NAMES = ("n0", "n1", "n2")  # names given by `checkpoint_name` and matched by name policies


class DrawnGraph(tuple):
    """`(graph, args)`, printed as the recipe it was built from; `.recipe` holds it."""

    def __new__(cls, graph, args, recipe):
        drawn = super().__new__(cls, (graph, args))
        drawn.recipe = recipe
        return drawn

    def __repr__(self):
        return f"graph of\n{self.recipe}"

    def _repr_pretty_(self, printer, cycle):  # hypothesis's (and IPython's) pretty printer
        printer.text(repr(self))


class DrawnProgram(tuple):
    """`(fn, args)`: `fn` is a `Program` with `param_argnums` and `has_aux` for `jg.trace`."""

    def __new__(cls, fn, args):
        drawn = super().__new__(cls, (fn, args))
        drawn.recipe = fn.recipe
        return drawn

    def __repr__(self):
        return f"program\n{self.recipe}"

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))


def recipes(*, dtype=None, min_steps: int = 1, max_steps: int = 10, ranks=(0, 3), dims=(1, 3),
            families=None,
            exclude=(), regions: bool = True, names: bool = True, aux: bool = True,
            integers: bool = True, loops: bool = True):
    """A strategy drawing `Recipe`s (see `graphs` for the options, each checked here, before
    anything is drawn: `TestingOptionError` names a bad one)."""
    from hypothesis import strategies as st  # optional (the test extra): asked for here

    options.float_dtype(dtype, drawing=False)
    min_steps, max_steps = options.steps(min_steps, max_steps)
    ranks, dims = options.shapes(ranks, dims)
    regions, names, aux, integers, loops = (
        options.flag(v, k) for k, v in (("regions", regions), ("names", names), ("aux", aux),
                                         ("integers", integers), ("loops", loops)))
    chosen = options.families(families, exclude, loops, integers)
    groups = {}  # group -> its families, in GROUPS order
    for g in GROUPS:
        if any(FAMILIES[n].group == g for n in chosen):
            groups[g] = tuple(n for n in chosen if FAMILIES[n].group == g)

    @st.composite
    def draw_recipe(draw):
        c = Chooser(draw, options.float_dtype(dtype))
        arguments, slots, param_argnums = _draw_arguments(c, integers, ranks, dims)
        steps = []
        for _ in range(2 * max_steps):  # past min_steps, a draw of 0 in [0, 7] ends the steps
            if len(steps) == max_steps or (len(steps) >= min_steps and c.integer(0, 7) == 0):
                break
            step = _draw_step(c, groups, slots, names)
            if step is not None:
                steps.append(step)
        spans = _draw_spans(c, 0, len(steps), None, 0, []) if regions and steps else []
        # The loss reads the last step's value (so that most steps matter) and up to 3 others.
        floats = [k for k, s in enumerate(slots) if s.kind == FLOAT]
        last = [k for k in (steps[-1].outputs if steps else ()) if slots[k].kind == FLOAT][:1]
        loss_terms = tuple(sorted({*last, *c.subset(floats, 0 if last else 1, 3)}))
        has_aux = aux and c.boolean()
        aux_slots = c.subset(range(len(slots)), 0, 2) if has_aux else ()
        return Recipe(arguments=arguments, slots=tuple(slots), steps=tuple(steps),
                      spans=tuple(spans), loss_terms=loss_terms, aux=tuple(aux_slots),
                      has_aux=has_aux, param_argnums=param_argnums, dtype=c.dtype,
                      seed=c.integer(0, 2**16))

    return draw_recipe()


def graphs(**kwargs):
    """A strategy drawing `(graph, args)`: a random well-formed forward graph and example
    arguments for it. Options: `dtype` (default: float64 when x64 is on, else float32),
    `min_steps`/`max_steps` (op family applications), `ranks` and `dims` (the ranges of the
    arguments' ranks and dim sizes, default (0, 3) and (1, 3)), `families` (names, default all) and
    `exclude`, `regions` (checkpoint regions, nested, with policies), `names`
    (`checkpoint_name`d values), `aux` (has_aux outputs), `integers` (integer and boolean side
    computations), `loops` (families of the group "loop": scan, fori_loop, cond/switch,
    while_loop; on by default)."""
    options.known_options(kwargs, "jg.testing.graphs")
    return recipes(**kwargs).map(lambda r: DrawnGraph(to_graph(r), example_args(r), r))


def programs(**kwargs):
    """A strategy drawing `(fn, args)`: a random JAX function (its checkpoint regions are
    `jax.checkpoint`s) and example arguments; trace it with
    `jg.trace(fn, *args, param_argnums=fn.param_argnums, has_aux=fn.has_aux)` or `fn.trace()`.
    Options as for `graphs`."""
    options.known_options(kwargs, "jg.testing.programs")
    return recipes(**kwargs).map(lambda r: DrawnProgram(Program(r), example_args(r)))


# -- the parts of a recipe -------------------------------------------------------------------------
def _draw_shape(c: Chooser, ranks, dims) -> tuple[int, ...]:
    return tuple(c.integer(*dims) for _ in range(c.integer(*ranks)))


def _draw_arguments(c: Chooser, integers: bool, ranks, dims):
    n_args = c.integer(1, 3)
    params = c.subset(range(n_args), min_size=1)
    arguments, slots = [], []

    def leaf(is_param):
        kind = FLOAT if is_param or not integers else c.choice((FLOAT, FLOAT, INT, BOOL))
        bound = {FLOAT: 1.0, INT: float(INT_HIGH), BOOL: 1.0}[kind]
        shape = _draw_shape(c, ranks, dims)
        weak = kind == FLOAT and shape == () and c.integer(0, 2) == 2
        slots.append(Slot(shape, kind, bound, weak))
        return len(slots) - 1

    for i in range(n_args):
        if c.boolean():
            arguments.append(tuple((f"w{k}", leaf(i in params)) for k in range(c.integer(1, 2))))
        else:
            arguments.append(leaf(i in params))
    if len(params) == 1 and c.boolean():
        param_argnums = params[0]
    else:
        param_argnums = tuple(params[k] for k in c.permutation(len(params)))
    return tuple(arguments), slots, param_argnums


def _draw_step(c: Chooser, groups, slots, names) -> Step | None:
    """A step of a drawn group and family; families that fit nothing drawn so far are skipped
    (three tries)."""
    for _ in range(3):
        family = FAMILIES[c.choice(groups[c.choice(tuple(groups))])]
        proposal = family.draw(c, tuple(slots))
        if proposal is not None:
            break
    else:
        return None
    static = tuple(sorted(proposal.static.items()))
    outs = _out_avals(family.apply, static, tuple(
        (slots[j].shape, dtype_of(c.dtype, slots[j].kind)) for j in proposal.operands))
    if outs is None or any(math.prod(shape) > MAX_SIZE or len(shape) > MAX_RANK
                           for shape, _ in outs):
        return None  # a proposal JAX rejects, or too big: the step is drawn again
    first = len(slots)
    for shape, kind in outs:
        slots.append(Slot(shape, kind, proposal.bound))
    name = None
    if names and outs[0][1] == FLOAT and c.integer(0, 3) == 3:
        name = c.choice(NAMES)
    return Step(family.name, tuple(proposal.operands), static,
                tuple(range(first, len(slots))), name)


@functools.lru_cache(maxsize=65536)
def _out_avals(apply, static, specs):
    """(shape, kind) of each output of `apply` on operands of these (shape, dtype), or None.
    (Weak types are left out: the families never mix kinds, so they change no output dtype.)"""
    try:
        out = jax.eval_shape(lambda *xs: apply(*xs, **dict(static)),
                             *(jax.ShapeDtypeStruct(s, d) for s, d in specs))
    except (TypeError, ValueError):
        return None
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return tuple((tuple(o.shape), _kind(o.dtype)) for o in outs)


def _kind(dtype) -> str:
    if jax.numpy.issubdtype(dtype, jax.numpy.floating):
        return FLOAT
    return BOOL if jax.numpy.dtype(dtype) == jax.numpy.dtype(bool) else INT


def _draw_spans(c: Chooser, lo: int, hi: int, parent, depth: int, spans: list) -> list:
    """Disjoint checkpoint spans in steps [lo, hi), each possibly holding nested ones."""
    at = lo
    while at < hi and depth < 3 and c.integer(0, 2) == 2:
        start = c.integer(at, hi - 1)
        stop = c.integer(start + 1, hi)
        policy = c.choice((None,) + tuple(POLICIES))
        span_names = c.subset(NAMES, 1, 2) if policy is not None and "names" in policy else ()
        spans.append(Span(start, stop, parent, policy, span_names, c.integer(0, 3) != 3))
        _draw_spans(c, start, stop, len(spans) - 1, depth + 1, spans)
        at = stop
    return spans
