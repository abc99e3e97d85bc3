"""`python -m jgraph demo`: the command line (bad arguments end in one line and exit code 2 before
any training; optional imports checked up front; Ctrl-C exits 130), and (slow) the full demo's
bar: >= 95 % validation accuracy on digits, a PNG plot, the memory table."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import optax
import pytest

from jgraph.__main__ import main
from jgraph.training import demo


def test_usage_without_the_demo_command(capsys):
    assert main([]) == 2
    assert "python -m jgraph demo" in capsys.readouterr().err
    assert main(["train"]) == 2
    assert "'train'" in capsys.readouterr().err
    assert main(["--help"]) == 0


BAD = [  # (arguments, what the one line must say)
    (["--epochs", "0"], "--epochs: 0 is not in [1, 100000]"),
    (["--epochs", "-3"], "--epochs: -3 is not in"),
    (["--epochs", "2.5"], "--epochs: '2.5' is not an integer"),
    (["--batch-size", "0"], "--batch-size: 0 is not in"),
    (["--physical-batch-size", "-1"], "--physical-batch-size: -1 is not in"),
    (["--lr", "nan"], "--lr: nan is not a positive finite number"),
    (["--lr", "inf"], "--lr: inf is not a positive finite number"),
    (["--lr", "-0.1"], "--lr: -0.1 is not a positive finite number"),
    (["--lr", "fast"], "--lr: 'fast' is not a number"),
    (["--batch-size", "64", "--physical-batch-size", "48"], "is not a multiple of"),
    (["--batch-size", "8", "--physical-batch-size", "16"], "is not a multiple of"),
    (["--batch-size", "1000", "--physical-batch-size", "8"], "leaves no training batch"),
    (["--plot", "/nonexistent/dir/loss.png"], "does not exist"),
    (["--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_arguments_end_in_one_line_and_exit_code_2(capsys, monkeypatch, args, message):
    monkeypatch.setattr(demo, "_run", lambda args: pytest.fail("trained on bad arguments"))
    with pytest.raises(SystemExit) as info:
        main(["demo", *args])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("python -m jgraph demo: error:")
    assert message in err


def test_a_real_process_exits_with_code_2_and_one_line():
    run = subprocess.run([sys.executable, "-m", "jgraph", "demo", "--lr", "nan"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        "python -m jgraph demo: error: argument --lr: nan is not a positive finite number "
        "(see --help)"]


def without(monkeypatch, module):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == module else find(name, *a))


def test_missing_scikit_learn_is_reported_before_training(capsys, monkeypatch):
    without(monkeypatch, "sklearn")
    monkeypatch.setattr(demo, "_run", lambda args: pytest.fail("trained without its data"))
    with pytest.raises(SystemExit) as info:
        main(["demo"])
    assert info.value.code == 2
    assert "needs scikit-learn" in capsys.readouterr().err


def test_missing_matplotlib_skips_the_plot_with_a_note(capsys, monkeypatch):
    without(monkeypatch, "matplotlib")
    seen = {}

    def run(args):
        seen["no_plot"] = args.no_plot
        return 0

    monkeypatch.setattr(demo, "_run", run)
    assert main(["demo"]) == 0 and seen["no_plot"]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib is not installed: no plot" in err


def test_ctrl_c_exits_130_with_one_line(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_run", interrupted)
    assert main(["demo", "--epochs", "3"]) == 130
    assert "interrupted after 0 of 3 epochs" in capsys.readouterr().err


def test_the_planner_s_choice_is_described():
    assert demo.describe_plan({}) == "no remat"
    info = {"recomputed_eqns": {0: 20, 1: 19}, "policy": None, "planner": "auto", "used": "exact",
            "budget": 4096 * 1024, "budget_given": "50%", "plan": "segments [0-2)",
            "xla_temp": 2048 * 1024, "recompute_flops": 1.5e6, "planning_seconds": 0.25}
    assert demo.describe_plan(info) == (
        "segments [0-2); gradient step's XLA temp 2048.0 KiB for a budget of 4096.0 KiB "
        "(50%, within it); 39 eqns recomputed, 1.5e+06 flops; planned exact in 0.25 s")
    assert "(50%, not reachable: the least temp a plan reaches)" in demo.describe_plan(
        info | {"unmet": True})


@pytest.mark.slow
def test_demo_reaches_95_percent_and_writes_the_plots(tmp_path):
    png = tmp_path / "loss.png"
    run = subprocess.run([sys.executable, "-m", "jgraph", "demo", "--no-progress", "--plot",
                          str(png)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    memory_png = tmp_path / "loss-memory.png"
    assert memory_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "final val" in run.stdout and "XLA temp" in run.stdout
    assert f"loss curves written to {png}" in run.stdout
    assert f"memory timeline written to {memory_png}" in run.stdout
    assert "the budget planner chose:" in run.stdout


@pytest.mark.slow
def test_the_memory_table_tells_the_truth_and_remat_saves():
    """Every estimate within 25 % of XLA's temp; remat of every block and the budget plan really
    lower XLA's temp."""
    ds, n_in = demo.load_digits_dataset()
    params = demo.init_params(jax.random.PRNGKey(0), n_in)
    rows = demo.memory_table(params, ds, optax.adam(1e-3), 4, (16, 256))
    for name, batch, plan, estimate, temp, info, report in rows:
        assert 0.75 <= estimate / temp <= 1.25, (name, batch, plan)
        assert report.peak_bytes == estimate and (info == {}) == (plan == "no remat")
    temps = {(n, b, p): t for n, b, p, _, t, *_ in rows}
    for batch in (16, 256):
        assert temps["grad", batch, "every block"] < 0.9 * temps["grad", batch, "no remat"]
    # The planner's plan fits half of no remat's compiled temp (its budget) where that is
    # reachable: at micro-batch 256 activations dominate.
    assert temps["grad", 256, "budget 50%"] <= 0.5 * temps["grad", 256, "no remat"]


def test_the_pictures_go_to_a_folder_of_their_own(tmp_path, monkeypatch):
    """By default the PNGs go to `out/` (ignored by git), made on first use, never among the
    files of the folder the demo is started in."""
    monkeypatch.chdir(tmp_path)
    args = demo.parse_args([])
    assert args.plot == Path("out") / "jgraph-demo-loss.png" and (tmp_path / "out").is_dir()
    assert list(tmp_path.iterdir()) == [tmp_path / "out"]
