"""`python -m jgraph demo [--epochs N ...]`: run the demo (see `jgraph.training.demo`)."""

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "demo":
        print("usage: python -m jgraph demo [--help]", file=sys.stderr)
        return 2
    from jgraph.training.demo import main as demo

    return demo(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
