"""Interrupts never lose training state: Ctrl-C in a step loop and in fit, SIGKILL during save;
a process started with SIGINT ignored keeps ignoring it, and SIGTERM ends it as by default.

Real signals to real processes. Each test sets the SIGINT handlers it relies on, in itself and in
its children, so it does not matter how the suite was started (a terminal, or `nohup`, `cmd &` and
CI runners, which start it with SIGINT ignored). Each test that drives a child has one deadline
for the whole test (minutes: a loaded machine makes it slower, never red), and fails at once,
showing what the child printed, when the child shows it ignored its signal: it ignores SIGINT
(/proc), or it received it and went on: a fit run ended, the step loop stepped, saves went on.
The step-loop and fit children answer every SIGINT with a line (see interrupt_children.py); the
save test kills forkserver children (cheap: jgraph is imported once) at random points.
Counts are printed (`pytest -s`); `-m slow` runs the larger variant.
"""

import collections
import multiprocessing
import os
import queue
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import interrupt_children as children
import numpy as np
import pytest
from child_process import IGNORING, ignores_sigint, read_output

from jgraph.training.state_io import read_state_file, save_state

HERE = Path(__file__).parent
ROOT = HERE.parent
MINUTE = 60.0  # seconds


@pytest.fixture
def sigint_ignored():
    """SIGINT ignored in this process for the test, as `nohup` or `cmd &` would start it."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, before)


def _parsed(line: str):
    """A child's line `RECEIVED TEXT` as `(int, text)`; None for any other line."""
    received, _, text = line.partition(" ")
    return (int(received), text) if received.isdigit() else None


class Child:
    """A child python process running interrupt_children.py, always killed on close.

    Its stdout lines arrive on a queue as `(SIGINTs it had received, text)`; the tails of its
    stdout and stderr are kept for failure messages. Every wait ends at `deadline` (monotonic),
    one for the whole test: lines that keep coming cannot stretch it. Two files in `folder` show
    the SIGINTs it has received, its steps and the lines it has printed, as they happen."""

    def __init__(self, *args, folder: Path, minutes: float, ignore_sigint: bool = False):
        self.signals, self.status = folder / "child-signals", folder / "child-status"
        self.signals.write_bytes(b"")
        self.status.write_bytes(bytes(8))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
               "JAX_PLATFORMS": "cpu", "INTERRUPT_CHILD_SIGNALS": str(self.signals),
               "INTERRUPT_CHILD_STATUS": str(self.status)}
        script = [str(HERE / "interrupt_children.py"), *map(str, args)]
        command = [sys.executable, *(["-c", IGNORING] if ignore_sigint else []), *script]
        self.deadline = time.monotonic() + minutes * MINUTE
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT)
        self.lines, self.sent, self.read = queue.Queue(), 0, 0
        self.out, self.err = collections.deque(maxlen=30), collections.deque(maxlen=30)
        read_output(self.proc, self.lines, self.out, self.err)

    def fail(self, *what):
        """Fail the test now, with what the child printed."""
        self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.2)  # the readers take the last lines
        pytest.fail("\n".join([*map(str, what), f"child exit code: {self.proc.returncode}",
                               "child stdout (tail):", *self.out,
                               "child stderr (tail):", *self.err]), pytrace=False)

    def line(self, until: float | None = None):
        """The next `(received, text)`; None at `until`; fails at the deadline or at the end."""
        end = self.deadline if until is None else min(until, self.deadline)
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                if end < self.deadline:
                    return None
                self.fail(f"no line from the child within the test's deadline "
                          f"({self.sent} SIGINTs sent)")
            if line is None:
                self.fail(f"the child exited ({self.sent} SIGINTs sent)")
            if (answer := _parsed(line)) is not None:
                self.read += 1
                return answer

    def received(self) -> int:
        """The SIGINTs the child's handlers have received so far."""
        return self.signals.stat().st_size

    def progress(self) -> tuple:
        """`(steps, lines)`: the steps the child's loop has made, the lines it has printed."""
        return struct.unpack("<II", self.status.read_bytes()[:8])

    def rest(self) -> list:
        """The `(received, text)` lines not read yet, once the child has exited."""
        lines = []
        while (line := self.lines.get(timeout=30)) is not None:
            if (answer := _parsed(line)) is not None:
                lines.append(answer)
        return lines

    def sigint(self):
        """Send SIGINT; fail at once if the child ignores it."""
        if ignores_sigint(self.proc.pid):
            self.fail("the child ignores SIGINT")
        self.proc.send_signal(signal.SIGINT)
        self.sent += 1

    def close(self):
        self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def test_held_sigint_delivers_after_the_block_and_stop_request_asks_then_aborts(sigint_handler):
    from jgraph.training.interrupts import StopRequest, held_sigint

    before = signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with held_sigint():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler runs here, and only records the signal
            done.append(True)
    assert done == [True] and signal.getsignal(signal.SIGINT) is before
    with StopRequest(note="") as stop:
        with held_sigint():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        assert stop.requested  # delivered to fit's handler: a request, no exception
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second one aborts
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) is before
    errors = []

    def in_a_thread():  # signals go to the main thread only: nothing to hold here
        try:
            with held_sigint(), StopRequest():
                pass
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    worker = threading.Thread(target=in_a_thread)
    worker.start()
    worker.join()
    assert not errors


