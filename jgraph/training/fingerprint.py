"""What produced a training state: a fingerprint a state file records and `load` compares.

A state of the right shapes can still belong to another training setup: a model computing `sin`
where the file's computed `tanh` (same params), or adamax's state where adam's was saved (same
`ScaleByAdamState`). `Optimizer.save` records `fingerprint(...)` in the file's `meta`, and
`Optimizer.load(path, strict=True)` (and `fit`'s resume) refuses a file whose fingerprint differs,
saying what differs; `strict=False` is the opt-out for deliberate transfers. Recorded:

- `model`: a SHA-256 of the forward graph's printed text (memory addresses and shardings
  removed: a state moves between meshes) and of the bytes of its array constants, with a
  readable summary: the count of each op.
- `optimizer`: a description of the optax transformation read from its closures (`describe`:
  the factory functions' names and the hyperparameters they closed over, e.g.
  `chain(scale_by_adam(b1=0.9, ...), scale(step_size=-0.01))`), a SHA-256 of its update traced
  alone as a jgraph graph (the arithmetic of one step, learning-rate schedule included), and the
  optax state's tree structure with its leaf shapes.
- `loss`, `period`, `static`, and `batch`: the example batch's shapes and dtypes.
- the jgraph, JAX and optax versions (reported when a traced graph differs, as a possible cause).

What `describe` cannot see: module globals a function reads, the code of a function (two functions
of the same name and closure look alike), values hidden in compiled extensions. The traced update
catches every difference in the arithmetic of a step; it also changes when jgraph, JAX or optax
change how the same update is traced, which is why the versions are kept.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import inspect
import re

import jax
import numpy as np
import optax
from jax.core import ShapedArray

from jgraph import digest
from jgraph.config import __version__
from jgraph.ir import Graph, Var
from jgraph.training.graphs import tuple_tree
from jgraph.training.optimizer_step import optimizer_step

VERSION = 1
_MAX_DEPTH = 10  # of a transformation's closures
_MAX_ITEMS = 32  # per container described
_MAX_CHARS = 4000  # of a description
_SMALL_ARRAY = 16  # arrays up to this size are described by value
# A state file moves between meshes of any size, or none: where values live is not what the model
# computes, so sharding params are left out (`sharding=NamedSharding(mesh=AbstractMesh('data': 4,
# axis_types=(Auto,), ...), spec=P(None,))`: the mesh first, then the one level of parentheses left)
_MESH = re.compile(r"\b(?:Abstract)?Mesh\((?:[^()]|\([^()]*\))*\)")
_SHARDING = re.compile(r" ?sharding=\w*Sharding\((?:[^()]|\([^()]*\))*\)")


def _placement_free(text: str) -> str:
    return _SHARDING.sub("", _MESH.sub("Mesh", digest.ADDRESS.sub("", text)))


# -- the model ----------------------------------------------------------------------------------
def _op_counts(graph: Graph, counts: collections.Counter) -> collections.Counter:
    for eqn in graph.eqns:
        counts[eqn.op] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if isinstance(sub, Graph):
                    _op_counts(sub, counts)
    return counts


def graph_digest(graph: Graph) -> str:
    """SHA-256 of `str(graph)` (addresses and shardings removed) and of its array constants'
    bytes (`jgraph.digest`)."""
    return digest.graph_digest(graph, edit=_placement_free)


def model_fingerprint(graph: Graph) -> dict:
    return {"sha256": graph_digest(graph), "eqns": len(graph.eqns),
            "ops": dict(sorted(_op_counts(graph, collections.Counter()).items()))}


# -- the optimizer ------------------------------------------------------------------------------
def _is_transformation(obj) -> bool:
    return (not inspect.isroutine(obj) and not isinstance(obj, type)
            and callable(getattr(obj, "init", None)) and callable(getattr(obj, "update", None)))


def _closure(fn) -> dict:
    """The names and values `fn` closed over (empty cells left out)."""
    out = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return out


def _plain_values(tx) -> dict:
    """What `tx.init` closed over and `tx.update` did not, when it is plain data (the numeric
    hyperparameters `optax.inject_hyperparams` puts into the state); functions are left out
    (a chain's `init_fns` repeat what its update functions show)."""
    if not (inspect.isfunction(tx.init) and inspect.isfunction(tx.update)):
        return {}
    seen = _closure(tx.update)
    return {k: v for k, v in _closure(tx.init).items() if k not in seen and _plain(v)}


def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | complex | str | np.generic
                                       | np.ndarray | jax.Array)


