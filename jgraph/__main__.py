"""`python -m jgraph demo [--epochs N ...]`: run the demo (see `jgraph.training.demo`).

A missing or unknown command prints a one-line usage and exits with code 2 (`--help`: code 0)."""

import sys

from jgraph.training.demo import main as demo

USAGE = "usage: python -m jgraph demo [--help]"


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] != "demo":
        got = f" (got {argv[0]!r})" if argv else ""
        print(f"{USAGE}{got}", file=sys.stderr)
        return 2
    return demo(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