def test_an_ignored_sigint_stays_ignored_in_held_blocks_and_stop_requests(sigint_ignored):
    from jgraph.training.interrupts import StopRequest, held_sigint

    with StopRequest(note="") as stop:
        with held_sigint():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert not stop.requested
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def interrupt(child: Child, count: int, gaps: tuple, seed: int, finish: bool = False,
              steps: bool = False) -> dict:
    """Send `count` SIGINTs at random moments (`gaps`: seconds after the previous answer); tally
    the child's answers. A Ctrl-C the child received and went on without answering (it finished
    a fit run after it; with `steps`, its step loop made steps after it) is lost in Python (a
    `KeyboardInterrupt` raised in a gc callback is only printed): it is sent again, a few times
    at most, then the test fails. With `finish`, then wait for the child to finish a run."""
    rng = random.Random(seed)
    tally = {"sigint": 0, "ok": 0, "early": 0, "done": 0, "done_same": 0, "resent": 0, "lost": 0}
    _, text = child.line()
    if text != "ready":
        child.fail(f"expected 'ready', got {text!r}")
    while tally["sigint"] < count:
        time.sleep(rng.uniform(*gaps))
        child.sigint()
        tally["sigint"] += 1
        seen = None  # the loop's steps when its SIGINT was seen received, and no answer printed
        while True:
            answer = child.line(time.monotonic() + 0.05 if steps else None)
            done = answer is not None and answer[1].startswith("done")
            if done:
                tally["done"] += 1
                tally["done_same"] += answer[1] == "done True"
            lost = done and answer[0] >= child.sent  # received before the run ended
            if answer is None and child.received() >= child.sent:
                made, printed = child.progress()
                if printed > child.read:  # its answer is on the way
                    seen = None
                elif seen is None:
                    seen = made
                else:
                    lost = made >= seen + 3  # two whole steps after it
            if lost:
                tally["resent"] += 1
                if tally["resent"] > count // 5:
                    child.fail("the child does not answer its SIGINTs", tally)
                child.sigint()
                seen = None
            elif answer is not None and not done:
                break
        kind = answer[1].split()[0]
        if kind not in ("ok", "early"):
            tally["lost"] += 1
            child.fail(f"answer {answer[1]!r}", tally)
        tally[kind] += 1
    if finish:
        _, text = child.line()
        if not text.startswith("done"):
            child.fail(f"expected a finished run, got {text!r}", tally)
        tally["done"] += 1
        tally["done_same"] += text == "done True"
    return tally


