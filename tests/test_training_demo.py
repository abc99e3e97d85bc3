"""`python -m jgraph demo`: the command line, and (slow) the full demo's bar: >= 95 % validation
accuracy on digits, a PNG plot, the memory table."""

import subprocess
import sys

import pytest

from jgraph.__main__ import main


def test_usage_without_the_demo_command(capsys):
    assert main([]) == 2
    assert "python -m jgraph demo" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_reaches_95_percent_and_writes_the_plot(tmp_path):
    png = tmp_path / "loss.png"
    run = subprocess.run([sys.executable, "-m", "jgraph", "demo", "--no-progress", "--plot",
                          str(png)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "final val" in run.stdout and "XLA temp" in run.stdout
    assert f"loss curves written to {png}" in run.stdout
