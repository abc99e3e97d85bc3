"""Interrupts never lose training state: Ctrl-C in a step loop and in fit, SIGKILL during save.

Real signals to real processes, each bounded: a child that stops answering is killed and the test
fails. The step-loop and fit children answer every SIGINT with a line (see interrupt_children.py);
the save test kills forkserver children (cheap: jgraph is imported once) at random points.
Counts are printed (`pytest -s`); `-m slow` runs the larger variant.
"""

import multiprocessing
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import interrupt_children as children
import numpy as np
import pytest

from jgraph.training.state_io import read_state_file, save_state

HERE = Path(__file__).parent
ROOT = HERE.parent


class Child:
    """A child python process whose stdout lines arrive on a queue; always killed on close."""

    def __init__(self, *args):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
               "JAX_PLATFORMS": "cpu"}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "interrupt_children.py"),
                                      *map(str, args)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, timeout: float):
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> str:
        """Kill the child; its stderr's tail (for assertion messages)."""
        self.proc.kill()
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            err = ""
        return (err or "")[-3000:]


def test_held_sigint_delivers_after_the_block_and_stop_request_asks_then_aborts():
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


def interrupt(child: Child, count: int, gaps: tuple, seed: int, finish: bool = False) -> dict:
    """Send `count` SIGINTs at random moments (`gaps`: seconds after the previous answer); tally
    the child's answers. With `finish`, then wait for the child to finish a run uninterrupted."""
    rng = random.Random(seed)
    tally = {"sigint": 0, "ok": 0, "early": 0, "done": 0, "done_same": 0, "resent": 0, "lost": 0}
    assert child.expect(timeout=240) == "ready", child.close()
    while tally["sigint"] < count:
        time.sleep(rng.uniform(*gaps))
        child.proc.send_signal(signal.SIGINT)
        tally["sigint"] += 1
        answer = child.expect(timeout=20)
        while answer is None or answer.startswith("done"):
            if answer is None:  # a Ctrl-C that Python dropped (e.g. in a gc callback): again
                tally["resent"] += 1
                assert tally["resent"] <= count // 5, (tally, child.close())
                child.proc.send_signal(signal.SIGINT)
            else:
                tally["done"] += 1
                tally["done_same"] += answer == "done True"
            answer = child.expect(timeout=30)
            assert answer is not None or child.proc.poll() is None, (tally, child.close())
        kind = answer.split()[0]
        tally["lost" if kind == "LOST" else kind] += 1
        assert kind != "LOST", (answer, tally, child.close())
    while finish:
        answer = child.expect(timeout=120)
        assert answer is not None and answer.startswith("done"), (answer, tally, child.close())
        tally["done"] += 1
        tally["done_same"] += answer == "done True"
        finish = False
    return tally


def loop_counts(tmp_path, period, count, seed):
    child = Child("loop", period, 300, tmp_path / "state.jgs")
    try:
        return interrupt(child, count, (0.0005, 0.03), seed=seed)
    finally:
        child.close()


def fit_counts(tmp_path, count, seed):
    child = Child("fit", 6, tmp_path / "ckpt.jgs")
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
    tally = loop_counts(tmp_path, period, 300, seed=10 + period)
    print(f"\nstep loop, period {period}: {tally}")
    assert tally["ok"] == 300


@pytest.mark.slow
def test_many_sigints_in_fit(tmp_path):
    tally = fit_counts(tmp_path, 200, seed=11)
    print(f"\nfit: {tally}")
    assert tally["lost"] == 0 and tally["done"] >= 1


# -- SIGKILL and SIGINT during save -------------------------------------------------------------
def _server():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["interrupt_children", "jgraph.training.state_io"])
    return ctx


def _temporaries(folder: Path):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def kill_during_save(tmp_path, count: int, how: int, seed: int) -> dict:
    ctx, rng = _server(), random.Random(seed)
    path, nbytes = tmp_path / "state.jgs", 4 * 2**20
    want = [np.asarray(s["w"]).tobytes() for s in children.states(nbytes)]
    tally = {"signals": 0, "old_or_new": 0, "stale_tmp_seen": 0, "stale_tmp_after_save": 0}
    for _ in range(count):
        ready = ctx.Event()
        proc = ctx.Process(target=children.save_forever, args=(str(path), nbytes, ready))
        proc.start()
        try:
            assert ready.wait(timeout=120), "the saving child never started"
            time.sleep(rng.uniform(0.0, 0.05))
            os.kill(proc.pid, how)
            proc.join(timeout=30)
            assert proc.exitcode is not None, "the child survived its signal"
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
