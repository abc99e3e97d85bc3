"""jgraph's settings, and its version (`jgraph.__version__`; the state files' fingerprints name
it).

`check_graphs`: every public transform runs the full `jg.check` (shape rules included) on the graph
it is given, not only the cheap structural validation. Off by default (the full check costs a
shape-rule evaluation per eqn); on with `JGRAPH_CHECK_GRAPHS=1`, and in jgraph's own test suite.
"""

import os

__version__ = "0.1.0"  # as pyproject.toml says

check_graphs: bool = os.environ.get("JGRAPH_CHECK_GRAPHS", "") not in ("", "0", "false")
