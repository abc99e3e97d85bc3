"""Ctrl-C without losing the training state: a held SIGINT, and a stop requested between steps.

A static step donates the old state's buffers to the compiled call; if a `KeyboardInterrupt`
lands after that call but before the new state is bound, both states are gone. `held_sigint()`
makes that window atomic: a SIGINT that arrives inside it is recorded and delivered, to whatever
handler was installed before, as soon as the window closes (the step is complete by then).

`StopRequest` is what `fit` installs for a whole run: the first Ctrl-C only asks the loop to stop
at the next step boundary (the loop polls `requested`); a second one raises `KeyboardInterrupt`
at once. Both work only in the main thread, the only one Python delivers signals to, and only
where SIGINT's handler was installed from Python (as it is by default) and SIGINT is not ignored
(SIG_IGN: `nohup`, `cmd &` in a script, many CI runners, where it stays ignored, as the launcher
asked); elsewhere they do nothing.
"""

from __future__ import annotations

import signal
import sys
import threading

try:  # the C module: `signal.signal` wraps it in enum conversions that cost a step microseconds
    from _signal import getsignal as _get_handler
    from _signal import signal as _set_handler
except ImportError:  # pragma: no cover - not CPython
    _get_handler, _set_handler = signal.getsignal, signal.signal


def _can_handle() -> bool:
    """Main thread, and a SIGINT handler that Python installed (so it can be put back) and that is
    not SIG_IGN: a process started with SIGINT ignored (`nohup`, `cmd &` in a script, CI runners)
    was asked to run through it, and a handler of ours would un-ignore it."""
    return (threading.current_thread() is threading.main_thread()
            and _get_handler(signal.SIGINT) not in (None, signal.SIG_IGN))


def _deliver(handler, signum, frame) -> None:
    """Run the SIGINT handler that a held signal was meant for."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:  # the default action, now that the step is complete
        signal.raise_signal(signum)


class held_sigint:  # noqa: N801 - used as a context manager, like contextlib's helpers
    """Hold SIGINT for the duration of a `with` block; deliver a held one when it ends."""

    def __enter__(self):
        self.pending, self.active = None, _can_handle()
        if self.active:
            self.previous = _set_handler(signal.SIGINT, self._hold)
        return self

    def _hold(self, signum, frame):
        self.pending = (signum, frame)

    def __exit__(self, *exc) -> bool:
        if self.active:
            _set_handler(signal.SIGINT, self.previous)
            if self.pending is not None:
                _deliver(self.previous, *self.pending)
        return False


class StopRequest:
    """`with StopRequest() as stop: ... if stop.requested: ...`; Ctrl-C asks, again aborts."""

    def __init__(self, note: str = "stopping after this step (Ctrl-C again to abort)"):
        self.note = note
        self.requested = False
        self.active = False

    def __enter__(self):
        self.active = _can_handle()
        if self.active:
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:  # the second Ctrl-C: abort now
            raise KeyboardInterrupt
        self.requested = True
        if self.note:
            print(f"\njgraph: Ctrl-C: {self.note}", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> bool:
        if self.active:
            signal.signal(signal.SIGINT, self.previous)
        return False
