"""Run every `benchmarks/bench_*.py` and print one table of ratios against the JAX reference.

    python -m benchmarks.run [--quick] [topic ...]

Each module exposes `rows(quick: bool = False) -> list[dict]` with the keys of `COLUMNS`. A ratio is
jgraph's figure divided by the reference's, measured in the same process (DESIGN §5).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
import traceback
from pathlib import Path

COLUMNS = ("benchmark", "jgraph", "reference", "ratio", "note")


def bench_modules(topics=()) -> list[str]:
    names = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                   if m.name.startswith("bench_"))
    if topics:
        names = [n for n in names if n.removeprefix("bench_") in topics or n in topics]
    return [f"benchmarks.{n}" for n in names]


def collect(quick: bool = False, topics=()) -> list[dict]:
    rows = []
    for name in bench_modules(topics):
        start = time.perf_counter()
        try:
            module_rows = importlib.import_module(name).rows(quick=quick)
        except Exception as e:  # one broken benchmark must not hide the others
            traceback.print_exc(file=sys.stderr)
            module_rows = [{"benchmark": name, "jgraph": "-", "reference": "-", "ratio": "-",
                            "note": f"FAILED: {type(e).__name__}: {e}"[:120]}]
        print(f"# {name}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
        rows += module_rows
    return rows


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.4g}"
    return str(value)


def format_table(rows: list[dict]) -> str:
    cells = [COLUMNS] + [tuple(_cell(r.get(c, "")) for c in COLUMNS) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("topics", nargs="*", help="only these bench_<topic> modules")
    args = parser.parse_args(argv)
    print(format_table(collect(args.quick, args.topics)))


if __name__ == "__main__":
    main()
