"""Benchmarks: each `bench_<topic>.py` has `rows(quick=False)`; `python -m benchmarks.run` runs all.

Shared helper: `interleaved_medians` times jgraph and its JAX reference in alternation, in the same
process, and returns the median of each (DESIGN §5: ratios, never an absolute time alone).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax


def _timed(fn: Callable) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def interleaved_medians(fns: dict[str, Callable], repeats: int,
                        warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each zero-argument `fn`, run in turn `repeats` times."""
    for _ in range(warmup):
        for fn in fns.values():
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}