def _factory(fn) -> str:
    """`scale_by_adam` for `scale_by_adam.<locals>.update_fn`; the qualname otherwise."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", type(fn).__name__)
    return name.split(".<locals>")[0]


class _Describer:
    def __init__(self):
        self.active: set[int] = set()  # objects being described (a cycle prints as `...`)

    def __call__(self, obj, depth: int = 0) -> str:
        if depth > _MAX_DEPTH or id(obj) in self.active:
            return "..."
        self.active.add(id(obj))
        try:
            return self._describe(obj, depth + 1)
        except Exception as e:  # noqa: BLE001 - a description never fails; it says what it saw
            return f"<{type(obj).__name__}: {type(e).__name__}>"
        finally:
            self.active.discard(id(obj))

    def _items(self, values, depth) -> str:
        values = list(values)
        shown = [self(v, depth) for v in values[:_MAX_ITEMS]]
        return ", ".join(shown + ([f"... {len(values) - _MAX_ITEMS} more"]
                                  if len(values) > _MAX_ITEMS else []))

    def _describe(self, obj, depth) -> str:
        if obj is None or isinstance(obj, bool | int | float | complex | str | bytes):
            return repr(obj)
        if isinstance(obj, np.generic):
            return repr(obj.item())
        if isinstance(obj, np.dtype | type):
            return getattr(obj, "__name__", str(obj))
        if isinstance(obj, np.ndarray | jax.Array):
            return _array(obj)
        if _is_transformation(obj):
            if isinstance(obj, tuple):  # optax's GradientTransformation: its update's closure,
                return self._function(obj.update, depth, _plain_values(obj))  # and init's data
            return self._instance(obj, depth)
        if isinstance(obj, dict):
            keys = sorted(obj, key=repr)
            return "{" + ", ".join(f"{k!r}: {self(obj[k], depth)}" for k in keys[:_MAX_ITEMS]) \
                + "}"
        if isinstance(obj, tuple | list | set | frozenset):
            values = sorted(obj, key=repr) if isinstance(obj, set | frozenset) else obj
            return f"({self._items(values, depth)})"
        if isinstance(obj, functools.partial):
            args = [self(a, depth) for a in obj.args]
            args += [f"{k}={self(v, depth)}" for k, v in sorted(obj.keywords.items())]
            return f"{self(obj.func, depth)}[{', '.join(args)}]"
        if inspect.ismethod(obj):
            return f"{self._instance(obj.__self__, depth)}.{obj.__name__}"
        if inspect.isfunction(obj):
            return self._function(obj, depth)
        if hasattr(obj, "__wrapped__"):  # a jitted or decorated function
            return self(obj.__wrapped__, depth)
        if callable(obj) and hasattr(obj, "__qualname__"):
            return _factory(obj)
        return self._instance(obj, depth)

    def _function(self, fn, depth, extra=None) -> str:
        closure = {**_closure(fn), **(extra or {})} if inspect.isfunction(fn) else None
        if closure is None:
            return self(fn, depth)
        inner = [v for v in closure.values() if _is_transformation(v)]
        if len(closure) == 1 and len(inner) == 1:  # a wrapper (optax's extra-args support)
            return self(inner[0], depth)
        if len(closure) == 1:
            (value,) = closure.values()
            if isinstance(value, tuple | list) and all(callable(v) for v in value):
                return f"{_factory(fn)}({self._items(value, depth)})"  # chain(a, b)
        args = ", ".join(f"{k}={self(v, depth)}" for k, v in sorted(closure.items()))
        return f"{_factory(fn)}({args})"

    def _instance(self, obj, depth) -> str:
        fields = getattr(obj, "__dict__", None)
        if not isinstance(fields, dict) or not fields:
            return type(obj).__name__
        args = ", ".join(f"{k.lstrip('_')}={self(v, depth)}" for k, v in sorted(fields.items())
                         if not k.startswith("__"))
        return f"{type(obj).__name__}({args})"


def _array(a) -> str:
    try:
        host = np.asarray(a)
    except (TypeError, ValueError):  # a typed key, a deleted buffer
        return f"{a.dtype}{list(np.shape(a))}"
    if host.size <= _SMALL_ARRAY:
        return f"{host.dtype}{list(host.shape)}{host.ravel().tolist()}"
    sha = hashlib.sha256(np.ascontiguousarray(host).tobytes()).hexdigest()[:12]
    return f"{host.dtype}{list(host.shape)}#{sha}"


def describe(tx) -> str:
    """An optax transformation as the factories and hyperparameters its closures show, e.g.
    `chain(scale_by_adam(b1=0.9, b2=0.999, ...), scale(step_size=-0.01))`; addresses removed."""
    text = digest.ADDRESS.sub("", _Describer()(tx))
    return text if len(text) <= _MAX_CHARS else text[:_MAX_CHARS] + "..."


def state_structure(tree) -> dict:
    """The optax state's tree structure and its leaves' dtypes and shapes."""
    leaves, treedef = jax.tree.flatten(tree)
    return {"tree": str(treedef),
            "leaves": [f"{jax.numpy.dtype(a.dtype).name}{list(np.shape(a))}" for a in leaves]}


def update_graph(tx, params_shape) -> Graph:
    """`tx`'s update alone, traced as jgraph traces it into the opt graph (params -> new params,
    new optimizer state), for params of these shapes."""
    leaves, tree = jax.tree.flatten(params_shape)
    params = tuple(Var(ShapedArray(np.shape(a), a.dtype)) for a in leaves)
    grads = tuple(Var(ShapedArray(np.shape(a), a.dtype)) for a in leaves)
    n = len(leaves)
    bare = Graph(inputs=params + grads, eqns=(), outputs=grads,
                 input_roles=("param",) * n + ("data",) * n, output_roles=("grad",) * n,
                 in_tree=tuple_tree([tree, tree]), out_tree=tuple_tree([tree]), param_argnums=0,
                 info={"grads_tree": tree})
    return optimizer_step(bare, tx)


# -- the record, and what differs -----------------------------------------------------------------
def fingerprint(*, forward: Graph, tx, trainable, opt_state, loss: str, period: int,
                static: bool, batch: str) -> dict:
    """The JSON record of a training setup (see the module docstring). `trainable` and
    `opt_state` are pytrees of arrays or ShapeDtypeStructs (the params without PRNG keys)."""
    return {"version": VERSION,
            "model": model_fingerprint(forward),
            "optimizer": {"transformation": describe(tx),
                          "update_sha256": graph_digest(update_graph(tx, trainable)),
                          "state": state_structure(opt_state)},
            "loss": loss, "period": period, "static": static, "batch": batch,
            "versions": {"jgraph": __version__, "jax": jax.__version__,
                         "optax": optax.__version__}}


def _short(value, limit: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _contrast(a: str, b: str, limit: int = 160) -> tuple[str, str]:
    """`a` and `b`, or (when long) the windows of both around their first difference."""
    if len(a) <= limit and len(b) <= limit:
        return a, b
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
             min(len(a), len(b)))
    start = max(0, i - 40)
    cut = lambda s: ("..." if start else "") + s[start:start + limit] + (  # noqa: E731
        "..." if len(s) > start + limit else "")
    return cut(a), cut(b)


def _ops_text(counts: dict) -> str:
    return ", ".join(f"{op}" + (f" x{n}" if n > 1 else "") for op, n in sorted(counts.items()))


def _model_difference(found, want: dict) -> str | None:
    if not isinstance(found, dict) or found.get("sha256") != want["sha256"]:
        ops = found.get("ops") if isinstance(found, dict) else None
        if not isinstance(ops, dict) or not all(type(n) is int for n in ops.values()):
            return "the forward graph differs (the file records no readable op counts)"
        theirs = {op: n - want["ops"].get(op, 0) for op, n in ops.items()
                  if n > want["ops"].get(op, 0)}
        ours = {op: n - ops.get(op, 0) for op, n in want["ops"].items() if n > ops.get(op, 0)}
        if not theirs and not ours:
            return ("the forward graph differs: the same ops, with other shapes, constants or "
                    "wiring")
        if theirs and ours:
            return (f"the forward graph differs: the file was written for a model computing "
                    f"{_short(_ops_text(theirs))} where this Optimizer's computes "
                    f"{_ops_text(ours)}")
        if ours:
            return (f"the forward graph differs: this Optimizer's model also computes "
                    f"{_ops_text(ours)}, which the file's did not")
        return (f"the forward graph differs: the file's model also computed "
                f"{_short(_ops_text(theirs))}, which this Optimizer's does not")
    return None


def _optimizer_differences(found, want: dict) -> list[str]:
    if not isinstance(found, dict):
        return ["optimizer: the file records no readable description"]
    out = []
    theirs, ours = found.get("transformation"), want["transformation"]
    if theirs != ours:
        a, b = _contrast(_short(theirs, 10_000), ours)
        out.append(f"optimizer: the file's is {a}; this Optimizer's is {b}")
    elif found.get("update_sha256") != want["update_sha256"]:
        out.append("optimizer: the same transformation as far as its closures show, but its "
                   "update traces to another graph (a value it reads from elsewhere, or another "
                   "version of jgraph, JAX or optax)")
    state = found.get("state")
    if not isinstance(state, dict) or state.get("tree") != want["state"]["tree"]:
        names = lambda s: ", ".join(re.findall(r"namedtuple\[(\w+)\]", s)) or s  # noqa: E731
        tree = state.get("tree") if isinstance(state, dict) else None
        a, b = _contrast(names(_short(tree, 10_000)), names(want["state"]["tree"]))
        out.append(f"optimizer state: the file's is {a}; this Optimizer's is {b}")
    elif state.get("leaves") != want["state"]["leaves"]:
        a, b = _contrast(_short(state.get("leaves"), 10_000), _short(want["state"]["leaves"],
                                                                    10_000))
        out.append(f"optimizer state leaves: the file's are {a}; this Optimizer's are {b}")
    return out


def differences(found, want: dict) -> list[str]:
    """What differs between a file's fingerprint (untrusted JSON) and this setup's, in words."""
    if not isinstance(found, dict) or found.get("version") != VERSION:
        version = found.get("version") if isinstance(found, dict) else None
        return [f"the file's fingerprint is of version {_short(version, 20)}, this jgraph "
                f"compares version {VERSION}"]
    out = []
    for name in ("loss", "period", "static", "batch"):
        if found.get(name) != want[name]:
            out.append(f"{name}: the file's is {_short(found.get(name))}, this Optimizer's is "
                       f"{_short(want[name])}")
    model = _model_difference(found.get("model"), want["model"])
    if model and not (model.endswith("wiring") and found.get("batch") != want["batch"]):
        out.append(model)  # (the same ops on another batch: the batch line says it)
    out += _optimizer_differences(found.get("optimizer"), want["optimizer"])
    versions = found.get("versions")
    if out and versions != want["versions"]:
        pairs = (f"{k} {_short(versions.get(k), 20) if isinstance(versions, dict) else '?'} vs "
                 f"{v}" for k, v in want["versions"].items())
        out.append(f"(written by another version: {', '.join(pairs)})")
    return out
