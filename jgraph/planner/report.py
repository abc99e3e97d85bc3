"""What a search says of the plan it returns (`info["remat"]`), and the estimate of a graph it
weighs, once per graph."""

from __future__ import annotations

import time
import weakref

from jgraph.ir import Graph
from jgraph.memory import peak_bytes
from jgraph.planner import validate

_PEAKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def peak(graph: Graph) -> int:
    """`jg.memory(graph).peak_bytes`, once per graph: the search meets the same plan's graph
    (`Problem.build` keeps them) again and again."""
    if graph not in _PEAKS:
        _PEAKS[graph] = peak_bytes(graph)
    return _PEAKS[graph]


def reported(graph: Graph, report: dict, plan: str, estimate: int, temp: int, retries: int,
             flops: float, started: float) -> Graph:
    """`graph` with `info["remat"]`: the search's `report` and the plan's figures, the seconds
    planning (compiles apart) and compiling."""
    info = dict(graph.info, remat=dict(
        graph.info.get("remat", {}), **report, plan=plan, estimated_peak=estimate,
        xla_temp=temp, retries=retries, recompute_flops=flops,
        planning_seconds=time.perf_counter() - started - validate.seconds,
        xla_seconds=validate.seconds))
    return graph.replace(info=info)
