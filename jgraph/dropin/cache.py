"""The trace cache of the drop-in transforms: bounded, and retraced when what `fun` reads changes.

A trace bakes in what `fun` reads besides its arguments. `jax.grad` traces on every call, so a
training loop that rebinds a global `batch`, or sets `self.batch` before calling a bound method,
gets gradients of the new values; a cache that kept the first trace would silently return the old
ones. So each entry records what `fun` read when it was traced (`reads`): the values of its
closure cells and of the module globals its code names (nested functions' code included); the
same for the functions it wraps (`jax.jit(f)`, `jg.grad(f)`, `functools.partial`) or calls
through such a wrapper (the inner `jg.grad(g)` of `jg.grad(jg.grad(g))`); and, for a bound
method, `self`. A lookup traces again when one of them was rebound: an object by identity, a
number or string by value, a plain object (a user class hashed by identity) by identity and the
values of its attributes. Plain objects among the static arguments (the `self` of a decorated
method) are compared the same way (`static_key`). Changes the cache cannot see: a value mutated in
place (a numpy array written into, a dict given a new item, an attribute of an attribute) and
what other functions `fun` calls read from their own globals; as under `jax.jit`, those are baked
in at the first call of a signature.

The cache keeps the `MAX_ENTRIES` most recently used signatures, so a loop over ever new shapes
or static values does not hold every graph it traced.
"""

from __future__ import annotations

import functools
import threading
import types
from collections import OrderedDict

import jax

MAX_ENTRIES = 64


def reads(fun) -> tuple:
    """What `fun` reads from outside its arguments, as comparable keys (see the docstring)."""
    values, visited, own = [], set(), set()
    todo = [(fun, True)]  # (function, part of fun itself: partial, method, wrapper chain)
    while todo:
        f, itself = todo.pop()
        if id(f) in visited:
            continue
        visited.add(id(f))
        if itself:
            own.add(id(f))
        found = []
        if isinstance(f, functools.partial):  # its arguments are fixed objects: not rebindable
            todo.append((f.func, itself))
        elif isinstance(f, types.MethodType):
            found.append(f.__self__)
            todo.append((f.__func__, itself))
        elif isinstance(f, types.FunctionType):
            for cell in f.__closure__ or ():
                try:
                    found.append(cell.cell_contents)
                except ValueError:  # a cell not yet assigned
                    found.append(_UNASSIGNED)
            found += _globals_named(f.__code__, f.__globals__)
        wrapped = getattr(f, "__dict__", {}).get("__wrapped__") if not isinstance(
            f, types.FunctionType) else None
        if wrapped is not None:  # jax.jit(f), jg.grad(f), functools.wraps
            todo.append((wrapped, itself))
        for v in found:  # a jg.grad(g) that fun calls: what g reads too
            if "__wrapped__" in getattr(v, "__dict__", {}) and not isinstance(
                    v, types.FunctionType):
                todo.append((v, False))
        values += found
    # A recursive fun names itself: not a read (and the vjp cache, weakly keyed by fun, must not
    # keep it alive).
    return tuple(_key(v) for v in values if not isinstance(v, types.ModuleType)
                 and id(v) not in own)


_UNASSIGNED = object()


def _globals_named(code: types.CodeType, namespace: dict) -> list:
    return [namespace[n] for n in _names(code) if n in namespace]


@functools.lru_cache(maxsize=1024)
def _names(code: types.CodeType) -> tuple:
    """The global (and attribute) names a code object uses, its nested functions' included."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # a lambda or def inside fun
            names += _names(const)
    return tuple(dict.fromkeys(names))


_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _key(value):
    """How a value `fun` reads is compared: as a static leaf is (`static_key`) if it is a scalar
    or a plain object, else by identity (the entry keeps it alive, so its id is not reused)."""
    return static_key(value) if isinstance(value, _SCALARS) or _plain_object(value) else \
        _Same(value)


def _plain_object(value) -> bool:
    """An instance of a user class hashed by identity, with attributes."""
    return type(value).__hash__ is object.__hash__ and isinstance(
        getattr(value, "__dict__", None), dict) and not isinstance(
        value, (type, types.FunctionType, types.BuiltinFunctionType))


def static_key(value):
    """How a static leaf is compared: Python floats and complexes bitwise (`hash(nan)` is per
    object, -0.0 == 0.0); a plain object by identity and the values of its attributes (so one
    whose `scale` was set anew is not the same; its attributes' attributes are not looked into);
    anything else by its `==` and `hash`."""
    if isinstance(value, float):
        return (type(value), value.hex())
    if isinstance(value, complex):
        return (type(value), value.real.hex(), value.imag.hex())
    if _plain_object(value):
        attrs = tuple((k, static_key(v) if isinstance(v, _SCALARS) else _Same(v))
                      for k, v in vars(value).items())
        return (type(value), _Same(value), attrs)
    return (type(value), value)


class _Same:
    """Equal to another `_Same` of the very same object."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Same) and other.value is self.value

    def __hash__(self):
        return id(self.value)


class TraceCache:
    """Signature -> entry, least recently used first out; an entry traced while `fun` read other
    values than it reads now is a miss. Safe to share between threads (two threads missing at
    once both trace; the last one's entry stays)."""

    def __init__(self, max_entries: int | None = None):
        self.max_entries = MAX_ENTRIES if max_entries is None else max_entries
        self._entries: OrderedDict = OrderedDict()  # signature -> (reads, entry)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, signature, now_reads: tuple):
        with self._lock:
            found = self._entries.get(signature)
            if found is None or found[0] != now_reads:
                return None
            self._entries.move_to_end(signature)
            return found[1]

    def put(self, signature, now_reads: tuple, entry) -> None:
        if any(isinstance(k, _Same) and isinstance(k.value, jax.core.Tracer) for k in now_reads):
            return  # fun reads a value of an enclosing trace: an entry must not outlive it
        with self._lock:
            self._entries[signature] = (now_reads, entry)
            self._entries.move_to_end(signature)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