def loop_counts(tmp_path, period, count, seed, minutes=10):
    child = Child("loop", period, 300, tmp_path / "state.jgs", folder=tmp_path, minutes=minutes)
    try:
        return interrupt(child, count, (0.0005, 0.03), seed=seed, steps=True)
    finally:
        child.close()


def fit_counts(tmp_path, count, seed, minutes=10):
    child = Child("fit", 6, tmp_path / "ckpt.jgs", folder=tmp_path, minutes=minutes)
    try:
        tally = interrupt(child, count, (0.01, 0.2), seed=seed, finish=True)
        assert tally["done"] == tally["done_same"], tally  # every resumed chain is bitwise
        return tally
    finally:
        child.close()


@pytest.mark.parametrize("period", [1, 3])
def test_sigint_in_a_static_step_loop_never_loses_the_state(tmp_path, period):
    tally = loop_counts(tmp_path, period, 30, seed=period)
    print(f"\nstep loop, period {period}: {tally}")
    assert tally["ok"] == 30 and tally["lost"] == 0


def test_sigint_in_fit_stops_cleanly_and_resumes_bitwise(tmp_path):
    tally = fit_counts(tmp_path, 30, seed=7)
    print(f"\nfit: {tally}")
    assert tally["lost"] == 0 and tally["ok"] + tally["early"] == 30 and tally["ok"] >= 5
    assert tally["done"] >= 1  # chains of resumed runs finished, each bitwise


@pytest.mark.slow
@pytest.mark.parametrize("period", [1, 4])
def test_many_sigints_in_a_step_loop(tmp_path, period):
    tally = loop_counts(tmp_path, period, 300, seed=10 + period, minutes=30)
    print(f"\nstep loop, period {period}: {tally}")
    assert tally["ok"] == 300


@pytest.mark.slow
def test_many_sigints_in_fit(tmp_path):
    tally = fit_counts(tmp_path, 200, seed=11, minutes=30)
    print(f"\nfit: {tally}")
    assert tally["lost"] == 0 and tally["done"] >= 1


