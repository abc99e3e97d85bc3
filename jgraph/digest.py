"""A graph's digest: SHA-256 of its printed text and of the bytes of its array constants.

`str(graph)` prints every eqn with its params, tags and regions, every input and output with its
role, and the regions; what it leaves out are array constants' values (printed by shape), which
the digest takes as bytes. Two graphs with one digest compute the same thing, with two
exceptions a caller decides about: Python objects in params print by name and memory address
(`printed`: the text, `by_identity`: whether it holds such an address), and numpy summarises a
large array held in a param (`...`). State files (`jgraph.training.fingerprint`) digest the
text with addresses and shardings removed; the plan cache (`jgraph.planner.cache`) keeps no
plan of a graph either exception applies to.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

import jax
import numpy as np

from jgraph.ir import Graph, Literal

ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a repr's memory address differs per process


def literals(graph: Graph):
    """The array constants of `graph` and its sub-graphs, in schedule order."""
    for eqn in graph.eqns:
        for a in eqn.inputs:
            if isinstance(a, Literal) and np.ndim(a.value) > 0:
                yield a
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if isinstance(sub, Graph):
                    yield from literals(sub)
    for a in graph.outputs:
        if isinstance(a, Literal) and np.ndim(a.value) > 0:
            yield a


def graph_digest(graph: Graph, text: str | None = None,
                 edit: Callable[[str], str] = lambda s: s) -> str:
    """SHA-256 of `edit(str(graph))` (`text`: `str(graph)`, when the caller has it) and of the
    bytes of the graph's array constants."""
    digest = hashlib.sha256(edit(str(graph) if text is None else text).encode())
    for lit in literals(graph):
        try:
            digest.update(np.ascontiguousarray(lit.value).tobytes())
        except (TypeError, ValueError):  # a typed PRNG key: its key data
            digest.update(np.asarray(jax.random.key_data(lit.value)).tobytes())
    return digest.hexdigest()


def by_identity(text: str) -> bool:
    """Whether a graph's text (`str(graph)`) holds what prints by identity or in part: a Python
    object by its address, or a large numpy array summarised."""
    return ADDRESS.search(text) is not None or "..." in text
