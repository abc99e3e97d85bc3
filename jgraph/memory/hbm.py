"""A TPU step's fit figure: the HBM it needs, found by compiling at an HBM size.

What decides whether a step fits a TPU is the compiler's own check (DESIGN §5,
`reference/tpu-figures.md`): the arguments (donated ones in full), the HLO buffers it places in
HBM (`default` memory space) and the program's code overlays must fit the chip's HBM size N
(`xla_tpu_max_hbm_size_mib`). No `memory_analysis()` field is that figure, and the need itself
moves with N: under a tight N the compiler keeps less code and schedules for memory. So the
figure is read off compiles at an HBM size:
- a compile that succeeds at N used `hbm_used` bytes: its buffers (the memory-usage report the
  compiler writes beside a dumped module) plus its code (`generated_code_size_in_bytes`);
- one that fails says what it needed at N: "Used X of N hbm" after code generation, or "the
  total memory required for HLO temporaries (X) exceeds available HBM (N)" after buffer
  assignment (a fast failure: 0.1-0.8 s).

`at_size(lowered, n)` is one compile: whether the step fits N MiB, and what it needed there.
`smallest_size(lowered)` is the exact figure: the smallest N (MiB) at which the step compiles,
found as bisection finds it, both ends compiled (it fits at N, not at N - 1 MiB), each probe
placed next to what the last compile used or needed there (the need moves little with the
size): 3-5 compiles, the last ones near the need.
"""

from __future__ import annotations

import glob
import math
import os
import re
import tempfile
from dataclasses import dataclass

from jgraph.errors import JGraphError

MIB = 2**20
_REPORT = re.compile(r"Memory Space: default \(color=0\)\nTotal bytes: (\d+)")
_USED = re.compile(r"Used ([\d.]+)([KMG]?) of [\d.]+[KMG]? hbm")
_TEMPORARIES = re.compile(r"HLO temporaries \(([\d.]+)([KMG]?)\) exceeds available HBM")
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


class HBMError(JGraphError, RuntimeError):
    """A step that does not fit the chip at all, or a TPU compiler whose output does not say what
    jgraph reads from it (another libtpu)."""


@dataclass(frozen=True)
class AtSize:
    """One compile of a step at an HBM size."""

    size_mib: int | None  # the HBM size compiled at (None: the chip's own)
    fits: bool  # it compiled there
    hbm_used: int  # bytes it needed there: buffers + code (fits) or what the failure reported
    compiled: object = None  # the compiled step, when it fits
    code_counted: bool = True  # False: it failed at buffer assignment, before any code existed


def at_size(lowered, options: dict, size_mib: int | None = None) -> AtSize:
    """Compile `lowered` (a `jax.stages.Lowered` for a TPU) at `size_mib` MiB of HBM (None: the
    chip's size) with `options`; a failure other than running out of HBM is raised."""
    extra = {} if size_mib is None else {"xla_tpu_max_hbm_size_mib": int(size_mib)}
    with tempfile.TemporaryDirectory(prefix="jgraph-hbm-") as dump:
        try:
            compiled = lowered.compile(compiler_options={**options, **extra,
                                                         "xla_dump_to": dump})
        except Exception as e:  # XlaRuntimeError: RESOURCE_EXHAUSTED
            needed = _needed(str(e))
            if needed is None:
                raise
            return AtSize(size_mib, False, needed[0], code_counted=needed[1])
        buffers = _report_bytes(dump)
    code = int(compiled.memory_analysis().generated_code_size_in_bytes)
    return AtSize(size_mib, True, buffers + code, compiled)


def at_chip(lowered, options: dict) -> AtSize:
    """The compile at the chip's own HBM size; a clear error when the step does not fit it."""
    first = at_size(lowered, options)
    if not first.fits:
        raise HBMError(f"jgraph: the step does not fit the chip's HBM: it needs "
                       f"{first.hbm_used / MIB:.2f} MiB (plan it under a budget: jg.remat(graph, "
                       "budget=..., target=...))")
    return first


def smallest_size(lowered, options: dict) -> tuple[int, AtSize]:
    """(the smallest HBM size in MiB at which `lowered` compiles, the compile at the chip's own
    size). Module docstring: both ends are compiled, the size found and one MiB below it."""
    first = at_chip(lowered, options)
    lo, hi = 0, None  # the largest size seen failing (0: nothing fits no HBM), smallest fitting
    got, compiles = first, 0
    while hi is None or lo + 1 < hi:
        # next to where the last compile says the need lies (it moves little with the size),
        # after a few such jumps halving what is left
        near = _ceil_mib(got.hbm_used)
        if got.fits and got.size_mib is not None:
            near = min(near, got.size_mib - 1)
        jump = compiles < JUMPS and lo < near and (hi is None or near < hi)
        probe = near if jump or hi is None else (lo + hi) // 2
        got = at_size(lowered, options, probe)
        compiles += 1
        if got.fits:
            hi = probe
        else:
            lo = probe
    return hi, first


JUMPS = 4  # compiles that try next to the last answer before the search halves the interval


def _ceil_mib(n: int) -> int:
    return max(1, math.ceil(n / MIB))


def _needed(message: str) -> tuple[int, bool] | None:
    """(the bytes a failure says the step needed, whether they count its code)."""
    for pattern in (_USED, _TEMPORARIES):
        m = pattern.search(message)
        if m:  # printed to 0.01 of its unit: rounded up, never under
            return math.ceil((float(m.group(1)) + 0.005) * _UNIT[m.group(2)]), pattern is _USED
    return None


def _report_bytes(dump: str) -> int:
    """The bytes the buffer assignment places in HBM, from the compiler's memory-usage report."""
    reports = glob.glob(os.path.join(dump, "*after_optimizations-memory-usage-report.txt"))
    found = []
    for path in reports:
        with open(path) as f:
            found += [int(m.group(1)) for m in _REPORT.finditer(f.read())]
    if len(found) != 1:
        raise HBMError(f"jgraph: TPU's compiler wrote {len(found)} memory-usage reports of HBM "
                       "for one step (expected one); this libtpu may name them differently")
    return found[0]