def test_fit_started_with_sigint_ignored_keeps_it_ignored_and_sigterm_ends_it(tmp_path):
    """Started as `nohup` starts it, fit never un-ignores SIGINT: Ctrl-Cs reach no handler and
    every run ends bitwise. SIGTERM ends the process at once (jgraph sets no handler for it); the
    checkpoint it leaves loads, and a fit started on it resumes and ends bitwise."""
    path, rng = tmp_path / "ckpt.jgs", random.Random(5)
    want = (0, "done True True")  # no SIGINT received; bitwise; SIGINT ignored in every epoch
    child = Child("fit-ignoring", 6, path, folder=tmp_path, minutes=10, ignore_sigint=True)

    def run_ended(answer):
        if answer != want:
            child.fail(f"expected {want}, got {answer}")
        return 1

    try:
        if child.line()[1] != "ready False":
            child.fail("expected 'ready False'")
        for _ in range(10):
            time.sleep(rng.uniform(0.01, 0.2))
            if not ignores_sigint(child.proc.pid):
                child.fail("the child no longer ignores SIGINT")
            child.proc.send_signal(signal.SIGINT)
            child.sent += 1
        runs = 0
        while (answer := child.line(until=time.monotonic())) is not None:  # printed so far
            runs += run_ended(answer)
        runs += run_ended(child.line()) + run_ended(child.line())  # two more runs
        while not path.exists():  # and a run that has written its checkpoint
            if time.monotonic() > child.deadline:
                child.fail("no checkpoint written within the test's deadline")
            time.sleep(0.001)
        child.proc.send_signal(signal.SIGTERM)
        try:
            code = child.proc.wait(timeout=max(0.0, child.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        if code != -signal.SIGTERM:
            child.fail(f"SIGTERM: exit code {code}, expected {-signal.SIGTERM}")
        runs += sum(map(run_ended, child.rest()))  # printed before SIGTERM
    finally:
        child.close()
    left = path.exists()
    if left:
        read_state_file(path)  # loadable: saves are atomic
    child = Child("fit-ignoring", 6, path, folder=tmp_path, minutes=10, ignore_sigint=True)
    try:
        if child.line()[1] != f"ready {left}" or child.line() != want:
            child.fail(f"a fit resuming from the checkpoint ({left}) SIGTERM left")
    finally:
        child.close()
    print(f"\nfit with SIGINT ignored: {runs} runs, 10 SIGINTs, checkpoint left: {left}")


# -- SIGKILL and SIGINT during save -------------------------------------------------------------
def _server():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["interrupt_children", "jgraph.training.state_io"])
    return ctx


def _temporaries(folder: Path):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def kill_during_save(tmp_path, count: int, how: int, seed: int, minutes: float = 10) -> dict:
    ctx, rng, deadline = _server(), random.Random(seed), time.monotonic() + minutes * MINUTE
    path, nbytes = tmp_path / "state.jgs", 4 * 2**20
    want = [np.asarray(s["w"]).tobytes() for s in children.states(nbytes)]
    tally = {"signals": 0, "old_or_new": 0, "stale_tmp_seen": 0, "stale_tmp_after_save": 0}
    for _ in range(count):
        ready, saves = ctx.Event(), ctx.Value("q", 0, lock=False)  # no lock: a SIGKILL holds none
        proc = ctx.Process(target=children.save_forever, args=(str(path), nbytes, ready, saves))
        proc.start()
        try:
            while not ready.wait(timeout=0.1):  # a child that dies first fails the test at once
                if proc.exitcode is not None:
                    pytest.fail(f"the saving child exited with {proc.exitcode} before it was "
                                f"ready (its error is on stderr above) {tally}")
                if time.monotonic() > deadline:
                    pytest.fail(f"the saving child did not start within the test's deadline "
                                f"{tally}")
            time.sleep(rng.uniform(0.0, 0.05))
            if how == signal.SIGINT and ignores_sigint(proc.pid):
                pytest.fail(f"the saving child ignores SIGINT {tally}")
            before = saves.value
            os.kill(proc.pid, how)
            while proc.exitcode is None:
                proc.join(timeout=0.05)
                if saves.value >= before + 3:  # two whole saves after the signal: ignored
                    pytest.fail(f"the saving child ignored its signal {how!r}: "
                                f"{saves.value - before} saves since it {tally}")
                if proc.exitcode is None and time.monotonic() > deadline:
                    pytest.fail(f"the saving child survived its signal {how!r} until the "
                                f"test's deadline {tally}")
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=30)
        tally["signals"] += 1
        _, arrays = read_state_file(path)  # loadable: the previous or the new state
        assert arrays["['w']"].tobytes() in want
        tally["old_or_new"] += 1
        stale = _temporaries(tmp_path)
        tally["stale_tmp_seen"] += bool(stale)
        if how == signal.SIGINT:  # an interrupted save cleans up after itself
            assert not stale, stale
        save_state(path, {"w": np.zeros(4, np.float32)})  # the next save removes stale ones
        tally["stale_tmp_after_save"] += len(_temporaries(tmp_path))
    assert tally["stale_tmp_after_save"] == 0, tally
    return tally


def test_sigkill_during_save_leaves_a_loadable_file_and_no_stale_temporaries(tmp_path):
    tally = kill_during_save(tmp_path, 50, signal.SIGKILL, seed=1)
    print(f"\nSIGKILL during save: {tally}")
    assert tally["old_or_new"] == 50


def test_sigint_during_save_removes_its_temporary(tmp_path):
    tally = kill_during_save(tmp_path, 20, signal.SIGINT, seed=2)
    print(f"\nSIGINT during save: {tally}")
    assert tally["old_or_new"] == 20 and tally["stale_tmp_seen"] == 0


@pytest.mark.slow
def test_many_sigkills_during_save(tmp_path):
    tally = kill_during_save(tmp_path, 300, signal.SIGKILL, seed=3)
    print(f"\nSIGKILL during save: {tally}")
