"""Issue 28's bar "Ctrl-C and resume unchanged" for a step whose updates are fused into the
backward: `jg.fit(..., remat={"budget": "50%"})` with period 1 and no mesh plans the whole step,
and moves the adam update of the weights stacked over `lax.scan` layers into the backward scan.

A real SIGINT stops such a fit run mid-training; the checkpoint it writes reloads to the state
attached to the KeyboardInterrupt, a fresh process resumes from it, and the run ends bitwise where
the uninterrupted fused run ends (params, optimizer state and losses; the plan is made again on
resume and must be the same). The fused run also equals the run without remat within rounding:
fusion does not change training. The plan is checked to fuse an update, so the test cannot pass
on an unfused step.

Children run tests/fused_interrupt_child.py. They are started with SIGINT ignored (as `nohup`,
`cmd &` in a script and CI runners start them) and set their own handler, so the test does not
depend on how the suite was started; the parent sends signals and handles none. One deadline for
the whole test (minutes: a loaded machine makes it slower, never red); a child that ignores
SIGINT (/proc), or received its Ctrl-C and trained on, fails the test at once with what it printed.
"""

import collections
import json
import os
import queue
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import fused_interrupt_child as spec
import numpy as np
import pytest
from child_process import IGNORING, ignores_sigint, read_output

