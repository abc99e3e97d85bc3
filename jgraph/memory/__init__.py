"""Memory: a model of what XLA:CPU allocates for a graph's donated step, and XLA's own figures.

`memory(graph)` (`report`) estimates the temp bytes of the compiled donated training step
(`compiled_memory(graph, *args).temp_bytes`, `compiled`) by replaying, on the graph, what XLA:CPU
does: fusion (`program`, with the per-op rules of `opkinds`), the donated step around the graph
(`step`), its scheduler (`schedule`) and its buffer assignment (`buffers`). The rules were read off
XLA's sources and checked on compiled HLO and buffer assignments of jaxlib 0.10 with default flags
(the concurrency-optimized breadth-first scheduler; YNNPACK dots and reductions):
`python -m benchmarks.bench_memory` and `tests/test_memory_model.py` show when XLA moves.
"""

from jgraph.memory.compiled import CompiledMemory, compiled_memory, donated_step
from jgraph.memory.report import MemoryReport, Residual, memory, peak_bytes, saved_residuals
from jgraph.memory.step import STATE_ROLES
from jgraph.opkinds import itemsize, nbytes

__all__ = ["CompiledMemory", "MemoryReport", "Residual", "STATE_ROLES", "compiled_memory",
           "donated_step", "itemsize", "memory", "nbytes", "peak_bytes", "saved_residuals"]
