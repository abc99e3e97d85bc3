"""mkdocs hook: draw the guides' pictures (`docs/figures.py`) before a build, where absent."""

import pathlib
import subprocess
import sys

FIGURES = pathlib.Path(__file__).resolve().parent / "figures.py"


def on_pre_build(config):
    subprocess.run([sys.executable, str(FIGURES), "--missing"], check=True)
