"""The README's first command, as a script: `python examples/digits_demo.py [--epochs N ...]`.

Same as `python -m jgraph demo`: an MLP on scikit-learn's digits trained with `jg.fit`, gradient
accumulation and remat, with a progress bar, final statistics, a memory table and a PNG plot.
"""

import sys

from jgraph.training.demo import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
