"""`MemoryReport.plot`: live temp bytes along XLA's schedule, drawn with matplotlib.

One curve per report (plans overlaid: no remat, remat, a budget plan), x the step of the step's
schedule in XLA's order, y the temp bytes live while it runs. The first report's steps are shaded
by role (forward, backward, recompute, updates and parameter copies), each curve's peak is marked
and, when given, XLA's compiled temp bytes (`jg.compiled_memory(...).temp_bytes`) are drawn as
dashed lines. matplotlib is imported only here, when a plot is asked for (the `demo` extra); the
figure is drawn without pyplot, so no global backend is touched.
"""

from __future__ import annotations

import operator
import os
from pathlib import Path

import numpy as np

from jgraph.errors import JGraphError

SHADES = {"forward": "#dbe9f6", "backward": "#fde0c5", "recompute": "#f4c7d6",
          "update": "#e2f0d9", "copy": "#ececec"}
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def plot_memory(path, reports, labels=None, compiled=None, title=None) -> Path:
    """Draw `reports` (MemoryReports, checked by `MemoryReport.plot`) to `path`; see
    `MemoryReport.plot`. Returns the path."""
    reports = tuple(reports)
    try:
        labels = [f"plan {k}" for k in range(len(reports))] if labels is None else list(labels)
    except TypeError:  # not iterable
        raise JGraphError(f"MemoryReport.plot(labels=...): one label per report (a list), got "
                          f"{labels!r:.60}") from None
    if len(labels) != len(reports):
        raise JGraphError(f"MemoryReport.plot: {len(labels)} labels for {len(reports)} reports")
    temps = _compiled(compiled, len(reports))
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ModuleNotFoundError("MemoryReport.plot needs matplotlib: pip install "
                                  "'jgraph[demo]'", name="matplotlib") from None
    fig = Figure(figsize=(8, 4.2))
    path = _checked_path(path, fig.canvas.get_supported_filetypes())
    scale, unit = _unit(max([r.peak_bytes for r in reports] + [t for t in temps if t] + [1]))
    ax = fig.subplots()
    _shade(ax, reports[0].step_roles)
    for k, (r, label, temp) in enumerate(zip(reports, labels, temps, strict=True)):
        color = COLORS[k % len(COLORS)]
        y = [b / scale for b in r.timeline]
        ax.step(range(len(y)), y, where="mid", color=color, lw=1.6,
                label=f"{label}: peak {r.peak_bytes / scale:.3g} {unit}")
        if y:
            i = max(range(len(y)), key=y.__getitem__)
            ax.plot([i], [y[i]], "v", color=color, ms=8)
            ax.annotate(f"peak (eqn {r.peak_eqn})", (i, y[i]), textcoords="offset points",
                        xytext=(4, 6), fontsize=8, color=color)
        if temp:
            ax.axhline(temp / scale, color=color, ls="--", lw=1,
                       label=f"{label}: XLA temp {temp / scale:.3g} {unit}")
    ax.set(xlabel="step of the compiled step, in XLA's order",
           ylabel=f"live temp ({unit})", title=title or "jgraph memory along the schedule")
    top = max([r.peak_bytes for r in reports] + [t for t in temps if t] + [1]) / scale
    ax.set_ylim(0, top * 1.18)  # room for the peak notes above the highest curve
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:  # a read-only folder or file, a name too long, a full disk
        raise JGraphError(f"MemoryReport.plot: cannot write {str(path)!r} "
                          f"({e.strerror or e})") from e
    return path


def _checked_path(path, formats) -> Path:
    """`path` as a Path whose folder exists and whose suffix matplotlib can write (none: .png,
    added here, so the returned path is the file written)."""
    if not isinstance(path, (str, os.PathLike)):
        raise JGraphError(f"MemoryReport.plot: the path is a file name (str or os.PathLike), "
                          f"got {type(path).__name__}")
    path = Path(path)
    try:
        is_dir = path.is_dir()
    except OSError as e:  # a name too long for the file system
        raise JGraphError(f"MemoryReport.plot: cannot write {str(path)!r} "
                          f"({e.strerror or e})") from e
    if is_dir:
        raise JGraphError(f"MemoryReport.plot: {path} is a folder; give a file name such as "
                          f"{path / 'memory.png'}")
    folder = path.resolve().parent
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise JGraphError(f"MemoryReport.plot: folder {folder} {what}")
    if not path.suffix:
        path = path.with_suffix(".png")
    if path.suffix[1:].lower() not in formats:
        raise JGraphError(f"MemoryReport.plot: matplotlib cannot write {path.suffix!r} files; "
                          f"use one of {', '.join('.' + f for f in sorted(formats))}")
    return path


def _compiled(compiled, n: int) -> list:
    if compiled is None:
        return [None] * n
    values = list(compiled) if isinstance(compiled, (list, tuple)) else [compiled] + [None] * (
        n - 1)
    if len(values) != n:
        raise JGraphError(f"MemoryReport.plot: {len(values)} compiled figures for {n} reports")
    out = []
    for v in values:
        v = getattr(v, "temp_bytes", v)
        if v is not None:
            try:  # Python and numpy integers
                v = None if isinstance(v, (bool, np.bool_)) else operator.index(v)
            except TypeError:
                v = None
            if v is None or v < 0:
                raise JGraphError(f"MemoryReport.plot(compiled=...): XLA's temp bytes (an int or "
                                  f"a jg.compiled_memory result), got {values[len(out)]!r}")
        out.append(v)
    return out


def _unit(top: int) -> tuple[int, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return scale, unit
    return 1, "B"


def _shade(ax, roles) -> None:
    """Shade runs of steps of one role: one collection per role (one legend entry each; a span
    per run would cost seconds on a remat plan of a 10k-eqn graph, where roles alternate)."""
    spans: dict[str, list] = {}
    start = 0
    for i in range(1, len(roles) + 1):
        if i == len(roles) or roles[i] != roles[start]:
            spans.setdefault(roles[start], []).append((start - 0.5, i - start))
            start = i
    for role, ranges in spans.items():
        ax.broken_barh(ranges, (0, 1), transform=ax.get_xaxis_transform(), lw=0,
                       color=SHADES.get(role, "#ffffff"), label=role)
