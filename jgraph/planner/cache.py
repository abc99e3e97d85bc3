"""Plans kept by what they are plans of: a graph planned again under the same budget, on the same
kind of target, is not planned again.

`jg.remat(graph, budget=...)` (and the drop-ins and `jg.jit`, which call it per traced
signature) looks its plan up here first by `key`: the digest of the graph (`jgraph.digest`: its
printed text and its constants' bytes; with the step it runs, for `planned_then`), the budget,
`planner`, `chunks`, the target's kind (`Target.key`), and the XLA flags of the environment. A
plan is kept in the process always (the `MAX_ENTRIES` most recently used), and on disk in
`jgraph.config.plan_cache_dir` (`JGRAPH_PLAN_CACHE`; by default the figure cache's directory,
`JGRAPH_FIGURE_CACHE`) when one is named, keyed also by the jgraph, JAX, jaxlib and libtpu
versions, so a restarted job plans in no time. The files are pickles: name a directory only
you write to, as for any pickle.

Not kept: a graph whose text holds a Python object by identity or a summarised array
(`digest.by_identity`: two such graphs could print alike and differ), and a plan whose
planning raised (a byte budget no plan reaches: it is planned again, and raises again). A plan
that met no percentage keeps its warning, given again on each hit.
"""

from __future__ import annotations

import collections
import hashlib
import os
import pickle
import tempfile
from dataclasses import dataclass

from jgraph import config, digest
from jgraph.ir import Graph
from jgraph.memory.compiled import versions
from jgraph.target import Target

MAX_ENTRIES = 32  # plans kept in the process (each holds its graph)
FORMAT = 1  # of what a file holds


@dataclass(frozen=True)
class Kept:
    plan: Graph  # the planned graph, as `jg.remat` returned it (without `info["unplanned"]`)
    warning: Warning | None  # the `BudgetWarning` planning gave, if any


_PLANS: collections.OrderedDict[str, Kept] = collections.OrderedDict()


def key(graph: Graph, runs: Graph | None, budget, planner: str, chunks, target: Target
        ) -> str | None:
    """The cache key of `graph`'s plan (`runs`: the step that runs, when a caller appends to
    every graph planned), or None when it is not to be kept."""
    texts = [str(graph)] + ([] if runs is None else [str(runs)])
    if any(digest.by_identity(t) for t in texts):
        return None
    what = repr((budget, planner, chunks, target.key, os.environ.get("XLA_FLAGS", ""),
                 os.environ.get("LIBTPU_INIT_ARGS", ""), FORMAT))
    parts = [digest.graph_digest(graph, texts[0])]
    if runs is not None:
        parts.append(digest.graph_digest(runs, texts[1]))
    return hashlib.sha256(" ".join([what] + parts).encode()).hexdigest()


def get(found_key: str | None) -> tuple[Kept, str] | None:
    """(the plan kept under `found_key`, where it was found: "process" or "disk"), or None."""
    if found_key is None:
        return None
    if found_key in _PLANS:
        _PLANS.move_to_end(found_key)
        return _PLANS[found_key], "process"
    kept = _from_disk(found_key)
    if kept is None:
        return None
    _keep(found_key, kept)
    return kept, "disk"


def put(found_key: str | None, kept: Kept) -> None:
    if found_key is None:
        return
    _keep(found_key, kept)
    _to_disk(found_key, kept)


def clear() -> None:
    """Forget the plans kept in the process (the files stay)."""
    _PLANS.clear()


def _keep(found_key: str, kept: Kept) -> None:
    _PLANS[found_key] = kept
    while len(_PLANS) > MAX_ENTRIES:
        _PLANS.popitem(last=False)


def directory() -> str | None:
    return config.plan_cache_dir or config.figure_cache_dir


def _path(found_key: str) -> str:
    made_by = repr((config.__version__, versions()))
    name = hashlib.sha256(f"{made_by} {found_key}".encode()).hexdigest()
    return os.path.join(directory(), "plans", f"{name}.pickle")


def _from_disk(found_key: str) -> Kept | None:
    if not directory():
        return None
    try:
        with open(_path(found_key), "rb") as f:
            kept = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError,
            ValueError):  # absent, or written by other code: planned again
        return None
    return kept if isinstance(kept, Kept) and isinstance(kept.plan, Graph) else None


def _to_disk(found_key: str, kept: Kept) -> None:
    if not directory():
        return
    path = _path(found_key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(kept, f)
    except (pickle.PicklingError, TypeError, AttributeError):  # a param that does not pickle
        os.unlink(temporary)
        return
    os.replace(temporary, path)  # atomic
