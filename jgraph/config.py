"""jgraph's settings, and its version (`jgraph.__version__`; the state files' fingerprints name
it).

`check_graphs`: every public transform runs the full `jg.check` (shape rules included) on the graph
it is given, not only the cheap structural validation. Off by default (the full check costs a
shape-rule evaluation per eqn); on with `JGRAPH_CHECK_GRAPHS=1`, and in jgraph's own test suite.

`figure_cache_dir`: a directory where XLA's memory figures of compiled steps are kept across
processes (`jgraph.memory.compiled`); None (the default) keeps them in the process only. Set it,
or `JGRAPH_FIGURE_CACHE`, so a restarted job plans without compiling again.

`plan_cache_dir`: a directory where `jg.remat(budget=...)`'s plans are kept across processes
(`jgraph.planner.cache`: pickles, so a directory only you write to); None (the default) uses
`figure_cache_dir`, so naming one directory keeps both. Set it, or `JGRAPH_PLAN_CACHE`, so a
restarted job plans in no time.
"""

import os

__version__ = "0.1.0"  # as pyproject.toml says

check_graphs: bool = os.environ.get("JGRAPH_CHECK_GRAPHS", "") not in ("", "0", "false")
figure_cache_dir: str | None = os.environ.get("JGRAPH_FIGURE_CACHE") or None
plan_cache_dir: str | None = os.environ.get("JGRAPH_PLAN_CACHE") or None