HERE = Path(__file__).parent
ROOT = HERE.parent
MINUTE = 60.0  # seconds
NTRAIN = int(0.75 * (spec.NDATA // spec.BATCH))  # training batches per epoch (val_split 0.25)


class Child:
    """A child running fused_interrupt_child.py MODE, always killed on close. Its stdout lines
    arrive on a queue; the tails of stdout and stderr are kept for failure messages. Every wait
    ends at `deadline` (monotonic), the test's."""

    def __init__(self, mode: str, *args, folder: Path, deadline: float):
        self.mode, self.deadline, self.sent = mode, deadline, 0
        self.signals = folder / f"{mode}-signals"
        self.signals.write_bytes(b"")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
               "JAX_PLATFORMS": "cpu", "FUSED_CHILD_SIGNALS": str(self.signals)}
        command = [sys.executable, "-c", IGNORING, str(HERE / "fused_interrupt_child.py"), mode,
                   *map(str, args)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.lines = queue.Queue()
        self.out, self.err = collections.deque(maxlen=30), collections.deque(maxlen=30)
        read_output(self.proc, self.lines, self.out, self.err)

    def fail(self, *what):
        """Fail the test now, with what the child printed."""
        self.close()
        time.sleep(0.2)  # the readers take the last lines
        pytest.fail("\n".join([f"{self.mode} child:", *map(str, what),
                               f"exit code: {self.proc.returncode}, SIGINTs sent: {self.sent}",
                               "stdout (tail):", *self.out, "stderr (tail):", *self.err]),
                    pytrace=False)

    def line(self) -> str:
        """The next line; fails at the deadline or when the child exits."""
        try:
            line = self.lines.get(timeout=max(0.0, self.deadline - time.monotonic()))
        except queue.Empty:
            self.fail("no line from the child within the test's deadline")
        if line is None:
            self.fail("the child exited")
        return line

    def received(self) -> int:
        """The SIGINTs the child's Python handlers have received so far."""
        return self.signals.stat().st_size

    def sigint(self):
        """Send SIGINT; fail at once if the child ignores it."""
        if ignores_sigint(self.proc.pid):
            self.fail("the child ignores SIGINT")
        self.proc.send_signal(signal.SIGINT)
        self.sent += 1

    def go(self):
        """Tell the child, waiting on its stdin, to go on."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self):
        """Wait for the child to exit by itself, with code 0."""
        try:
            code = self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.fail("the child did not exit within the test's deadline")
        if code != 0:
            time.sleep(0.2)
            self.fail(f"the child exited with {code}")

    def close(self):
        self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def stop_mid_training(child: Child, rng: random.Random, runs: int = 3) -> tuple:
    """Send one Ctrl-C a few milliseconds after a fit run's first epoch, and return where the
    run stopped: `(epoch, batch, step, same)`. A run that ends before the signal is delivered
    (a very loaded machine) gets the next run's; `runs` such runs at most. A child that prints
    two epochs after its handler received the signal trained on: it fails the test at once."""
    if (text := child.line()) != "ready":
        child.fail(f"expected 'ready', got {text!r}")
    run, epochs_after = 1, 0  # epochs ended after the run's SIGINT was received
    while True:
        kind, *rest = (text := child.line()).split() or [""]
        if kind == "epoch" and len(rest) == 2:
            epoch, received = map(int, rest)
            if child.sent < run:
                time.sleep(rng.uniform(0.0, 0.02))
                child.sigint()
            elif received >= child.sent:  # one epoch may end between the last step and then
                epochs_after += 1
                if epochs_after > 1:
                    child.fail(f"the child received its SIGINT and trained on to epoch {epoch}")
        elif kind == "finished":
            run, epochs_after = run + 1, 0
            if run > runs:
                child.fail(f"{runs} fit runs ended before their SIGINT reached them")
        elif kind == "stopped" and len(rest) == 4:
            return (*map(int, rest[:3]), rest[3] == "True")
        else:
            child.fail(f"unexpected line {text!r}")


def assert_bitwise(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), what
    for k in want:
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            diff = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0)
            pytest.fail(f"{what}: {k} differs ({a.dtype}{list(a.shape)} vs "
                        f"{b.dtype}{list(b.shape)}, max abs difference {diff:.3g})")


def results(folder: Path, name: str) -> tuple[dict, dict]:
    """A run's arrays and its plan (`fused`, `plan`, `xla_temp`, `budget`), as the child wrote
    them."""
    with np.load(folder / f"{name}.npz") as arrays:
        return dict(arrays), json.loads((folder / f"{name}.json").read_text())


@pytest.mark.extended
def test_sigint_in_fit_with_fused_updates_stops_cleanly_and_resumes_bitwise(tmp_path):
    deadline = time.monotonic() + 5 * MINUTE
    path = tmp_path / "ckpt.jgs"
    start = time.monotonic()
    # the resuming child makes the reference runs while the other one is interrupted
    resumed = Child("resume", path, tmp_path, folder=tmp_path, deadline=deadline)
    children = [resumed]
    try:
        children.append(child := Child("interrupt", path, tmp_path, folder=tmp_path,
                                       deadline=deadline))
        epoch, batch, step, same = stop_mid_training(child, random.Random(28))
        child.finish()  # a clean stop: fit raised KeyboardInterrupt, the child returned
        assert same, "the checkpoint written at the Ctrl-C does not reload to the state attached"
        assert NTRAIN <= step < spec.EPOCHS * NTRAIN, (epoch, batch, step)  # mid-training
        assert step == (epoch - 1) * NTRAIN + batch, (epoch, batch, step)
        if (text := resumed.line()) != "ready":
            resumed.fail(f"expected 'ready', got {text!r}")
        resumed.go()
        if (text := resumed.line()) != "done":
            resumed.fail(f"expected 'done', got {text!r}")
        resumed.finish()
    finally:
        for run in children:
            run.close()
    seconds = time.monotonic() - start
    want, plan = results(tmp_path, "reference")
    assert plan["fused"], f"the planner fused no update ({plan}): this would test an unfused step"
    assert plan["xla_temp"] <= plan["budget"], plan
    for name in ("interrupted", "resumed"):  # the plan is made again, and the same
        assert results(tmp_path, name)[1] == plan, name
    got, _ = results(tmp_path, "resumed")
    assert_bitwise(got, want, "resumed vs uninterrupted, both fused")
    plain, plain_plan = results(tmp_path, "plain")
    assert not plain_plan["fused"], plain_plan
    for k in want:  # fusing the updates does not change training
        if k.startswith("params"):
            np.testing.assert_allclose(want[k], plain[k], rtol=1e-5, atol=1e-6, err_msg=k)
    print(f"\nfused {plan['fused']} ({plan['plan']}); stopped in epoch {epoch} after {batch} "
          f"batches (step {step} of {spec.EPOCHS * NTRAIN}); {seconds:.1f} s")
